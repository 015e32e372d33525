"""Validating and simulating a schedule's table, and putting it on a clock.

`simulate` runs a `tfpipe.actions.Schedule` on an idealised machine and
validates it on the way; `validate` returns the order the engine traces a
step in; `clock_ticks` lays the table on ticks for the loop form
(`tfpipe.loop`). `tfpipe.schedules` wraps them to take names too. Pure Python.
"""

import dataclasses

from tfpipe.actions import (BACKWARD_FORMS, KINDS, RULES, Action, is_recomputed, validate_recompute)


def _dependencies(action, num_stages, actions=()):
    return KINDS[action.kind].dependencies(action, num_stages, actions)


def _table(schedule, num_microbatches, num_devices):
    """Checks the table's contents (not its order); returns (table, K)."""
    table = [[Action.parse(a) for a in row] for row in
             schedule.actions(num_microbatches, num_devices)]
    k_count = schedule.num_stages(num_devices)
    if len(table) != num_devices:
        raise ValueError(f"{schedule!r} gave {len(table)} device rows for {num_devices} devices.")
    seen = {}
    for d, row in enumerate(table):
        for a in row:
            if a.kind not in KINDS:
                raise ValueError(
                    f"Action {a} has kind {a.kind!r}; use one of "
                    + ", ".join(f"'{k}' ({kind.description})" for k, kind in KINDS.items())
                    + ".")
            if not (0 <= a.stage < k_count and 0 <= a.microbatch < num_microbatches):
                raise ValueError(
                    f"Action {a} on device {d} is out of range: stages are 0..{k_count - 1} "
                    f"and micro-batches 0..{num_microbatches - 1}.")
            home = schedule.stage_device(a.stage, num_devices)
            if d != home:
                raise ValueError(
                    f"Action {a} is on device {d}, but stage {a.stage} lives on device {home}.")
            if a in seen:
                raise ValueError(f"Action {a} appears twice (devices {seen[a]} and {d}).")
            seen[a] = d
    missing = []
    for s in range(k_count):
        for m in range(num_microbatches):
            present = [k for k in KINDS if Action(k, s, m) in seen]
            backward = [k for k in present if k != "F"]
            forms = [f for f in BACKWARD_FORMS if set(backward) <= set(f)]
            if not forms:
                names = " and ".join(str(Action(k, s, m)) for k in backward)
                raise ValueError(
                    f"{schedule!r} with M={num_microbatches}, D={num_devices} has both "
                    f"{names}: the backward of stage {s} on micro-batch {m} is either one B "
                    f"or one I (input gradient) and one W (weight gradients), not both.")
            missing += [Action(k, s, m) for k in ("F",) + forms[0] if k not in present]
    if missing:
        names = ", ".join(str(a) for a in missing[:6])
        raise ValueError(
            f"{schedule!r} with M={num_microbatches}, D={num_devices} is missing {len(missing)} "
            f"action(s): {names}{' ...' if len(missing) > 6 else ''}. Every stage needs one F and "
            f"one B per micro-batch (or, split, one I and one W instead of the B).")
    return table, k_count


@dataclasses.dataclass
class Simulation:
    """What `simulate` found.

    Attributes:
      timeline: per device, a list of (action, start, end) in run order.
      makespan: time from the first start to the last end (cost units).
      bubble_fraction: idle share of D * makespan device time.
      peak_activations: per device, the most stage activations alive at once
        (forwards whose B or W has not finished; each 1/v of the device's
        share of the model).
      order: every (device, action) in start order, ties by device.
    """

    timeline: list
    makespan: float
    bubble_fraction: float
    peak_activations: list
    order: list


