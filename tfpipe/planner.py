"""Before a run: what a pipeline configuration costs, and which one to use.

`tfpipe.plan` measures each unit once (`tfpipe.costs.measure`), predicts one
configuration (`tfpipe.prediction`) and recommends the fastest predicted
configuration that fits `device_memory_bytes`, trying every M dividing the
batch, `RECOMMEND_SCHEDULES`, every recompute mode and two balances.
"""

import dataclasses
import time

import keras
import numpy as np

from tfpipe import actions
from tfpipe import config as config_lib
from tfpipe import costs
from tfpipe import devices as devices_lib
from tfpipe import graph as graph_lib
from tfpipe import partition
from tfpipe import placement
from tfpipe import prediction
from tfpipe import recompute_choice
from tfpipe import schedules

RECOMMEND_SCHEDULES = ("gpipe", "1f1b", "zbh1", "interleaved", "zbv")
MIB = 2.0**20


@dataclasses.dataclass
class Recommendation:
    """The configuration `plan` recommends: its settings (`schedule` a name,
    `balance` units per stage), predictions, `speedup` (the planned step's
    predicted time / this one's: a ratio of two predictions made the same
    way), `fits` (None: no limit given), a one-line `reason`, and `tried`:
    every configuration compared, best first, each a dict of its settings,
    `step_time_s` (None: not timed), `bubble_fraction`, `peak_bytes` (the
    largest device's) and `fits`."""
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
    tried: list = dataclasses.field(default_factory=list)


def _mib(value):
    return "-" if value is None else f"{value / MIB:,.2f}"


def _ms(value):
    return "-" if value is None else f"{value * 1e3:,.2f}"


@dataclasses.dataclass
class Plan:
    """What `tfpipe.plan` predicts for one configuration: `stages` (a
    `tfpipe.prediction.StagePlan` each), device and host peaks in bytes (one
    host holding every device, as logical CPUs do), and `step_time_s`, the
    schedule simulated with per-layer seconds each measured alone (None: not
    timed). That time is relative: it leaves out per-call overhead and devices
    sharing a host, so it compares configurations, not a plan with a run (the
    README's main job: about 2.5x its measured mean step, on two machines)."""
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
    recompute_reason: str = ""  # why tfpipe chose `recompute`, where it was not given

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
                f"recompute={self.recompute}"
                f"{f' (tfpipe chose it: {self.recompute_reason})' if self.recompute_reason else ''}"
                f", optimizer state {self.optimizer_slots:g} x "
                f"params")
        cols = ["stage", "device", "units", "params", "params MiB", "optim MiB",
                "grads MiB", "input MiB/mb", "stash MiB/mb", "activ. MiB", "peak MiB",
                "fwd ms/mb", "bwd ms/mb"]
        rows = [[str(s.stage), s.device.replace("/job:localhost/replica:0/task:0", ""),
                 str(s.units), f"{s.params:,}", _mib(s.param_bytes), _mib(s.optimizer_bytes),
                 _mib(s.gradient_bytes), _mib(s.input_bytes_per_microbatch),
                 _mib(s.stash_bytes_per_microbatch), _mib(s.activation_bytes),
                 _mib(s.peak_bytes), _ms(s.forward_s), _ms(s.backward_s)]
                for s in self.stages]
        rows.append(["total", "", str(sum(s.units for s in self.stages)), f"{self.params:,}",
                     _mib(sum(s.param_bytes for s in self.stages)),
                     _mib(sum(s.optimizer_bytes for s in self.stages)),
                     _mib(sum(s.gradient_bytes for s in self.stages)), "", "",
                     _mib(sum(s.activation_bytes for s in self.stages)),
                     _mib(sum(s.peak_bytes for s in self.stages)), "", ""])
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        lines = [head] + ["  ".join(v.rjust(w) if i > 1 else v.ljust(w)
                                    for i, (v, w) in enumerate(zip(r, widths)))
                          for r in [cols] + rows]
        if self.step_time_s is None:
            lines.append(f"step time not measured; bubble {self.bubble_fraction:.1%} (simulator)")
        else:
            lines.append(
                f"step time: relative only (this plan = 1.00 = {_ms(self.step_time_s)} ms of "
                f"per-layer time, each layer timed alone, stages simulated in parallel); "
                f"bubble {self.bubble_fraction:.1%} (simulator). A run's measured step "
                f"differs (per-call overhead, devices sharing a host): compare plans with "
                f"each other, not with a run.")
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
                + (f"predicted step {1 / r.speedup:.2f} of this plan's ({r.speedup:.2f}x, "
                   f"predicted the same way), " if r.speedup else "")
                + f"bubble {r.bubble_fraction:.1%}, peak "
                f"{_mib(max(r.device_peak_bytes))} MiB per device. {r.reason}")
        return "\n".join(lines)


