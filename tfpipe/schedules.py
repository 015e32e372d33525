"""Pipeline schedules as data: for each device, the ordered list of its actions.

An action is (kind, stage, micro-batch): `F` runs a stage's forward on one
micro-batch, `B` its backward. A schedule maps (M micro-batches, D devices) to
one list of actions per device; nothing here needs TensorFlow, so a schedule
can be printed, validated and simulated before it runs:

>>> schedule = OneFOneB()
>>> print(schedule.format(num_microbatches=3, num_devices=2))
device 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2
device 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2
>>> simulate(schedule, 3, 2).bubble_fraction   # (K - 1) / (M + K - 1)
0.25

Dependencies between actions (what `validate` checks and the engine obeys):
  F(s, m) needs F(s - 1, m);  B(s, m) needs F(s, m) and B(s + 1, m).
The last stage's loss is computed right after its forward, on its device.

Stage s lives on device `schedule.stage_device(s, D)`: s for GPipe and 1F1B
(K = D stages), s mod D for `Interleaved` (K = v * D stages, v per device).
New schedules are a new table (subclass `Schedule` and implement `actions`,
or pass a literal table to `Table`), not a new engine.
"""

import dataclasses
import re
from typing import NamedTuple

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")


class Action(NamedTuple):
    """One unit of work: `kind` "F" or "B" of `stage` on `microbatch`."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self):
        return f"{self.kind}{self.stage}.{self.microbatch}"

    @classmethod
    def parse(cls, text):
        """`Action.parse("B2.5") == Action("B", 2, 5)`; tuples pass through."""
        if isinstance(text, Action):
            return text
        if isinstance(text, tuple) and len(text) == 3:
            return cls(str(text[0]).upper(), int(text[1]), int(text[2]))
        match = re.fullmatch(r"\s*([FfBb])\s*(\d+)\s*[.,:]\s*(\d+)\s*", str(text))
        if not match:
            raise ValueError(
                f"Cannot read action {text!r}; write actions as 'F<stage>.<microbatch>' "
                f"or 'B<stage>.<microbatch>' (e.g. 'F0.3'), or as (kind, stage, microbatch)."
            )
        return cls(match.group(1).upper(), int(match.group(2)), int(match.group(3)))


def _check_counts(num_microbatches, num_devices):
    for name, value in (("num_microbatches", num_microbatches), ("num_devices", num_devices)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")


class Schedule:
    """Base class: a schedule is `actions(M, D)`, one action list per device.

    Subclasses set `name` and implement `actions`; `virtual_stages` (v) is the
    number of stages each device holds (K = v * D).
    """

    name = "schedule"
    virtual_stages = 1

    def num_stages(self, num_devices):
        """K: how many model stages this schedule runs on `num_devices`."""
        return self.virtual_stages * num_devices

    def stage_device(self, stage, num_devices):
        """Index of the device (0 <= d < D) that holds `stage`."""
        return stage % num_devices

    def check(self, num_microbatches, num_devices):
        """Raises ValueError if the schedule cannot run this (M, D)."""
        _check_counts(num_microbatches, num_devices)

    def actions(self, num_microbatches, num_devices):
        """A list of D lists of `Action`s, each in that device's run order."""
        raise NotImplementedError

    def format(self, num_microbatches, num_devices):
        """The table as text, one line per device."""
        table = self.actions(num_microbatches, num_devices)
        return "\n".join(
            f"device {d}: " + " ".join(str(a) for a in row) for d, row in enumerate(table)
        )

    def get_config(self):
        return {}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other):
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self):
        return hash((type(self).__name__, tuple(sorted(self.get_config().items()))))


class GPipe(Schedule):
    """Fill-drain (Huang et al., 2019): every forward, then every backward.

    Each device keeps all M micro-batches' activations until the drain; the
    bubble is (K - 1) / (M + K - 1).

    >>> print(GPipe().format(2, 2))
    device 0: F0.0 F0.1 B0.1 B0.0
    device 1: F1.0 F1.1 B1.1 B1.0
    """

    name = "gpipe"

    def actions(self, num_microbatches, num_devices):
        self.check(num_microbatches, num_devices)
        m_range = range(num_microbatches)
        return [
            [Action("F", d, m) for m in m_range] + [Action("B", d, m) for m in reversed(m_range)]
            for d in range(num_devices)
        ]


class OneFOneB(Schedule):
    """One-forward-one-backward (PipeDream-flush): same bubble as GPipe,
    but device d holds at most K - d micro-batches' activations (GPipe: M).

    Device d runs min(K - d - 1, M) warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards.

    >>> print(OneFOneB().format(4, 2))
    device 0: F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3
    device 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3
    """

    name = "1f1b"

    def actions(self, num_microbatches, num_devices):
        self.check(num_microbatches, num_devices)
        m_count, table = num_microbatches, []
        for d in range(num_devices):
            warmup = min(num_devices - d - 1, m_count)
            row = [Action("F", d, m) for m in range(warmup)]
            for i in range(m_count - warmup):
                row += [Action("F", d, warmup + i), Action("B", d, i)]
            row += [Action("B", d, m) for m in range(m_count - warmup, m_count)]
            table.append(row)
        return table