def _cost_function(forward_cost, backward_cost, weight_cost, virtual_stages,
                   recompute="never", num_microbatches=None):
    """cost(action) in `simulate`'s units; checks weight_cost <= backward_cost.
    A replayed micro-batch's B or I also pays the stage's forward."""

    def per_stage(value, stage):
        if isinstance(value, (int, float)):
            return float(value) / virtual_stages
        return float(value[stage])

    def by_name(name, stage):
        backward = per_stage(backward_cost, stage)
        weight = (backward / 2 if weight_cost is None else per_stage(weight_cost, stage))
        if not 0 <= weight <= backward:
            raise ValueError(
                f"weight_cost must be between 0 and backward_cost (W is part of the backward; "
                f"I costs the rest), got weight_cost={weight_cost!r} and "
                f"backward_cost={backward_cost!r} (stage {stage}: {weight} of {backward}).")
        return {"forward": lambda: per_stage(forward_cost, stage), "backward": lambda: backward,
                "input": lambda: backward - weight, "weight": lambda: weight}[name]()

    def cost(action):
        own = by_name(KINDS[action.kind].cost, action.stage)
        if (KINDS[action.kind].input_gradient
                and is_recomputed(recompute, action.microbatch, num_microbatches)):
            own += by_name("forward", action.stage)
        return own

    validate_recompute(recompute)  # a bad mode fails before any action is priced
    return cost


def _run(table, k_count, cost, describe):
    """Event simulation of a checked table; raises naming a deadlock."""
    d_count = len(table)
    actions = {a for row in table for a in row}
    finish, pos = {}, [0] * d_count
    free = [0.0] * d_count
    live, peak = [0] * d_count, [0] * d_count
    timeline = [[] for _ in range(d_count)]
    order = []
    remaining = len(actions)
    while remaining:
        best = None
        for d in range(d_count):
            if pos[d] == len(table[d]):
                continue
            action = table[d][pos[d]]
            deps = _dependencies(action, k_count, actions)
            if all(dep in finish for dep in deps):
                start = max([free[d]] + [finish[dep] for dep in deps])
                if best is None or start < best[0]:
                    best = (start, d, action)
        if best is None:
            blocked = []
            for d in range(d_count):
                if pos[d] < len(table[d]):
                    action = table[d][pos[d]]
                    need = [str(dep) for dep in _dependencies(action, k_count, actions)
                            if dep not in finish]
                    blocked.append(f"device {d} waits at {action} for {', '.join(need)}")
            raise ValueError(
                f"{describe} runs an action before its inputs exist, so it would deadlock: "
                f"{'; '.join(blocked)}. {RULES}")
        start, d, action = best
        end = start + cost(action)
        finish[action] = end
        free[d] = end
        pos[d] += 1
        remaining -= 1
        timeline[d].append((action, start, end))
        order.append((d, action))
        # A device runs in order, so its earlier actions have ended: the stage
        # activations alive now are the sum of its actions' memory effects.
        live[d] += KINDS[action.kind].memory
        peak[d] = max(peak[d], live[d])
    makespan = max((row[-1][2] for row in timeline if row), default=0.0)
    busy = sum(e - s for row in timeline for _, s, e in row)
    bubble = 1.0 - busy / (d_count * makespan) if makespan else 0.0
    return Simulation(timeline, makespan, round(bubble, 12), peak, order)


def simulate(schedule, num_microbatches, num_devices, forward_cost=1.0, backward_cost=2.0,
             weight_cost=None, recompute="never"):
    """Runs the schedule on an idealised machine; validates it on the way.

    Each device runs its actions in order; an action starts when its device is
    free and its dependencies have finished (communication is free).

    Args:
      forward_cost, backward_cost: a float (one device's share of the model
        per micro-batch, divided among its v stages) or a list of K
        per-stage costs. A split backward costs B's in two parts.
      weight_cost: W's part of `backward_cost` (float or K list; I costs the
        rest); None: half.
      recompute: a `RECOMPUTE_MODES` policy: a replayed micro-batch
        (`is_recomputed`) pays the stage's forward again in its B (or I).
    Returns a `Simulation`. Raises ValueError naming the actions if one is
    out of range, twice, missing or on the wrong device, a B is with an I or
    W, or one runs before its inputs exist (a deadlock).
    """
    table, k_count = _table(schedule, num_microbatches, num_devices)
    cost = _cost_function(forward_cost, backward_cost, weight_cost, schedule.virtual_stages,
                          recompute, num_microbatches)
    return _run(table, k_count, cost, f"{schedule!r} with M={num_microbatches}, D={num_devices}")


