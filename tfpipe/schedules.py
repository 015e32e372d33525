"""Pipeline schedules as data: for each device, the ordered list of its actions.

An action is (kind, stage, micro-batch): `F` runs a stage's forward on one
micro-batch, `B` its backward; a split backward is `I` (the gradient of the
stage input, on the critical path) then `W` (the weight gradients, which can
wait). The kinds, their dependencies, costs and memory effects are one table,
`KINDS`, that validation, simulation and the clock read. A schedule maps (M micro-batches, D devices) to
one list of actions per device; nothing here needs TensorFlow, so a schedule
can be printed, validated and simulated before it runs:

>>> schedule = OneFOneB()
>>> print(schedule.format(num_microbatches=3, num_devices=2))
device 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2
device 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2
>>> simulate(schedule, 3, 2).bubble_fraction   # (K - 1) / (M + K - 1)
0.25

Dependencies between actions (what `validate` checks and the engine obeys):
  F(s, m) needs F(s - 1, m);
  B(s, m) and I(s, m) need F(s, m) and the input gradient of (s + 1, m),
    which B(s + 1, m) or I(s + 1, m) produces (whichever the table has);
  W(s, m) needs I(s, m).
Every (stage, micro-batch) has one F and either one B or one I and one W.
The last stage's loss is computed right after its forward, on its device.

Stage s lives on device `schedule.stage_device(s, D)`: s for GPipe, 1F1B and
ZB-H1 (K = D stages), s mod D for `Interleaved` (K = v * D stages, v per
device), and a V for ZB-V (device d holds stages d and 2D - 1 - d).
New schedules are a new table (subclass `Schedule` and implement `actions`,
or pass a literal table to `Table`), not a new engine.
"""

import dataclasses
import re
from typing import NamedTuple

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv")


class Action(NamedTuple):
    """One unit of work: `kind` ("F", "B", "I" or "W", see `KINDS`) of
    `stage` on `microbatch`."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self):
        return f"{self.kind}{self.stage}.{self.microbatch}"

    @classmethod
    def parse(cls, text):
        """`Action.parse("B2.5") == Action("B", 2, 5)` (also "I2.5", "w2.5");
        tuples pass through."""
        if isinstance(text, Action):
            return text
        if isinstance(text, tuple) and len(text) == 3:
            return cls(str(text[0]).upper(), int(text[1]), int(text[2]))
        match = re.fullmatch(r"\s*([A-Za-z])\s*(\d+)\s*[.,:]\s*(\d+)\s*", str(text))
        if not match or match.group(1).upper() not in KINDS:
            forms = ", ".join(f"'{k}<stage>.<microbatch>' ({kind.description})"
                              for k, kind in KINDS.items())
            raise ValueError(
                f"Cannot read action {text!r}; write actions as {forms} (e.g. 'F0.3'), "
                f"or as (kind, stage, microbatch)."
            )
        return cls(match.group(1).upper(), int(match.group(2)), int(match.group(3)))


@dataclasses.dataclass(frozen=True)
class ActionKind:
    """What one kind of action is, as data.

    Attributes:
      name: the letter ("F", "B", "I", "W").
      description: a few words, for messages.
      memory: change in the stage's live activations when it runs (F keeps
        them, B and W free them; I keeps them for the W).
      cost: which cost it takes in `simulate`: "forward", "backward",
        "input" (backward_cost - weight_cost) or "weight" (weight_cost).
      needs: (what, stage offset) pairs on the same micro-batch: `what` is a
        kind, or "grad" for the input gradient of that stage (produced by B
        or I, see `input_gradient_action`). Stages outside 0..K-1 are dropped.
      input_gradient: whether it produces the stage input's gradient.
      weight_gradient: whether it produces the stage's weight gradients.
      rule: `needs` in words, for the deadlock message.
    """

    name: str
    description: str
    memory: int
    cost: str
    needs: tuple
    input_gradient: bool
    weight_gradient: bool
    rule: str

    def dependencies(self, action, num_stages, actions=()):
        """The actions `action` (of this kind) waits for, in a table whose
        actions are `actions` (any container; decides B or I for "grad")."""
        out = []
        for what, offset in self.needs:
            stage = action.stage + offset
            if 0 <= stage < num_stages:
                if what == "grad":
                    out.append(input_gradient_action(actions, stage, action.microbatch))
                else:
                    out.append(Action(what, stage, action.microbatch))
        return out


KINDS = {
    "F": ActionKind("F", "forward", +1, "forward", (("F", -1),), False, False,
                    "F(s,m) needs F(s-1,m)"),
    "B": ActionKind("B", "full backward", -1, "backward", (("F", 0), ("grad", +1)), True, True,
                    "B(s,m) and I(s,m) need F(s,m) and the input gradient of (s+1,m) "
                    "from B(s+1,m) or I(s+1,m)"),
    "I": ActionKind("I", "backward for the stage input's gradient", 0, "input",
                    (("F", 0), ("grad", +1)), True, False, ""),
    "W": ActionKind("W", "backward for the weight gradients", -1, "weight", (("I", 0),),
                    False, True, "W(s,m) needs I(s,m)"),
}
# The ways to write one (stage, micro-batch)'s backward: one B, or an I and a W.
BACKWARD_FORMS = (("B",), ("I", "W"))
_RULES = "; ".join(kind.rule for kind in KINDS.values() if kind.rule) + "."


# Re-materialisation policies (`tfpipe.recompute` applies them; `simulate`
# prices them): which micro-batches replay their stage's forward before the
# backward that needs its activations.
RECOMPUTE_MODES = ("always", "except_last", "never")


def validate_recompute(mode):
    """Returns `mode` if it names a recompute policy, else raises ValueError."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(
            f"Unknown recompute mode {mode!r}. Use one of {list(RECOMPUTE_MODES)}: "
            f"'always' recomputes every stage in the backward pass, "
            f"'except_last' all but the last micro-batch (as torchgpipe), "
            f"'never' keeps all activations."
        )
    return mode


