"""The vocabulary of a pipeline schedule: actions, their kinds, the recompute rule.

An action is (kind, stage, micro-batch): `F` runs a stage's forward on one
micro-batch, `B` its backward; a split backward is `I` (the stage input's
gradient, on the critical path) then `W` (the weight gradients, which can
wait). Every (stage, micro-batch) has one F and either one B or one I and
one W. The kinds, their dependencies, costs and memory effects are one
table, `KINDS`, that validation, simulation, the clock and the engine read.
`Schedule` is the interface a schedule implements (`tfpipe.schedules` has
the built-in ones). Pure Python.
"""

import dataclasses
import re
from typing import NamedTuple


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
                f"or as (kind, stage, microbatch).")
        return cls(match.group(1).upper(), int(match.group(2)), int(match.group(3)))


@dataclasses.dataclass(frozen=True)
class ActionKind:
    """What one kind of action is, as data.

    Attributes:
      name, description: the letter ("F", "B", "I", "W"); words for messages.
      memory: change in the stage's live activations when it runs (F keeps
        them, B and W free them; I keeps them for the W).
      cost: which cost it takes in `simulate`: "forward", "backward",
        "input" (backward_cost - weight_cost) or "weight" (weight_cost).
      needs: (what, stage offset) pairs on the same micro-batch: `what` is a
        kind, or "grad" for the input gradient of that stage (produced by B
        or I, see `input_gradient_action`). Stages outside 0..K-1 are dropped.
      input_gradient, weight_gradient: whether it produces the stage input's
        gradient, the stage's weight gradients.
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
# The dependency rules in words, for the deadlock message.
RULES = "; ".join(kind.rule for kind in KINDS.values() if kind.rule) + "."


# Which micro-batches replay their stage's forward (`is_recomputed`).
RECOMPUTE_MODES = ("always", "except_last", "never")


def validate_recompute(mode):
    """Returns `mode` if it names a recompute policy, else raises ValueError."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(
            f"Unknown recompute mode {mode!r}. Use one of {list(RECOMPUTE_MODES)}: 'always' "
            f"recomputes every stage in the backward pass, 'except_last' all but the last "
            f"micro-batch (as torchgpipe), 'never' keeps all activations.")
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


class Spelling:
    """How a caller names its settings in error messages: as library
    arguments (`num_stages=3`, the default `ARGUMENTS`) or as the flags of
    `launch.train` (`--stages=3`, with `flags={"num_stages": "stages"}`), so
    that one rule has one message. `unset`: how the caller leaves a setting
    to tfpipe ("leave it unset", "auto").
    """

    def __init__(self, flags=None, unset="leave it unset"):
        self.flags, self.unset = flags, unset

    def __call__(self, setting, *value):
        """`setting`, or `setting` given `value[0]`, in the caller's words."""
        if self.flags is None:
            return f"{setting}={value[0]!r}" if value else setting
        flag = f"--{self.flags.get(setting, setting)}"
        return f"{flag}={value[0]}" if value else flag


ARGUMENTS = Spelling()


def check_counts(num_microbatches, num_devices):
    for name, value in (("num_microbatches", num_microbatches), ("num_devices", num_devices)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")


class Schedule:
    """Base class: a schedule is `actions(M, D)`, one action list per device.
    Subclasses set `name` and implement `actions`; `virtual_stages` (v) is
    the stages per device (K = v * D); `splits_backward`: I and W actions.
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

    def check(self, num_microbatches, num_devices, spell=ARGUMENTS):
        """Raises ValueError if the schedule cannot run this (M, D); the
        message names the settings as `spell` (a `Spelling`) does."""
        check_counts(num_microbatches, num_devices)

    def actions(self, num_microbatches, num_devices):
        """A list of D lists of `Action`s, each in that device's run order."""
        raise NotImplementedError

    def format(self, num_microbatches, num_devices):
        """The table as text, one line per device."""
        table = self.actions(num_microbatches, num_devices)
        return "\n".join(
            f"device {d}: " + " ".join(str(a) for a in row) for d, row in enumerate(table))

    def get_config(self):
        return {}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other):
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self):
        return hash((type(self).__name__, tuple(sorted(self.get_config().items()))))


def merge_split_backward(order):
    """Lowers a run order for an execution that cannot hold W apart from I:
    each I(s, m) becomes B(s, m) in its place, and W(s, m) is dropped (valid
    for any valid order: B has I's dependencies, and nothing waits for a W).

    >>> merge_split_backward([(0, Action("F", 0, 0)), (0, Action("I", 0, 0)),
    ...                       (0, Action("W", 0, 0))])
    [(0, Action(kind='F', stage=0, microbatch=0)), (0, Action(kind='B', stage=0, microbatch=0))]
    """
    out = []
    for d, action in order:
        if action.kind == "I":
            out.append((d, Action("B", action.stage, action.microbatch)))
        elif action.kind != "W":
            out.append((d, action))
    return out