def validate(schedule, num_microbatches, num_devices):
    """Checks `schedule` for (M, D); returns the (device, action) run order.
    Raises ValueError naming the problem (see `simulate`)."""
    return simulate(schedule, num_microbatches, num_devices).order


def clock_ticks(schedule, num_microbatches, num_devices, forward_only=False, costs=None):
    """The schedule on a clock: a list of ticks, each one action per device.

    Args:
      forward_only: keep only the F actions (evaluation and prediction).
      costs: None: lock-step, a device runs its next action at the first
        tick after its inputs exist. Or (forward_cost, backward_cost,
        weight_cost) as in `simulate`: a tick at every distinct simulated
        start time, each action at the tick where it starts.
    Returns:
      T ticks, each a list of D entries: the `Action` device d runs then, or
      None. Dependencies run at earlier ticks; table order is kept.
    """
    table, k_count = _table(schedule, num_microbatches, num_devices)
    if forward_only:
        table = [[a for a in row if a.kind == "F"] for row in table]
    if costs is not None:
        forward, backward, *weight = costs
        cost = _cost_function(forward, backward, weight[0] if weight else None,
                              schedule.virtual_stages)
        sim = _run(table, k_count, cost, f"{schedule!r} with M={num_microbatches}, D={num_devices}")
        return _event_ticks(sim, k_count, num_devices)
    actions = {a for row in table for a in row}
    done, pos, ticks = set(), [0] * num_devices, []
    while any(p < len(row) for p, row in zip(pos, table)):
        tick = [None] * num_devices
        for d, row in enumerate(table):
            if pos[d] < len(row):
                action = row[pos[d]]
                if all(dep in done for dep in _dependencies(action, k_count, actions)):
                    tick[d] = action
        if not any(tick):
            validate(schedule, num_microbatches, num_devices)  # raises, naming the actions
            raise ValueError(f"{schedule!r} cannot be put on a clock.")
        for d, action in enumerate(tick):
            if action is not None:
                done.add(action)
                pos[d] += 1
        ticks.append(tick)
    return ticks


def _event_ticks(sim, k_count, num_devices):
    """Ticks at the simulated start times (see `clock_ticks(costs=...)`)."""
    starts = sorted({start for row in sim.timeline for _, start, _ in row})
    rank = {start: i for i, start in enumerate(starts)}
    begins = {a: start for row in sim.timeline for a, start, _ in row}
    actions = set(begins)
    at, last = {}, [-1] * num_devices
    for d, action in sim.order:
        # With positive costs the start rank already comes after the device's
        # previous action and every dependency; zero costs need the max.
        tick = max([rank[begins[action]], last[d] + 1]
                   + [at[dep] + 1 for dep in _dependencies(action, k_count, actions)])
        at[action], last[d] = tick, tick
    ticks = [[None] * num_devices for _ in range(1 + max(at.values(), default=-1))]
    for d, action in sim.order:
        ticks[at[action]][d] = action
    return ticks


def tick_makespan(ticks, forward_cost=1.0, backward_cost=2.0, weight_cost=None,
                  virtual_stages=1):
    """Time to run `ticks` with a barrier after each: the sum over ticks of
    the longest action in the tick (costs as in `simulate`; floats are divided
    by `virtual_stages`, the schedule's stages per device).

    >>> tick_makespan(clock_ticks(OneFOneB(), 8, 4), 1.0, 3.0)
    58.0
    >>> simulate(OneFOneB(), 8, 4, 1.0, 3.0).makespan   # event-driven
    44.0
    """
    cost = _cost_function(forward_cost, backward_cost, weight_cost, virtual_stages)
    return sum(max((cost(a) for a in tick if a is not None), default=0.0) for tick in ticks)
