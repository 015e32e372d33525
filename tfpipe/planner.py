"""Before a run: what a pipeline configuration costs, and which one to use.

`tfpipe.plan(model, batch_size, num_microbatches, ...)` answers, before
anything trains, the questions a run's configuration raises: how many
parameters and how many bytes each stage holds, whether it fits the
devices, how long a step takes and how much of it the bubble wastes, and
which M, balance, schedule and recompute mode would do better.

What is *measured* (once, on the model's own layers, in training mode, on
the default device, on a random batch of one micro-batch's rows; every
variable is put back afterwards):

* per unit (`tfpipe.graph`: a layer or raw-op call), its forward and its
  forward + backward as two small `tf.function`s, the fastest of `repeats`
  runs each, at two micro-batch sizes (the requested one and a quarter of
  it), so time = fixed + per-row cost can be predicted for any M;
* per unit, the tensors its backward keeps from its forward: the traced
  forward + backward graph is read, and every floating-point tensor made
  by the forward (or given to it) that a gradient op reads is counted once
  (a ReLU's output, a matmul's input; variable reads excluded). This is
  what a stage stashes per micro-batch when it does not recompute.

What is *counted* from the model: parameters and their bytes per stage
(each variable once, on the first stage that uses it, as `PipelinedModel`
places it), gradients (one per trainable variable, its dtype), optimizer
slots (Adam 2 per parameter, SGD with momentum 1, ...; `OPTIMIZER_SLOTS`),
and the bytes crossing each cut (a stage's input per micro-batch).

What is *predicted*:

* activations: the schedule is simulated (`tfpipe.schedules.simulate`) with
  the measured per-stage costs; walking each device's actions in order, a
  forward adds the micro-batch's stash (the whole stash when it is not
  recomputed, only the stage's input when it is: `recompute`), its backward
  adds the replayed stash (when recomputed) and a workspace (the gradients
  of one unit's inputs and outputs) and then frees the micro-batch. The
  device's activation peak is the largest sum it reaches; a stage's is the
  same walk for that stage alone. Bytes scale linearly with micro-batch
  rows (ceil(batch_size / M), the largest micro-batch).
* peak memory of a stage: parameters + optimizer state + gradients +
  activation peak; of a device: the sum over its stages' static bytes +
  the device's activation peak. Not included: the traced program, the
  runtime, the input batch, framework workspace beyond the estimate above.
* step time: the simulated makespan of forward + backward (the simulator
  adds a second forward to each recomputed micro-batch's backward,
  `schedules.simulate(recompute=)`), with per-stage costs
  from the measured unit times at the micro-batch size; communication is
  free and the optimizer update is not counted. `bubble_fraction` is the
  simulator's idle share.
* a recommendation for the devices at hand: among M dividing batch_size
  (up to `max_microbatches`, and the requested M), schedules "gpipe",
  "1f1b", "zbh1", "interleaved" and "zbv" (when the model has enough units),
  recompute modes, and balances (the given one, and the one minimising the
  slowest stage's measured time), the configuration with the shortest
  predicted step whose every device peak fits `device_memory_bytes` (when
  given).

How well it predicts memory is measured against real processes
(`tfpipe_tests/test_planner.py`, BUILD.md "Planning a run").
"""

import dataclasses
import time

import keras
import numpy as np

from tfpipe import costs
from tfpipe import cutting
from tfpipe import graph as graph_lib
from tfpipe import partition
from tfpipe import placement
from tfpipe import schedules

# Optimizer state per trainable parameter, in units of the parameter's bytes.
OPTIMIZER_SLOTS = {
    "sgd": 0, "adam": 2, "adamw": 2, "adamax": 2, "nadam": 2, "adadelta": 2,
    "adagrad": 1, "rmsprop": 1, "lion": 1, "ftrl": 2, "lamb": 2, "adafactor": 1,
}
RECOMMEND_SCHEDULES = ("gpipe", "1f1b", "zbh1", "interleaved", "zbv")
MIB = 2.0**20


