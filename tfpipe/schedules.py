"""The built-in pipeline schedules, as data: for each device, its ordered actions.

A schedule maps (M micro-batches, D devices) to one list of actions per
device (`tfpipe.actions`: F, B, I, W); nothing here needs TensorFlow, so a
schedule can be printed, validated and simulated before it runs:

>>> schedule = OneFOneB()
>>> print(schedule.format(num_microbatches=3, num_devices=2))
device 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2
device 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2
>>> simulate(schedule, 3, 2).bubble_fraction   # (K - 1) / (M + K - 1)
0.25

A new schedule is a new table (subclass `Schedule`, or a literal `Table`),
not a new engine. `simulate` and co. take schedule names too.
"""

import re

from tfpipe import simulation
from tfpipe.actions import ARGUMENTS, KINDS, Action, Schedule, Spelling

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv")


class GPipe(Schedule):
    """Fill-drain (Huang et al., 2019): every forward, then every backward.
    Bubble (K - 1) / (M + K - 1); a device keeps all M activations.

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
            for d in range(num_devices)]


class OneFOneB(Schedule):
    """One-forward-one-backward (PipeDream-flush): GPipe's bubble, but
    device d holds at most K - d micro-batches' activations (GPipe: M).

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
    """Interleaved 1F1B (Narayanan et al., 2021): K = v * D stages, stage s
    on device s mod D; bubble about (D - 1) / (v * M + D - 1). M must be a
    multiple of D (micro-batches go through the devices in groups of D).

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
                f"{virtual_stages!r}.")
        self.virtual_stages = virtual_stages

    def get_config(self):
        return {"virtual_stages": self.virtual_stages}

    def check(self, num_microbatches, num_devices, spell=ARGUMENTS):
        super().check(num_microbatches, num_devices)
        if num_microbatches % num_devices:
            good = num_devices * -(-num_microbatches // num_devices)
            raise ValueError(
                f"{spell('schedule', schedule_name(self))} needs "
                f"{spell('num_microbatches')} to be a multiple of its {num_devices} devices; "
                f"got {spell('num_microbatches', num_microbatches)}. Use "
                f"{spell('num_microbatches', good)}, or {spell('schedule', '1f1b')}.")

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


class ZeroBubbleH1(Schedule):
    """ZB-H1 (Qi et al., 2024): 1F1B with each backward split into I and W.

    Device d alternates F and I after 1F1B's warm-up; its W's start after
    its first d + 1 I's and fill the drain. With F = I = W and M >= D the
    idle time is a third of 1F1B's (makespan 3M + D - 1). Every device
    keeps at most min(M, D) activations: 1F1B's peak, on every device.

    >>> print(ZeroBubbleH1().format(3, 2))
    device 0: F0.0 F0.1 I0.0 W0.0 F0.2 I0.1 W0.1 I0.2 W0.2
    device 1: F1.0 I1.0 F1.1 I1.1 W1.0 F1.2 I1.2 W1.1 W1.2
    >>> sim = simulate(ZeroBubbleH1(), 8, 4, backward_cost=2.0)
    >>> sim.makespan, simulate(OneFOneB(), 8, 4).makespan   # 3 M + D - 1 vs 3 (M + D - 1)
    (27.0, 33.0)
    """

    name = "zbh1"
    splits_backward = True

    def actions(self, num_microbatches, num_devices):
        self.check(num_microbatches, num_devices)
        m_count, table = num_microbatches, []
        for d in range(num_devices):
            warmup = min(num_devices - d - 1, m_count)
            row = [Action("F", d, m) for m in range(warmup)]
            weights = 0  # W's placed so far, oldest first
            for i in range(m_count - warmup):
                row += [Action("F", d, warmup + i), Action("I", d, i)]
                if i >= d:
                    row.append(Action("W", d, weights))
                    weights += 1
            for i in range(m_count - warmup, m_count):
                row += [Action("I", d, i), Action("W", d, weights)]
                weights += 1
            row += [Action("W", d, m) for m in range(weights, m_count)]
            table.append(row)
        return table


class ZeroBubbleV(Schedule):
    """ZB-V (Qi et al., 2024): two stages per device in a V, split backward.

    K = 2D stages: stage s on device s for s < D, else 2D - 1 - s. The table
    is a greedy list schedule on unit costs (`_list_schedule`): a free device
    runs a ready I, else a ready F while its live activations stay under 2D,
    else its oldest pending W. With F = I = W and M >= D the bubble is
    (D - 1) / (6 M + D - 1), a sixth of 1F1B's idle time; at most 2 min(M, D)
    live stage activations (half a device's share each) per device.

    >>> print(ZeroBubbleV().format(2, 2))
    device 0: F0.0 F0.1 F3.0 I3.0 F3.1 I3.1 I0.0 W3.0 I0.1 W3.1 W0.0 W0.1
    device 1: F1.0 F2.0 F1.1 F2.1 I2.0 I1.0 I2.1 I1.1 W2.0 W1.0 W2.1 W1.1
    >>> simulate(ZeroBubbleV(), 8, 4).bubble_fraction   # 3 / 51
    0.058823529412
    """

    name = "zbv"
    splits_backward = True
    virtual_stages = 2

    def stage_device(self, stage, num_devices):
        return stage if stage < num_devices else 2 * num_devices - 1 - stage

    def actions(self, num_microbatches, num_devices):
        self.check(num_microbatches, num_devices)
        return _list_schedule(num_microbatches, num_devices, self.num_stages(num_devices),
                              lambda s: self.stage_device(s, num_devices),
                              limit=2 * num_devices)


def _list_schedule(num_microbatches, num_devices, num_stages, device_of, limit):
    """Greedy split-backward table on unit costs (see `ZeroBubbleV`); ties go
    to the lowest micro-batch, then the latest stage. Deterministic."""
    m_count, k_count, d_count = num_microbatches, num_stages, num_devices
    stages = [[s for s in range(k_count) if device_of(s) == d] for d in range(d_count)]
    split = {Action("I", s, m) for s in range(k_count) for m in range(m_count)}
    finish, rows = {}, [[] for _ in range(d_count)]
    free, live = [0] * d_count, [0] * d_count
    next_mb = {"F": [0] * k_count, "I": [0] * k_count}  # each stage's F's and I's in order
    pending = [[] for _ in range(d_count)]  # W's whose I has run, oldest first
    time, left, relax = 0, 3 * m_count * k_count, False
    order = lambda a: (a.microbatch, -a.stage)  # noqa: E731

    def ready(d, kind):
        out = []
        for s in stages[d]:
            if next_mb[kind][s] < m_count:
                action = Action(kind, s, next_mb[kind][s])
                deps = KINDS[kind].dependencies(action, k_count, split)
                if all(finish.get(dep, time + 1) <= time for dep in deps):
                    out.append(action)
        return out

    while left:
        progressed = False
        for d in range(d_count):
            if free[d] > time:
                continue
            pick = min(ready(d, "I"), key=order, default=None)
            if pick is None and (live[d] < limit or (relax and not pending[d])):
                pick = min(ready(d, "F"), key=order, default=None)
            if pick is None and pending[d]:
                pick = pending[d].pop(0)
            if pick is None:
                continue
            finish[pick] = free[d] = time + 1
            rows[d].append(pick)
            live[d] += KINDS[pick.kind].memory
            if pick.kind in next_mb:
                next_mb[pick.kind][pick.stage] += 1
            if pick.kind == "I":
                pending[d].append(Action("W", pick.stage, pick.microbatch))
            left -= 1
            progressed, relax = True, False
        later = [f for f in free if f > time]
        if later:
            time = min(later)
        elif not progressed:
            # Every device waits on memory alone: let one F past the limit.
            # (The lowest unfinished F or I is always ready, so this ends.)
            relax = True
    return rows


class Segmented(Schedule):
    """Another schedule with every stage cut into `segments` sub-stages on
    the same device (recompute granularity): each base action becomes that
    action on every sub-stage, forwards in stage order, backwards reversed.
    With recompute="always" a device then holds its segment inputs plus one
    segment's activations. K is the base's times `segments`; the devices,
    bubble and order are the base's.

    >>> print(Segmented(OneFOneB(), 2).format(2, 2))
    device 0: F0.0 F1.0 F0.1 F1.1 B1.0 B0.0 B1.1 B0.1
    device 1: F2.0 F3.0 B3.0 B2.0 F2.1 F3.1 B3.1 B2.1
    """

    def __init__(self, schedule, segments=2):
        if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
            raise ValueError(
                f"Segmented(segments=...) must be a positive integer, got {segments!r}.")
        base = get(schedule)
        if isinstance(base, Segmented):
            base, segments = base.base, base.segments * segments
        self.base, self.segments = base, segments
        self.name = f"{base.name}/segments={segments}"
        self.virtual_stages = base.virtual_stages * segments
        self.splits_backward = base.splits_backward

    def get_config(self):
        return {"schedule": to_config(self.base), "segments": self.segments}

    def num_stages(self, num_devices):
        return self.base.num_stages(num_devices) * self.segments

    def stage_device(self, stage, num_devices):
        return self.base.stage_device(stage // self.segments, num_devices)

    def check(self, num_microbatches, num_devices, spell=ARGUMENTS):
        self.base.check(num_microbatches, num_devices, spell)

    def actions(self, num_microbatches, num_devices):
        n = self.segments
        table = []
        for row in self.base.actions(num_microbatches, num_devices):
            out = []
            for a in (Action.parse(a) for a in row):
                pieces = range(n) if a.kind == "F" else reversed(range(n))
                out += [Action(a.kind, a.stage * n + j, a.microbatch) for j in pieces]
            table.append(out)
        return table


class Table(Schedule):
    """A user-written schedule: a literal table of actions per device.

    Args:
      table: one list per device of actions ("F<stage>.<mb>", an `Action` or
        a (kind, stage, mb) tuple), for one (M, D); each stage on one device.
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
                        f"and {d}; each stage must run on one device.")
        stages = len(self._devices)
        self.virtual_stages = max(1, stages // max(1, len(self.table)))
        self._num_stages = stages
        self._num_microbatches = 1 + max((a.microbatch for row in self.table for a in row),
                                         default=-1)
        self.splits_backward = any(a.kind in ("I", "W") for row in self.table for a in row)

    def get_config(self):
        return {"table": [[str(a) for a in row] for row in self.table], "name": self.name}

    def num_stages(self, num_devices):
        return self._num_stages

    def stage_device(self, stage, num_devices):
        return self._devices.get(stage, stage % num_devices)

    def check(self, num_microbatches, num_devices, spell=ARGUMENTS):
        super().check(num_microbatches, num_devices)
        if num_devices != len(self.table) or num_microbatches != self._num_microbatches:
            raise ValueError(
                f"This Table schedules {self._num_microbatches} micro-batch(es) on "
                f"{len(self.table)} device(s), but the pipeline has num_microbatches="
                f"{num_microbatches} on {num_devices} device(s); write a table for that "
                f"shape or set num_microbatches={self._num_microbatches}.")

    def actions(self, num_microbatches, num_devices):
        self.check(num_microbatches, num_devices)
        return [list(row) for row in self.table]


def get(schedule):
    """A schedule from an instance or a name: "gpipe", "1f1b", "interleaved"
    (v = 2), "interleaved:v", "zbh1", "zbv", or "<name>/segments=n".

    >>> get("interleaved:4")
    Interleaved(virtual_stages=4)
    """
    if isinstance(schedule, Schedule):
        return schedule
    names = {"gpipe": GPipe, "1f1b": OneFOneB, "interleaved": Interleaved,
             "zbh1": ZeroBubbleH1, "zbv": ZeroBubbleV}
    if isinstance(schedule, str) and schedule.lower() in names:
        return names[schedule.lower()]()
    match = re.fullmatch(r"interleaved:(\d+)", str(schedule).lower())
    if match:
        return Interleaved(int(match.group(1)))
    match = re.fullmatch(r"(.+)/segments=(\d+)", str(schedule).lower())
    if match:
        return Segmented(get(match.group(1)), int(match.group(2)))
    raise ValueError(
        f"Unknown schedule {schedule!r}. Use one of {list(SCHEDULE_NAMES)}, 'interleaved:<v>', "
        f"'<schedule>/segments=<n>', or a tfpipe.schedules.Schedule instance (GPipe(), OneFOneB(), "
        f"Interleaved(virtual_stages=v), ZeroBubbleH1(), ZeroBubbleV(), Table([...])).")


def schedule_name(schedule):
    """The name `get` takes back: "gpipe", "interleaved:4", "1f1b/segments=2"."""
    schedule = get(schedule)
    if isinstance(schedule, Interleaved):
        return f"interleaved:{schedule.virtual_stages}"
    if isinstance(schedule, Segmented):
        return f"{schedule_name(schedule.base)}/segments={schedule.segments}"
    return getattr(schedule, "name", repr(schedule))


def devices_needed(schedule, num_stages, num_microbatches=None, spell=ARGUMENTS):
    """D, the devices `schedule` (instance or name) runs K = `num_stages`
    stages on: the one rule for whether stages fill whole devices. Also
    checks M if given; `spell` names the settings (`Spelling`).

    Raises:
      ValueError: K is not a multiple of the schedule's stages per device, a
        `Table` holds another K, or the schedule cannot run M on D.
    """
    given = schedule if isinstance(schedule, str) else None
    schedule = get(schedule)
    if isinstance(schedule, Table):
        count = len(schedule.table)
        if num_stages != schedule.num_stages(count):
            raise ValueError(f"The schedule table has {schedule.num_stages(count)} stages "
                             f"but the model has {num_stages}.")
    else:
        v = schedule.virtual_stages
        if num_stages % v:
            raise ValueError(
                f"{spell('schedule', given or schedule_name(schedule))} puts {v} stages on each "
                f"device, so {spell('num_stages')} must be a multiple of {v}; got "
                f"{spell('num_stages', num_stages)}. Use "
                f"{spell('num_stages', v * -(-num_stages // v))}.")
        count = num_stages // v
    if num_microbatches is not None:
        schedule.check(num_microbatches, count, spell)
    return count


def max_stages(schedule, num_devices):
    """The most stages `schedule` (instance or name) places on `num_devices`
    devices (a `Table`: its own stage count)."""
    schedule = get(schedule)
    if isinstance(schedule, Table):
        return schedule.num_stages(len(schedule.table))
    return schedule.num_stages(num_devices)


def stage_devices(schedule, num_stages, devices):
    """(the first D of `devices` that `schedule` runs `num_stages` stages on,
    each stage's device among them), or None when `devices` are too few."""
    schedule = get(schedule)
    count = devices_needed(schedule, num_stages)
    if count > len(devices):
        return None
    used = tuple(devices[:count])
    return used, tuple(used[schedule.stage_device(k, count)] for k in range(num_stages))


def to_config(schedule):
    """A JSON-friendly description of a schedule: {"class": ..., "config": ...}."""
    schedule = get(schedule)
    return {"class": type(schedule).__name__, "config": schedule.get_config()}


def from_config(config):
    """Inverse of `to_config` (also accepts a name, as `get`)."""
    if not isinstance(config, dict):
        return get(config)
    classes = {cls.__name__: cls for cls in (GPipe, OneFOneB, Interleaved, ZeroBubbleH1,
                                             ZeroBubbleV, Table, Segmented)}
    if config.get("class") not in classes:
        raise ValueError(f"Unknown schedule class in a saved config: {config!r}.")
    arguments = dict(config.get("config", {}))
    if config["class"] == "Segmented":
        arguments["schedule"] = from_config(arguments["schedule"])
    return classes[config["class"]](**arguments)


def simulate(schedule, num_microbatches, num_devices, forward_cost=1.0, backward_cost=2.0,
             weight_cost=None, recompute="never"):
    """`tfpipe.simulation.simulate` of a schedule instance or name (see there)."""
    return simulation.simulate(get(schedule), num_microbatches, num_devices, forward_cost,
                               backward_cost, weight_cost, recompute)


def validate(schedule, num_microbatches, num_devices):
    """Checks `schedule` (an instance or name) for (M, D); returns the
    (device, action) run order (`tfpipe.simulation.validate`)."""
    return simulation.validate(get(schedule), num_microbatches, num_devices)


def clock_ticks(schedule, num_microbatches, num_devices, forward_only=False, costs=None):
    """`tfpipe.simulation.clock_ticks` of a schedule instance or name."""
    return simulation.clock_ticks(get(schedule), num_microbatches, num_devices, forward_only, costs)
