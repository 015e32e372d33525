"""What one pipeline configuration costs, predicted from measured unit costs.

Given the per-unit costs `tfpipe.costs.measure` found, a balance, M, a
schedule and a recompute mode, `evaluate` predicts:

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
"""

import dataclasses

from tfpipe import cutting
from tfpipe import graph as graph_lib
from tfpipe import schedules


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
    return Config(m, schedule, mode, list(balance), stages, [int(p) for p in device_peak],
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