def _positive_int(name, value, fix):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}. {fix}")
    return int(value)


def _chain_graph(pipelined):
    """A hand-made pipeline as one chain (graph, balance); Sequential stages by layer."""
    build = pipelined.get_build_config()
    if build is None:
        raise ValueError(
            f"model={pipelined.name!r} is a PipelinedModel that is not built yet, so its "
            f"stages' shapes are unknown. Build it first (pass input_shape=(None, ...) or "
            f"call model.build(input_shape)), or plan the plain Keras model.")
    chained = graph_lib.stage_chain(pipelined.stages, build["input_shape"],
                                    build.get("input_dtype", "float32"), pipelined.name)
    if chained is None:
        raise ValueError(
            f"model={pipelined.name!r}: hand-made stages with a nested input "
            f"{build['input_shape']!r} cannot be planned; plan the plain Keras model "
            f"(from_model) instead.")
    return chained


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

    `model`: what `PipelinedModel.from_model` takes, or a built
    `PipelinedModel`, whose K, devices, schedule and recompute mode are the
    defaults (else v x every GPU or logical CPU, and the schedule a model
    given none would run at M: `tfpipe.config.default_schedule`); a recompute mode
    nobody gave is chosen as the model chooses it, from the predicted peak of
    "never" and the devices' memory (`tfpipe.recompute_choice`).
    `optimizer`: a name, a Keras optimizer or slots per parameter. `repeats`:
    timed runs per unit (the fastest counts); `measure_time=False` assumes
    equal stages. Returns a `Plan` (`print(plan)`: a table; `.to_dict()`).
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
    slots = prediction.optimizer_slots(optimizer)
    graph, model_balance, pipelined = _resolve_model(model)
    refusal = pipelined.pipeline_host.timing_refusal if pipelined is not None else None
    if refusal is not None and devices is None:
        raise ValueError(f"tfpipe.plan({pipelined.name!r}): {refusal}")
    n_units = len(graph.units)
    if schedule is None:
        schedule = (pipelined.schedule if pipelined is not None
                    else config_lib.default_schedule(m))
    schedule = schedules.get(schedule)
    reason = ""
    config = pipelined.pipeline_config if pipelined is not None else None
    if recompute is None and config is not None and not config.recompute_pending:
        recompute, reason = config.recompute, config.recompute_reason  # given, or chosen
    if recompute is not None:
        recompute = actions.validate_recompute(recompute)
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
        return prediction.evaluate(graph, units, tensor_bytes, rows, batch_size, m_, schedule_,
                                   mode_, balance_, devices[:d_], slots, measure_time)

    if recompute is None:  # as the model would choose it (tfpipe.recompute_choice)
        stage_devices = ([p.devices for p in pipelined.replica_pipelines] if pipelined else
                         [[devices_lib.as_stage_device(d) for d in devices]])
        strategy = pipelined.distribute_strategy if pipelined else None
        recompute, reason = recompute_choice.decide(
            evaluate(m, schedule, "never", balance).device_peak_bytes, stage_devices,
            device_memory_bytes or getattr(strategy, "device_memory_bytes", None))
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
        fits=fits, recommendation=advice, measured=measured, recompute_reason=reason)


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
                for mode in actions.RECOMPUTE_MODES:
                    options.append(evaluate(m, schedule, mode, balance))

    def key(o):
        # Fastest first (bubble when not timed), then the smaller peak.
        speed = o.step_time_s if timed else o.bubble_fraction
        return (o.fits(limit) is False, round(speed, 12), max(o.device_peak_bytes))
    options.sort(key=key)
    fitting = [o for o in options if o.fits(limit) is not False]
    if not fitting:
        best = min(options, key=lambda o: max(o.device_peak_bytes))
        reason = (f"Nothing tried fits {_mib(limit)} MiB per device; this is the smallest "
                  f"peak found. Use more devices or a smaller batch.")
    else:
        best = fitting[0]
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
        speedup=speedup, fits=best.fits(limit), reason=reason,
        tried=[{"num_microbatches": o.num_microbatches,
                "schedule": schedules.schedule_name(o.schedule), "recompute": o.recompute,
                "balance": list(o.balance), "step_time_s": o.step_time_s,
                "bubble_fraction": o.bubble_fraction, "peak_bytes": max(o.device_peak_bytes),
                "fits": o.fits(limit)} for o in options])
