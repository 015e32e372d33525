"""What one pipeline configuration costs, predicted from measured unit costs.

`evaluate` simulates the schedule (`tfpipe.schedules.simulate`) with measured
per-stage costs at the largest micro-batch's rows, walking each device's
actions: a forward adds its stash (only the input when recomputed), a
backward its replay and workspace, then frees the micro-batch. Peaks add the
parameters, optimizer state and gradients; the step time is the makespan
(communication and the optimizer update not counted).
"""

import dataclasses

import keras

from tfpipe import actions
from tfpipe import cutting
from tfpipe import graph as graph_lib
from tfpipe import schedules

# Optimizer state per trainable parameter, in units of the parameter's bytes.
OPTIMIZER_SLOTS = {
    "sgd": 0, "adam": 2, "adamw": 2, "adamax": 2, "nadam": 2, "adadelta": 2,
    "adagrad": 1, "rmsprop": 1, "lion": 1, "ftrl": 2, "lamb": 2, "adafactor": 1,
}


def optimizer_slots(optimizer):
    """Optimizer state per trainable parameter (0 for SGD, 2 for Adam, ...) of
    a name ("adam", "sgd+momentum", ...), a Keras optimizer (its momentum,
    amsgrad and centered settings read) or a number of slots."""
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


@dataclasses.dataclass
class StagePlan:
    """One stage of a plan: bytes per stage, seconds per micro-batch. `params`
    counts each variable once, on its first stage; the input is kept when
    recomputing, the stash when not; `activation_bytes` is the predicted peak
    of live activations; `backward_s` excludes a replay's forward."""
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
class Config:
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


def evaluate(graph, units, tensor_bytes, rows_measured, batch_size, m, schedule, mode,
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
        # A split backward: stage 0 has no input gradient, so its I is empty
        # and its W all of B (measured: I0 0 ms); elsewhere I and W halve B.
        weight = [backward[0]] + [b / 2 for b in backward[1:]]
        sim = schedules.simulate(schedule, m, d_count, forward_cost=forward,
                                 backward_cost=backward, weight_cost=weight, recompute=mode)
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
    return Config(m, schedule, mode, list(balance), stages, [int(p) for p in device_peak],
                   int(host_peak), sim.makespan if timed else None, sim.bubble_fraction)


def _activation_peaks(sim, info, mode, m_count, k_count):
    """Peak live activation bytes per stage, per device (in run order) and on
    one host holding every device (in simulated time, so devices' peaks that
    do not coincide do not add up)."""
    stage_peak = [0.0] * k_count
    device_peak = [0.0] * len(sim.timeline)
    events = []  # (time, change in host bytes)
    for d, row in enumerate(sim.timeline):
        live, kept = {}, {}
        for action, start, end in row:
            s, m = action.stage, action.microbatch
            rec = actions.is_recomputed(mode, m, m_count)
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