class Interleaved(Schedule):
    """Interleaved 1F1B (Narayanan et al., 2021) with v stages per device.

    The model is cut into K = v * D stages; stage s runs on device s mod D, so
    each micro-batch visits every device v times. Each stage is v times
    smaller, so the fill and drain shrink: the bubble is about
    (D - 1) / (v * M + D - 1) instead of (D - 1) / (M + D - 1).
    Micro-batches go through the devices in groups of D, so M must be a
    multiple of D.

    >>> print(Interleaved(virtual_stages=2).format(2, 2))
    device 0: F0.0 F0.1 F2.0 F2.1 B2.0 B2.1 B0.0 B0.1
    device 1: F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 B1.0 B1.1
    """

    name = "interleaved"

    def __init__(self, virtual_stages=2):
        if (isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int)
                or virtual_stages < 1):
            raise ValueError(
                f"Interleaved(virtual_stages=...) must be a positive integer, got "
                f"{virtual_stages!r}."
            )
        self.virtual_stages = virtual_stages

    def get_config(self):
        return {"virtual_stages": self.virtual_stages}

    def check(self, num_microbatches, num_devices):
        super().check(num_microbatches, num_devices)
        if num_microbatches % num_devices:
            good = num_devices * -(-num_microbatches // num_devices)
            raise ValueError(
                f"Interleaved needs num_microbatches to be a multiple of the number of "
                f"devices ({num_devices}); got num_microbatches={num_microbatches}. "
                f"Use num_microbatches={good}, or schedule='1f1b'."
            )

    def actions(self, num_microbatches, num_devices):
        self.check(num_microbatches, num_devices)
        v, d_count = self.virtual_stages, num_devices
        if v == 1:
            return OneFOneB().actions(num_microbatches, num_devices)
        total = num_microbatches * v
        table = []
        for d in range(d_count):
            def action(kind, i, d=d):
                group, rest = divmod(i, d_count * v)
                chunk = rest // d_count
                if kind == "B":
                    chunk = v - 1 - chunk  # backwards visit the chunks last-first
                return Action(kind, chunk * d_count + d, group * d_count + rest % d_count)

            warmup = min((d_count - d - 1) * 2 + (v - 1) * d_count, total)
            row = [action("F", i) for i in range(warmup)]
            for i in range(total - warmup):
                row += [action("F", warmup + i), action("B", i)]
            row += [action("B", i) for i in range(total - warmup, total)]
            table.append(row)
        return table


class Table(Schedule):
    """A user-written schedule: a literal table of actions per device.

    Args:
      table: one list per device of actions, each "F<stage>.<mb>" /
        "B<stage>.<mb>" or an `Action`/(kind, stage, mb) tuple. The table is
        for one (M, D); stage s must appear on one device only.
      name: shown in summaries.

    >>> Table([["F0.0", "B0.0"], ["F1.0", "B1.0"]]).stage_device(1, 2)
    1
    """

    def __init__(self, table, name="table"):
        if isinstance(table, str) or not hasattr(table, "__iter__"):
            raise ValueError(f"Table needs one list of actions per device, got {table!r}.")
        self.table = [[Action.parse(a) for a in row] for row in table]
        self.name = name
        self._devices = {}
        for d, row in enumerate(self.table):
            for a in row:
                if self._devices.setdefault(a.stage, d) != d:
                    raise ValueError(
                        f"Table puts stage {a.stage} on devices {self._devices[a.stage]} "
                        f"and {d}; each stage must run on one device."
                    )
        stages = len(self._devices)
        self.virtual_stages = max(1, stages // max(1, len(self.table)))
        self._num_stages = stages
        self._num_microbatches = 1 + max((a.microbatch for row in self.table for a in row),
                                         default=-1)

    def get_config(self):
        return {"table": [[str(a) for a in row] for row in self.table], "name": self.name}

    def num_stages(self, num_devices):
        return self._num_stages

    def stage_device(self, stage, num_devices):
        return self._devices.get(stage, stage % num_devices)

    def check(self, num_microbatches, num_devices):
        super().check(num_microbatches, num_devices)
        if num_devices != len(self.table) or num_microbatches != self._num_microbatches:
            raise ValueError(
                f"This Table schedules {self._num_microbatches} micro-batch(es) on "
                f"{len(self.table)} device(s), but the pipeline has num_microbatches="
                f"{num_microbatches} on {num_devices} device(s); write a table for that "
                f"shape or set num_microbatches={self._num_microbatches}."
            )

    def actions(self, num_microbatches, num_devices):
        self.check(num_microbatches, num_devices)
        return [list(row) for row in self.table]


def get(schedule):
    """A schedule from an instance or a name: "gpipe", "1f1b", "interleaved"
    (2 stages per device) or "interleaved:v" (v stages per device).

    >>> get("interleaved:4")
    Interleaved(virtual_stages=4)
    """
    if isinstance(schedule, Schedule):
        return schedule
    names = {"gpipe": GPipe, "1f1b": OneFOneB, "interleaved": Interleaved}
    if isinstance(schedule, str) and schedule.lower() in names:
        return names[schedule.lower()]()
    match = re.fullmatch(r"interleaved:(\d+)", str(schedule).lower())
    if match:
        return Interleaved(int(match.group(1)))
    raise ValueError(
        f"Unknown schedule {schedule!r}. Use one of {list(SCHEDULE_NAMES)}, "
        f"'interleaved:<v>', or a "
        f"tfpipe.schedules.Schedule instance (GPipe(), OneFOneB(), "
        f"Interleaved(virtual_stages=v), Table([...]))."
    )


def to_config(schedule):
    """A JSON-friendly description of a schedule: {"class": ..., "config": ...}."""
    schedule = get(schedule)
    return {"class": type(schedule).__name__, "config": schedule.get_config()}


def from_config(config):
    """Inverse of `to_config` (also accepts a name, as `get`)."""
    if not isinstance(config, dict):
        return get(config)
    classes = {cls.__name__: cls for cls in (GPipe, OneFOneB, Interleaved, Table)}
    if config.get("class") not in classes:
        raise ValueError(f"Unknown schedule class in a saved config: {config!r}.")
    return classes[config["class"]](**config.get("config", {}))


# -- validation and simulation -------------------------------------------------


def _dependencies(action, num_stages):
    if action.kind == "F":
        return [Action("F", action.stage - 1, action.microbatch)] if action.stage else []
    deps = [Action("F", action.stage, action.microbatch)]
    if action.stage < num_stages - 1:
        deps.append(Action("B", action.stage + 1, action.microbatch))
    return deps


def _table(schedule, num_microbatches, num_devices):
    """Checks the table's contents (not its order); returns (table, K)."""
    schedule = get(schedule)
    table = [[Action.parse(a) for a in row] for row in
             schedule.actions(num_microbatches, num_devices)]
    k_count = schedule.num_stages(num_devices)
    if len(table) != num_devices:
        raise ValueError(f"{schedule!r} gave {len(table)} device rows for {num_devices} devices.")
    seen = {}
    for d, row in enumerate(table):
        for a in row:
            if a.kind not in ("F", "B"):
                raise ValueError(f"Action {a} has kind {a.kind!r}; use 'F' or 'B'.")
            if not (0 <= a.stage < k_count and 0 <= a.microbatch < num_microbatches):
                raise ValueError(
                    f"Action {a} on device {d} is out of range: stages are 0..{k_count - 1} "
                    f"and micro-batches 0..{num_microbatches - 1}."
                )
            home = schedule.stage_device(a.stage, num_devices)
            if d != home:
                raise ValueError(
                    f"Action {a} is on device {d}, but stage {a.stage} lives on device {home}."
                )
            if a in seen:
                raise ValueError(f"Action {a} appears twice (devices {seen[a]} and {d}).")
            seen[a] = d
    missing = [Action(kind, s, m) for s in range(k_count) for m in range(num_microbatches)
               for kind in "FB" if Action(kind, s, m) not in seen]
    if missing:
        names = ", ".join(str(a) for a in missing[:6])
        raise ValueError(
            f"{schedule!r} with M={num_microbatches}, D={num_devices} is missing "
            f"{len(missing)} action(s): {names}{' ...' if len(missing) > 6 else ''}. "
            f"Every stage needs one F and one B per micro-batch."
        )
    return table, k_count


@dataclasses.dataclass
class Simulation:
    """What `simulate` found.

    Attributes:
      timeline: per device, a list of (action, start, end) in run order.
      makespan: time from the first start to the last end (cost units).
      bubble_fraction: idle share of D * makespan device time.
      peak_activations: per device, the most stage activations alive at once
        (forwards started whose backward has not finished). With v stages per
        device each is 1/v of the device's share of the model.
      order: every (device, action) in start order, ties by device: an
        order the engine can trace the step in.
    """

    timeline: list
    makespan: float
    bubble_fraction: float
    peak_activations: list
    order: list


def simulate(schedule, num_microbatches, num_devices, forward_cost=1.0, backward_cost=2.0):
    """Runs the schedule on an idealised machine; validates it on the way.

    Each device runs its actions in order; an action starts when its device is
    free and its dependencies have finished (communication is free). Costs are
    for one device's share of the model per micro-batch: with v stages per
    device each stage's forward costs `forward_cost / v`.

    Args:
      schedule: a schedule instance or name.
      num_microbatches: M.
      num_devices: D.
      forward_cost, backward_cost: float, or a list of K per-stage costs.
    Returns:
      A `Simulation`.
    Raises:
      ValueError: the schedule is malformed (an action out of range, twice,
        missing, or on the wrong device) or runs an action before its inputs
        exist (the schedule would deadlock); the message names the actions.
    """
    schedule = get(schedule)
    table, k_count = _table(schedule, num_microbatches, num_devices)
    v = schedule.virtual_stages

    def cost(value, stage):
        if isinstance(value, (int, float)):
            return float(value) / v
        return float(value[stage])

    finish, pos = {}, [0] * num_devices
    free = [0.0] * num_devices
    live, peak = [0] * num_devices, [0] * num_devices
    timeline = [[] for _ in range(num_devices)]
    order = []
    remaining = sum(len(row) for row in table)
    while remaining:
        best = None
        for d in range(num_devices):
            if pos[d] == len(table[d]):
                continue
            action = table[d][pos[d]]
            deps = _dependencies(action, k_count)
            if all(dep in finish for dep in deps):
                start = max([free[d]] + [finish[dep] for dep in deps])
                if best is None or start < best[0]:
                    best = (start, d, action)
        if best is None:
            blocked = []
            for d in range(num_devices):
                if pos[d] < len(table[d]):
                    action = table[d][pos[d]]
                    need = [str(dep) for dep in _dependencies(action, k_count)
                            if dep not in finish]
                    blocked.append(f"device {d} waits at {action} for {', '.join(need)}")
            raise ValueError(
                f"{schedule!r} with M={num_microbatches}, D={num_devices} runs an action "
                f"before its inputs exist, so it would deadlock: {'; '.join(blocked)}. "
                f"F(s,m) needs F(s-1,m); B(s,m) needs F(s,m) and B(s+1,m)."
            )
        start, d, action = best
        duration = cost(forward_cost if action.kind == "F" else backward_cost, action.stage)
        end = start + duration
        finish[action] = end
        free[d] = end
        pos[d] += 1
        remaining -= 1
        timeline[d].append((action, start, end))
        order.append((d, action))
        # A device runs in order, so its earlier backwards have ended: the
        # stage activations alive now are its forwards minus its backwards.
        live[d] += 1 if action.kind == "F" else -1
        peak[d] = max(peak[d], live[d])
    makespan = max((row[-1][2] for row in timeline if row), default=0.0)
    busy = sum(e - s for row in timeline for _, s, e in row)
    bubble = 1.0 - busy / (num_devices * makespan) if makespan else 0.0
    return Simulation(timeline, makespan, round(bubble, 12), peak, order)


def validate(schedule, num_microbatches, num_devices):
    """Checks `schedule` for (M, D); returns the (device, action) run order.

    Raises ValueError naming the problem (see `simulate`).
    """
    return simulate(schedule, num_microbatches, num_devices).order


def clock_ticks(schedule, num_microbatches, num_devices, forward_only=False):
    """The schedule on a synchronous clock: every action takes one tick.

    Args:
      forward_only: keep only the F actions (evaluation and prediction).
    Returns:
      A list of T ticks, each a list of D entries: the `Action` device d runs
      at that tick, or None (idle). An action's dependencies all ran at
      earlier ticks. Used by the engine's loop form (`tfpipe.loop`).
    """
    schedule = get(schedule)
    table, k_count = _table(schedule, num_microbatches, num_devices)
    if forward_only:
        table = [[a for a in row if a.kind == "F"] for row in table]
    done, pos, ticks = set(), [0] * num_devices, []
    while any(p < len(row) for p, row in zip(pos, table)):
        tick = [None] * num_devices
        for d, row in enumerate(table):
            if pos[d] < len(row):
                action = row[pos[d]]
                if all(dep in done for dep in _dependencies(action, k_count)
                       if not (forward_only and dep.kind == "B")):
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


def clock_cycles(num_microbatches, num_stages):
    """GPipe's forward fill as ticks: at tick t stage k runs micro-batch t - k.

    >>> clock_cycles(3, 2)
    [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]

    Returns:
      M + K - 1 ticks, each a list of (micro_batch, stage) pairs.
    """
    _check_counts(num_microbatches, num_stages)
    return [
        [(t - k, k) for k in range(num_stages) if 0 <= t - k < num_microbatches]
        for t in range(num_microbatches + num_stages - 1)
    ]


def bubble_fraction(num_microbatches, num_stages):
    """GPipe's idle fraction with equal stages: (K - 1) / (M + K - 1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