def optimizer_slots(optimizer):
    """Optimizer state per trainable parameter (0 for SGD, 2 for Adam, ...).

    Args:
      optimizer: a name ("adam", "sgd", "sgd+momentum", ...), a Keras
        optimizer instance (its momentum, amsgrad and centered settings are
        read), or a number of slots.
    """
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        if optimizer < 0:
            raise ValueError(f"optimizer={optimizer!r}: a number of state slots per "
                             f"parameter must be >= 0.")
        return float(optimizer)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        name = type(optimizer).__name__.lower()
        slots = OPTIMIZER_SLOTS.get(name)
        if name == "sgd":
            slots = 1 if getattr(optimizer, "momentum", 0) else 0
        elif name == "adam" and getattr(optimizer, "amsgrad", False):
            slots = 3
        elif name == "rmsprop":
            slots = (1 + bool(getattr(optimizer, "momentum", 0))
                     + bool(getattr(optimizer, "centered", False)))
        if slots is not None:
            return float(slots)
        optimizer = name
    if isinstance(optimizer, str):
        key = optimizer.lower().replace("_", "").replace(" ", "")
        if key in ("sgd+momentum", "momentum", "sgdmomentum"):
            return 1.0
        if key in OPTIMIZER_SLOTS:
            return float(OPTIMIZER_SLOTS[key])
    raise ValueError(
        f"optimizer={optimizer!r} is not one the planner knows. Use a name "
        f"({', '.join(sorted(OPTIMIZER_SLOTS))} or 'sgd+momentum'), a Keras optimizer "
        f"instance, or the number of state slots per parameter (e.g. optimizer=2).")


# -- stages, memory walk, one configuration --------------------------------------


@dataclasses.dataclass
class StagePlan:
    """One stage of a plan. Bytes are per stage; `*_per_microbatch` at the
    plan's micro-batch rows; seconds per micro-batch.

    Attributes:
      stage, device: index, and the device name it runs on.
      units: how many units (layers and raw ops) it holds; `first`, `last`:
        the names of its first and last unit.
      params: elements of the variables it owns (each variable once, on the
        first stage using it), as `PipelinedModel.pipeline_summary` counts.
      param_bytes, optimizer_bytes, gradient_bytes: their bytes, the
        optimizer's slots and one gradient per trainable variable.
      input_bytes_per_microbatch: what crosses into it (kept when recomputing).
      stash_bytes_per_microbatch: what its backward keeps when not recomputing.
      activation_bytes: the predicted peak of its live activations (stashes,
        replays and backward workspace) under the schedule and recompute mode.
      peak_bytes: param + optimizer + gradient + activation bytes.
      forward_s, backward_s: predicted seconds per micro-batch; the
        backward alone (a recomputed micro-batch's replay costs a forward_s
        more, which the step time counts).
    """

    stage: int
    device: str
    units: int
    first: str
    last: str
    params: int
    param_bytes: int
    optimizer_bytes: int
    gradient_bytes: int
    input_bytes_per_microbatch: int
    stash_bytes_per_microbatch: int
    activation_bytes: int
    peak_bytes: int
    forward_s: float
    backward_s: float


@dataclasses.dataclass
class _Config:
    """One evaluated configuration (what the recommendation compares)."""

    num_microbatches: int
    schedule: object
    recompute: str
    balance: list
    stages: list
    device_peak_bytes: list
    host_peak_bytes: int
    step_time_s: float
    bubble_fraction: float

    def fits(self, limit):
        return None if limit is None else max(self.device_peak_bytes) <= limit


def _stage_inputs(graph, balance):
    pieces = cutting.cut(graph, balance)
    return [graph_lib.refs(piece.inputs) for piece in pieces]