def is_recomputed(mode, microbatch, num_microbatches):
    """Whether micro-batch `microbatch` (0-based) of M replays its forward
    under recompute `mode`: every one for "always", all but the last for
    "except_last" (its activations are still there), none for "never"."""
    validate_recompute(mode)
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch != num_microbatches - 1
    return False


def input_gradient_action(actions, stage, microbatch):
    """The action that produces the input gradient of (stage, microbatch) in a
    table holding `actions`: its I if there is one, else its B."""
    for kind in KINDS.values():
        if kind.input_gradient and kind.name != "B":
            candidate = Action(kind.name, stage, microbatch)
            if candidate in actions:
                return candidate
    return Action("B", stage, microbatch)


def _check_counts(num_microbatches, num_devices):
    for name, value in (("num_microbatches", num_microbatches), ("num_devices", num_devices)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")


class Schedule:
    """Base class: a schedule is `actions(M, D)`, one action list per device.

    Subclasses set `name` and implement `actions`; `virtual_stages` (v) is the
    number of stages each device holds (K = v * D); `splits_backward` says
    whether the backward is split into I and W actions.
    """

    name = "schedule"
    virtual_stages = 1
    splits_backward = False

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


class ZeroBubbleH1(Schedule):
    """ZB-H1 (Qi et al., 2024): 1F1B with each backward split into I and W.

    Device d runs 1F1B's D - d - 1 warm-up forwards, then alternates one
    forward and one I; its W's start after its first d + 1 I's, and the
    cool-down runs I, W pairs and then the W's left. Only I is on the
    critical path, so the backward wave reaches the first device earlier and
    the late W's fill the drain. With F = I = W (backward_cost = 2 *
    forward_cost, the default weight_cost) and M >= D the idle time is a
    third of 1F1B's: D (D - 1) forward units against 3 D (D - 1), a
    makespan of 3M + D - 1 (measured for D <= 8). With M < D there is less
    to fill: between a third and two thirds (M = 1: two thirds).

    Memory: every device keeps at most min(M, D) micro-batches' activations
    (counting F to W), which is 1F1B's peak on device 0, so the pipeline's
    peak is the same. Devices d > 0 keep more than 1F1B's D - d: the last
    device must hold its W's to the end, and no schedule with only D - d
    live on device d can beat two thirds of 1F1B's idle time (the last
    device would run F, I, W back to back from time D - 1, and the I chain
    back to device 0 and its last W add D - 1: a makespan of at least
    3M + 2D - 2). After
    I a stage can free what only the input gradient needed; W needs the
    layer inputs and output gradients, so in bytes the gap is smaller.

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

    K = 2D stages; stage s runs on device s for s < D and on device
    2D - 1 - s after, so device 0 holds the first and the last stage and a
    micro-batch goes down the devices and back up. The table comes from a
    greedy list scheduler on unit costs (F = I = W = 1 per stage): at each
    step every free device runs a ready I if it has one (lowest micro-batch,
    then latest stage), else a ready F (same order) if its live stage
    activations stay under 2D, else its oldest pending W, else it waits.
    The result is deterministic and always completes.

    With F = I = W (backward_cost = 2 * forward_cost, the default
    weight_cost) and M >= D the idle time is D (D - 1) / 2 forward units, a
    sixth of 1F1B's and half of ZB-H1's, so the bubble fraction is
    (D - 1) / (6 M + D - 1): 0.059 at M = 8, D = 4, below 0.06 whenever
    M >= 2D and D <= 4 (measured exactly for D in 2, 3, 4, 8; D = 5 idles a
    quarter more, 0.050 at M = 16). The fill, D (D - 1) / 4, is the least
    any schedule idles. With M < D the fill dominates (D = 4, M = 1: 0.65).
    Memory: at most 2 min(M, D) live stage activations per device, each
    half a device's share: no more than 1F1B's first device.

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
    """Greedy split-backward table on unit costs (see `ZeroBubbleV`)."""
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
    """Another schedule with every stage re-materialised in `segments` pieces.

    Recompute granularity: each of the base schedule's stages is cut into
    `segments` consecutive sub-stages on the same device, and each of the
    base's actions becomes the same action on all of them, back to back:
    forwards in stage order, backward halves in reverse. With
    recompute="always" a sub-stage keeps only its input per micro-batch and
    replays alone in its backward, so a device holds its segment boundaries
    plus one segment's activations (checkpointing every few layers) instead
    of a whole stage's. The stage count is the base's times `segments`
    (`PipelinedModel.from_model` cuts that many; hand-made stages must be
    that many); the devices, bubble and order are the base's.

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

    def check(self, num_microbatches, num_devices):
        self.base.check(num_microbatches, num_devices)

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
      table: one list per device of actions, each "F<stage>.<mb>",
        "B<stage>.<mb>", "I<stage>.<mb>", "W<stage>.<mb>" or an
        `Action`/(kind, stage, mb) tuple. The table is
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
        self.splits_backward = any(a.kind in ("I", "W") for row in self.table for a in row)

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
    (2 stages per device), "interleaved:v" (v stages per device), "zbh1",
    "zbv", or "<name>/segments=n" (`Segmented`: each stage recomputed in n
    pieces).

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
        f"Unknown schedule {schedule!r}. Use one of {list(SCHEDULE_NAMES)}, "
        f"'interleaved:<v>', '<schedule>/segments=<n>', or a "
        f"tfpipe.schedules.Schedule instance (GPipe(), OneFOneB(), "
        f"Interleaved(virtual_stages=v), ZeroBubbleH1(), ZeroBubbleV(), Table([...]))."
    )


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