def _evaluate(graph, units, tensor_bytes, rows_measured, batch_size, m, schedule, mode,
              balance, devices, slots, timed):
    """Predicts one configuration: stage table, device peaks, step time."""
    k_count = len(balance)
    d_count = k_count // schedule.virtual_stages
    rows = -(-batch_size // m)
    scale = rows / rows_measured
    inputs = _stage_inputs(graph, balance)
    static, info, forward, backward = [], [], [], []
    start = 0
    for s, size in enumerate(balance):
        group = units[start:start + size]
        start += size
        kept_ids = set().union(*(u.saved_ids for u in group))
        stash = sum(u.saved_internal for u in group) + sum(tensor_bytes.get(i, 0)
                                                           for i in kept_ids)
        boundary = sum(tensor_bytes.get(i, 0) for i in inputs[s])
        replay = stash - sum(tensor_bytes.get(i, 0) for i in kept_ids & set(inputs[s]))
        work = max((u.workspace_bytes for u in group), default=0)
        info.append({"stash": stash * scale, "input": boundary * scale,
                     "replay": replay * scale, "work": work * scale})
        trainable = sum(u.trainable_bytes for u in group)
        static.append({"params": sum(u.params for u in group),
                       "param_bytes": sum(u.param_bytes for u in group),
                       "optimizer_bytes": int(round(slots * trainable)),
                       "gradient_bytes": trainable, "first": group[0].name,
                       "last": group[-1].name, "units": size})
        f = sum(u.forward[0] + u.forward[1] * rows for u in group)
        b = sum(u.backward[0] + u.backward[1] * rows for u in group)
        forward.append(f)
        backward.append(b)
    if timed:  # the simulator adds each replayed micro-batch's forward to its backward
        sim = schedules.simulate(schedule, m, d_count, forward_cost=forward,
                                 backward_cost=backward, recompute=mode)
    else:  # no times: equal stages (F=1, B=2, replays priced), for the bubble and order
        sim = schedules.simulate(schedule, m, d_count, recompute=mode)
    stage_peak, device_act, host_act = _activation_peaks(sim, info, mode, m, k_count)
    stage_device = [schedule.stage_device(s, d_count) for s in range(k_count)]
    device_peak = list(device_act)
    stages = []
    for s in range(k_count):
        st = static[s]
        fixed = st["param_bytes"] + st["optimizer_bytes"] + st["gradient_bytes"]
        device_peak[stage_device[s]] += fixed
        stages.append(StagePlan(
            stage=s, device=devices[stage_device[s]], units=st["units"], first=st["first"],
            last=st["last"], params=st["params"], param_bytes=st["param_bytes"],
            optimizer_bytes=st["optimizer_bytes"], gradient_bytes=st["gradient_bytes"],
            input_bytes_per_microbatch=int(info[s]["input"]),
            stash_bytes_per_microbatch=int(info[s]["stash"]),
            activation_bytes=int(stage_peak[s]), peak_bytes=int(fixed + stage_peak[s]),
            forward_s=forward[s] if timed else None,
            backward_s=backward[s] if timed else None))
    host_peak = host_act + sum(device_peak) - sum(device_act)  # + every static byte
    return _Config(m, schedule, mode, list(balance), stages, [int(p) for p in device_peak],
                   int(host_peak), sim.makespan if timed else None, sim.bubble_fraction)


def _activation_peaks(sim, info, mode, m_count, k_count):
    """Peak live activation bytes per stage, per device, and on one host
    holding every device, walking the simulated actions (see the module
    docstring). Per device the walk is in run order; for the host it is in
    simulated time, so devices whose peaks do not coincide do not add up."""
    stage_peak = [0.0] * k_count
    device_peak = [0.0] * len(sim.timeline)
    events = []  # (time, change in host bytes)
    for d, row in enumerate(sim.timeline):
        live, kept = {}, {}
        for action, start, end in row:
            s, m = action.stage, action.microbatch
            rec = schedules.is_recomputed(mode, m, m_count)
            extra = freed = 0.0
            if action.kind == "F":
                kept[s, m] = info[s]["input"] if rec else info[s]["stash"]
                live[s] = live.get(s, 0.0) + kept[s, m]
                events.append((start, kept[s, m]))
            elif action.kind in ("B", "I"):
                extra = info[s]["work"] + (info[s]["replay"] if rec else 0.0)
            else:  # W: the weight gradients of what I kept
                extra = info[s]["work"]
            stage_peak[s] = max(stage_peak[s], live.get(s, 0.0) + extra)
            device_peak[d] = max(device_peak[d], sum(live.values()) + extra)
            if action.kind in ("B", "W"):
                freed = kept.pop((s, m))
                live[s] -= freed
            elif action.kind == "I" and rec:  # W still needs the replayed activations
                live[s] += info[s]["replay"]
                kept[s, m] += info[s]["replay"]
                freed = -info[s]["replay"]
            if extra or freed:
                events += [(start, extra), (end, -extra - freed)]
    host, host_peak = 0.0, 0.0
    for _, change in sorted(events, key=lambda e: (e[0], e[1] > 0)):  # frees first
        host += change
        host_peak = max(host_peak, host)
    return stage_peak, device_peak, host_peak


# -- the plan --------------------------------------------------------------------


@dataclasses.dataclass
class Recommendation:
    """The configuration `plan` recommends for the devices at hand.

    Attributes:
      num_microbatches, schedule (a name for `PipelineStrategy(schedule=)`),
      recompute, balance (units per stage, for `from_model(balance=)`).
      step_time_s, bubble_fraction, device_peak_bytes: its predictions.
      speedup: the planned configuration's step time / this one's.
      fits: whether every device peak is within device_memory_bytes (None
        when no limit was given).
      reason: one line saying why it was chosen.
    """

    num_microbatches: int
    schedule: str
    recompute: str
    balance: list
    step_time_s: float
    bubble_fraction: float
    device_peak_bytes: list
    speedup: float
    fits: bool
    reason: str


def _mib(value):
    return "-" if value is None else f"{value / MIB:,.2f}"


def _ms(value):
    return "-" if value is None else f"{value * 1e3:,.2f}"


@dataclasses.dataclass
class Plan:
    """What `tfpipe.plan` predicts for one configuration (see the module
    docstring for what is measured and what is predicted).

    Attributes:
      model: the model's name. batch_size, num_microbatches,
      microbatch_rows (ceil(batch_size / M)), schedule (name), recompute,
      optimizer_slots, balance, devices (the D devices used).
      stages: a `StagePlan` per stage.
      device_peak_bytes: per device, predicted peak (static + activations).
      host_peak_bytes: predicted peak of one host holding every device (as
        logical CPUs do): the static bytes of all stages + the largest sum of
        live activations at any simulated time (at most the devices' sum).
      step_time_s: predicted forward + backward seconds of one step (None
        when not measured); bubble_fraction: the simulator's idle share.
      device_memory_bytes: the limit given (None: not checked); fits.
      recommendation: a `Recommendation` (None when not asked for).
      measured: how the measurement ran (rows, repeats, seconds it took).
    """

    model: str
    batch_size: int
    num_microbatches: int
    microbatch_rows: int
    schedule: str
    recompute: str
    optimizer_slots: float
    balance: list
    devices: list
    stages: list
    device_peak_bytes: list
    host_peak_bytes: int
    step_time_s: float
    bubble_fraction: float
    device_memory_bytes: int
    fits: bool
    recommendation: Recommendation
    measured: dict

    @property
    def params(self):
        return sum(s.params for s in self.stages)

    def to_dict(self):
        """The plan as JSON-friendly values (bytes as ints, seconds as floats)."""
        return dataclasses.asdict(self)

    def __str__(self):
        head = (f"Plan for {self.model}: batch {self.batch_size} = {self.num_microbatches} "
                f"micro-batch(es) of <= {self.microbatch_rows} rows, {len(self.stages)} "
                f"stage(s) on {len(self.devices)} device(s), schedule={self.schedule}, "
                f"recompute={self.recompute}, optimizer state {self.optimizer_slots:g} x "
                f"params")
        cols = ["stage", "device", "units", "params", "params MiB", "optim MiB",
                "grads MiB", "input MiB/mb", "stash MiB/mb", "activ. MiB", "peak MiB",
                "fwd ms/mb", "bwd ms/mb"]
        rows = []
        for s in self.stages:
            rows.append([str(s.stage), s.device.replace("/job:localhost/replica:0/task:0", ""),
                         str(s.units), f"{s.params:,}", _mib(s.param_bytes),
                         _mib(s.optimizer_bytes), _mib(s.gradient_bytes),
                         _mib(s.input_bytes_per_microbatch),
                         _mib(s.stash_bytes_per_microbatch), _mib(s.activation_bytes),
                         _mib(s.peak_bytes), _ms(s.forward_s), _ms(s.backward_s)])
        rows.append(["total", "", str(sum(s.units for s in self.stages)), f"{self.params:,}",
                     _mib(sum(s.param_bytes for s in self.stages)),
                     _mib(sum(s.optimizer_bytes for s in self.stages)),
                     _mib(sum(s.gradient_bytes for s in self.stages)), "", "",
                     _mib(sum(s.activation_bytes for s in self.stages)),
                     _mib(sum(s.peak_bytes for s in self.stages)), "", ""])
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        lines = [head, "  ".join(c.rjust(w) if i > 1 else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cols, widths)))]
        for r in rows:
            lines.append("  ".join(v.rjust(w) if i > 1 else v.ljust(w)
                                   for i, (v, w) in enumerate(zip(r, widths))))
        time_text = ("step time not measured" if self.step_time_s is None else
                     f"predicted step {_ms(self.step_time_s)} ms (forward + backward, "
                     f"simulated from measured per-unit times)")
        lines.append(f"{time_text}; bubble {self.bubble_fraction:.1%} (simulator)")
        limit = ("no device memory limit given (device_memory_bytes)"
                 if self.device_memory_bytes is None else
                 f"limit {_mib(self.device_memory_bytes)} MiB per device: "
                 f"{'fits' if self.fits else 'does NOT fit'}")
        lines.append(f"peak memory per device (MiB): "
                     f"{', '.join(_mib(p) for p in self.device_peak_bytes)}; one host holding "
                     f"them all: {_mib(self.host_peak_bytes)}; {limit}")
        r = self.recommendation
        if r is not None:
            lines.append(
                f"recommended: M={r.num_microbatches}, schedule={r.schedule}, "
                f"recompute={r.recompute}, balance={r.balance}: "
                + (f"step {_ms(r.step_time_s)} ms ({r.speedup:.2f}x), " if r.step_time_s
                   else "")
                + f"bubble {r.bubble_fraction:.1%}, peak "
                f"{_mib(max(r.device_peak_bytes))} MiB per device. {r.reason}")
        return "\n".join(lines)