# -- validation and simulation -------------------------------------------------


def _dependencies(action, num_stages, actions=()):
    return KINDS[action.kind].dependencies(action, num_stages, actions)


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
            if a.kind not in KINDS:
                raise ValueError(
                    f"Action {a} has kind {a.kind!r}; use one of "
                    + ", ".join(f"'{k}' ({kind.description})" for k, kind in KINDS.items())
                    + "."
                )
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
                    f"or one I (input gradient) and one W (weight gradients), not both."
                )
            missing += [Action(k, s, m) for k in ("F",) + forms[0] if k not in present]
    if missing:
        names = ", ".join(str(a) for a in missing[:6])
        raise ValueError(
            f"{schedule!r} with M={num_microbatches}, D={num_devices} is missing "
            f"{len(missing)} action(s): {names}{' ...' if len(missing) > 6 else ''}. "
            f"Every stage needs one F and one B per micro-batch (or, split, one I and "
            f"one W instead of the B)."
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
        (the sum of the `KINDS` memory effects: forwards whose B or W has
        not finished). With v stages per device each is 1/v of the
        device's share of the model.
      order: every (device, action) in start order, ties by device: an
        order the engine can trace the step in.
    """

    timeline: list
    makespan: float
    bubble_fraction: float
    peak_activations: list
    order: list


def _cost_function(forward_cost, backward_cost, weight_cost, virtual_stages,
                   recompute="never", num_microbatches=None):
    """cost(action) in `simulate`'s units; checks weight_cost <= backward_cost.
    Under `recompute` the action that needs a replayed micro-batch's
    activations first (its B or I) also pays the stage's forward."""

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
                f"backward_cost={backward_cost!r} (stage {stage}: {weight} of {backward})."
            )
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
                f"{'; '.join(blocked)}. {_RULES}"
            )
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
    free and its dependencies have finished (communication is free). Costs are
    for one device's share of the model per micro-batch: with v stages per
    device each stage's forward costs `forward_cost / v`. B costs
    `backward_cost`; a split backward costs the same in two parts: W costs
    `weight_cost` and I the rest.

    Args:
      schedule: a schedule instance or name.
      num_microbatches: M.
      num_devices: D.
      forward_cost, backward_cost: float, or a list of K per-stage costs.
      weight_cost: float or a list of K per-stage costs, at most
        `backward_cost`; None: half of `backward_cost`.
      recompute: "never", "always" or "except_last" (`RECOMPUTE_MODES`): a
        micro-batch that replays its forward (`is_recomputed`) pays the
        stage's forward cost again in its B (or I), so `backward_cost` is
        the backward alone. With the defaults, GPipe's recompute step is
        `simulate(s, M, D, recompute="always")`: a backward of 3 forwards.
    Returns:
      A `Simulation`.
    Raises:
      ValueError: the schedule is malformed (an action out of range, twice,
        missing, or on the wrong device; a B together with an I or W) or runs
        an action before its inputs exist (the schedule would deadlock); the
        message names the actions.
    """
    schedule = get(schedule)
    table, k_count = _table(schedule, num_microbatches, num_devices)
    cost = _cost_function(forward_cost, backward_cost, weight_cost, schedule.virtual_stages,
                          recompute, num_microbatches)
    return _run(table, k_count, cost,
                f"{schedule!r} with M={num_microbatches}, D={num_devices}")


def validate(schedule, num_microbatches, num_devices):
    """Checks `schedule` for (M, D); returns the (device, action) run order.

    Raises ValueError naming the problem (see `simulate`).
    """
    return simulate(schedule, num_microbatches, num_devices).order


def clock_ticks(schedule, num_microbatches, num_devices, forward_only=False, costs=None):
    """The schedule on a clock: a list of ticks, each one action per device.

    Args:
      forward_only: keep only the F actions (evaluation and prediction).
      costs: None: lock-step, every action takes one tick and a device runs
        its next action at the first tick after its inputs exist. Or
        (forward_cost, backward_cost, weight_cost) as in `simulate`: the
        ticks follow the simulated event order instead; a tick starts at
        every distinct simulated start time and each action sits at the tick
        where it starts, its device idle (None) in the ticks in between.
    Returns:
      A list of T ticks, each a list of D entries: the `Action` device d runs
      at that tick, or None (idle). An action's dependencies all ran at
      earlier ticks, and each device's actions keep their table order. Used
      by the engine's loop form (`tfpipe.loop`).
    """
    schedule = get(schedule)
    table, k_count = _table(schedule, num_microbatches, num_devices)
    if forward_only:
        table = [[a for a in row if a.kind == "F"] for row in table]
    if costs is not None:
        forward, backward, *weight = costs
        cost = _cost_function(forward, backward, weight[0] if weight else None,
                              schedule.virtual_stages)
        sim = _run(table, k_count, cost,
                   f"{schedule!r} with M={num_microbatches}, D={num_devices}")
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