# -- entry point -----------------------------------------------------------------


def _positive_int(name, value, fix):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}. {fix}")
    return int(value)


def _chain_graph(pipelined):
    """A hand-made pipeline's stages as one chain: (graph, balance).

    Sequential stages are read layer by layer (the planner may move layers
    between them); any other stage is one unit.
    """
    build = pipelined.get_build_config()
    if build is None:
        raise ValueError(
            f"model={pipelined.name!r} is a PipelinedModel that is not built yet, so its "
            f"stages' shapes are unknown. Build it first (pass input_shape=(None, ...) or "
            f"call model.build(input_shape)), or plan the plain Keras model.")
    shape = build["input_shape"]
    if not (isinstance(shape, (list, tuple))
            and all(d is None or isinstance(d, int) for d in shape)):
        raise ValueError(
            f"model={pipelined.name!r}: hand-made stages with a nested input {shape!r} "
            f"cannot be planned; plan the plain Keras model (from_model) instead.")
    layers, balance = [], []
    for stage in pipelined.stages:
        parts = ([l for l in stage.layers if not isinstance(l, keras.layers.InputLayer)]
                 if isinstance(stage, keras.Sequential) else [stage])
        layers += parts
        balance.append(len(parts))
    chain = keras.Sequential(
        [keras.Input(tuple(shape[1:]), dtype=build.get("input_dtype", "float32"))] + layers,
        name=pipelined.name)
    return graph_lib.model_graph(chain), balance


def _resolve_model(model):
    """(graph, balance or None, the PipelinedModel or None)."""
    from tfpipe import model as model_lib  # pylint: disable=import-outside-toplevel
    if isinstance(model, model_lib.PipelinedModel):
        if model.source_model is not None:
            return graph_lib.model_graph(model.source_model), model.balance, model
        graph, balance = _chain_graph(model)
        return graph, balance, model
    if isinstance(model, keras.Model):
        try:
            return graph_lib.model_graph(model), None, None
        except ValueError as err:
            raise ValueError(f"model={model.name!r} cannot be planned: {err}") from None
    raise ValueError(
        f"model must be a keras.Sequential, a functional keras.Model or a "
        f"tfpipe.PipelinedModel, got {type(model).__name__}.")


def _candidates_m(batch_size, requested, most):
    ms = {d for d in range(1, min(batch_size, most) + 1) if batch_size % d == 0}
    return sorted(ms | {requested})


def plan(model, batch_size, num_microbatches, num_stages=None, devices=None, schedule=None,
         recompute=None, balance=None, optimizer="adam", device_memory_bytes=None,
         repeats=2, measure_time=True, recommend=True, max_microbatches=64):
    """Predicts memory and time of a pipeline configuration before it runs.

    Args:
      model: a `keras.Sequential` or functional `keras.Model` (what
        `PipelinedModel.from_model` takes) or a built `PipelinedModel`
        (planned as it is cut, with its devices, schedule and recompute
        mode unless given here).
      batch_size: rows per training step.
      num_microbatches: M (at most batch_size).
      num_stages: K; default the PipelinedModel's, else v x the devices
        (at most the model's units).
      devices: device names; default the PipelinedModel's, else every GPU,
        else every logical CPU. Only their count matters (D = K / v).
      schedule: a name or `tfpipe.schedules.Schedule`; default the
        PipelinedModel's, else "gpipe".
      recompute: "always", "except_last" or "never"; default the
        PipelinedModel's, else "except_last".
      balance: units per stage (a list), or "params" (default for a plain
        model), "time" or "memory" as in `from_model`.
      optimizer: "adam" (default), "sgd", "sgd+momentum", ..., a Keras
        optimizer, or a number of state slots per parameter.
      device_memory_bytes: each device's memory; when given, the plan says
        whether it fits and the recommendation only takes configurations
        that fit.
      repeats: timed runs per unit function (the fastest counts).
      measure_time: False skips the timing (no step time; the bubble then
        assumes equal stages); bytes are still measured.
      recommend: False skips the search for a better configuration.
      max_microbatches: the largest M the recommendation tries.

    Returns:
      A `Plan`; `print(plan)` shows it as a table, `plan.to_dict()` as JSON.

    Raises:
      ValueError: a bad argument (the message names it, the value and the
        fix), or a model the planner cannot read.
    """
    batch_size = _positive_int("batch_size", batch_size, "Pass the rows of one training step.")
    m = _positive_int("num_microbatches", num_microbatches,
                      "Pass M, the micro-batches per step (e.g. 4).")
    if m > batch_size:
        raise ValueError(
            f"num_microbatches={m} is more than batch_size={batch_size}: {m - batch_size} "
            f"micro-batch(es) would be empty. Use num_microbatches <= {batch_size}.")
    if device_memory_bytes is not None and (
            isinstance(device_memory_bytes, bool)
            or not isinstance(device_memory_bytes, (int, float)) or device_memory_bytes <= 0):
        raise ValueError(
            f"device_memory_bytes must be a positive number of bytes (e.g. 16 * 2**30), "
            f"got {device_memory_bytes!r}; or None not to check memory.")
    repeats = _positive_int("repeats", repeats, "Use 1 or more timed runs per unit.")
    max_microbatches = _positive_int("max_microbatches", max_microbatches,
                                     "Use the largest M to try (e.g. 64).")
    slots = optimizer_slots(optimizer)
    graph, model_balance, pipelined = _resolve_model(model)
    n_units = len(graph.units)
    if schedule is None:
        schedule = pipelined.schedule if pipelined is not None else "gpipe"
    schedule = schedules.get(schedule)
    if recompute is None:
        recompute = pipelined.recompute if pipelined is not None else "except_last"
    recompute = schedules.validate_recompute(recompute)
    if devices is None:
        devices = (list(pipelined.pipeline_devices) if pipelined is not None
                   else placement.default_devices())
    if isinstance(devices, str) or not devices:
        raise ValueError(f"devices must be a non-empty list of device names, got "
                         f"{devices!r}.")
    devices = [placement.canonical_device(d) for d in devices]
    v = schedule.virtual_stages
    if num_stages is None:
        if isinstance(balance, (list, tuple)):
            num_stages = len(balance)
        elif pipelined is not None:
            num_stages = len(pipelined.stages)
        else:
            num_stages = min(v * len(devices), n_units)
    k = _positive_int("num_stages", num_stages, f"Use 1 to {n_units} stages.")
    if k > n_units:
        raise ValueError(
            f"num_stages={k} but {graph.model.name!r} has only {n_units} "
            f"{graph.unit_name}; use at most {n_units} stages.")
    d_count = schedules.devices_needed(schedule, k)
    if d_count > len(devices):
        raise ValueError(
            f"num_stages={k} with schedule={schedules.schedule_name(schedule)!r} needs {d_count} "
            f"devices; devices has {len(devices)} ({devices}). Pass more devices, or "
            f"num_stages <= {v * len(devices)}.")
    devices = devices[:d_count]
    schedule.check(m, d_count)  # M on D: the schedule's own rule
    if balance is None and model_balance is not None and len(model_balance) == k:
        balance = model_balance
    balance, method = partition.choose_balance(graph, balance, k)
    if len(balance) != k:
        raise ValueError(f"balance={balance} has {len(balance)} stages; num_stages={k}.")

    started = time.perf_counter()
    rows = -(-batch_size // m)
    # Two micro-batch sizes (this one and a quarter of it): time = a + b * rows.
    sizes = [rows] + ([rows // 4] if measure_time and rows // 4 not in (0, rows) else [])
    units, tensor_bytes = costs.measure(
        graph, [costs.sample_batch(graph, batch_size=r) for r in sizes], repeats,
        times=measure_time)
    measured = {"rows": rows, "repeats": repeats, "timed": bool(measure_time),
                "seconds": time.perf_counter() - started, "balance_method": method}

    def evaluate(m_, schedule_, mode_, balance_):
        d_ = len(balance_) // schedule_.virtual_stages
        return _evaluate(graph, units, tensor_bytes, rows, batch_size, m_, schedule_, mode_,
                         balance_, devices[:d_] if d_ <= len(devices) else devices,
                         slots, measure_time)

    chosen = evaluate(m, schedule, recompute, balance)
    fits = chosen.fits(device_memory_bytes)
    advice = None
    if recommend:
        advice = _recommend(chosen, evaluate, units, batch_size, d_count, n_units,
                            max_microbatches, device_memory_bytes, measure_time)
    measured["seconds"] = time.perf_counter() - started
    return Plan(
        model=graph.model.name, batch_size=batch_size, num_microbatches=m,
        microbatch_rows=rows, schedule=schedules.schedule_name(schedule), recompute=recompute,
        optimizer_slots=slots, balance=list(balance), devices=list(devices),
        stages=chosen.stages, device_peak_bytes=chosen.device_peak_bytes,
        host_peak_bytes=chosen.host_peak_bytes, step_time_s=chosen.step_time_s,
        bubble_fraction=chosen.bubble_fraction,
        device_memory_bytes=(None if device_memory_bytes is None else int(device_memory_bytes)),
        fits=fits, recommendation=advice, measured=measured)


def _recommend(chosen, evaluate, units, batch_size, d_count, n_units, max_microbatches,
               limit, timed):
    """The fastest configuration that fits (see the module docstring)."""
    options = [chosen]
    for m in _candidates_m(batch_size, chosen.num_microbatches, max_microbatches):
        rows = -(-batch_size // m)
        unit_costs = ([u.seconds(rows) for u in units] if timed
                      else [u.params + 1 for u in units])
        for name in RECOMMEND_SCHEDULES:
            schedule = schedules.get(name)
            k = schedule.virtual_stages * d_count
            if k > n_units:
                continue
            try:
                schedule.check(m, d_count)
            except ValueError:
                continue
            balances = [partition.split_by_costs(unit_costs, k)]
            if k == len(chosen.balance) and chosen.balance not in balances:
                balances.append(chosen.balance)
            for balance in balances:
                for mode in schedules.RECOMPUTE_MODES:
                    options.append(evaluate(m, schedule, mode, balance))
    fitting = [o for o in options if o.fits(limit) is not False]
    if not fitting:
        best = min(options, key=lambda o: max(o.device_peak_bytes))
        reason = (f"Nothing tried fits {_mib(limit)} MiB per device; this is the smallest "
                  f"peak found. Use more devices or a smaller batch.")
    else:
        def key(o):
            # Fastest first (bubble when not timed), then the smaller peak.
            speed = o.step_time_s if timed else o.bubble_fraction
            return (round(speed, 12), max(o.device_peak_bytes))
        best = min(fitting, key=key)
        what = "the shortest predicted step" if timed else "the smallest bubble"
        reason = (f"Of {len(options)} configurations tried, {len(fitting)} fit"
                  + ("" if limit is not None else " (no memory limit given)")
                  + f"; this one has {what}.")
    speedup = (chosen.step_time_s / best.step_time_s
               if timed and best.step_time_s else None)
    return Recommendation(
        num_microbatches=best.num_microbatches, schedule=schedules.schedule_name(best.schedule),
        recompute=best.recompute, balance=list(best.balance), step_time_s=best.step_time_s,
        bubble_fraction=best.bubble_fraction, device_peak_bytes=best.device_peak_bytes,
        speedup=speedup, fits=best.fits(limit), reason=reason)
