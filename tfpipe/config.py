"""`PipelineConfig`: the one owner of how a pipelined model runs.

A `PipelinedModel` has exactly one configuration: M, the schedule, the
recompute policy, the execution, the BatchNorm mode and the call-loss mode. Everything that needs
one reads it from the model's config when it traces a step; no layer stores a
copy. Each setting comes from the argument given to the model, else from the
`PipelineStrategy` in scope; a loaded model keeps its saved settings except
those the strategy in scope was given explicitly. An execution nobody gives
is chosen per config (`default_execution`) and saved as unset; so is a
schedule nobody gives (`default_schedule`). What an
execution can do is data (`Execution`, `EXECUTIONS`): the runtime reads its
traits, never its name. Pure Python: `launch/` checks its flags with these
rules before TensorFlow starts.
"""

import dataclasses

from tfpipe import actions
from tfpipe import schedules

FIELDS = ("num_microbatches", "schedule", "recompute", "execution", "batch_norm",
          "call_losses")


@dataclasses.dataclass(frozen=True)
class Execution:
    """What one way of running a step can do (`name`, the `recompute_modes`
    it runs, its `default_recompute`); the runtime reads these traits.

    Attributes:
      stage_functions: each stage is traced once per step as a `tf.function`
        that every action calls (`tfpipe.stage_functions.StageFunction`).
      holds_weight_gradients: a split backward's W can run apart from its I;
        where not, I and W are lowered into one B (`merge_split_backward`).
      holds_ops_in_graph: a split backward is built whole at I and its
        weight-only ops held back to W's place; where not, I and W each
        replay the stage.
      in_loop: the actions run inside one `tf.while_loop`.
    """

    name: str
    recompute_modes: tuple
    default_recompute: str
    stage_functions: bool
    holds_weight_gradients: bool
    holds_ops_in_graph: bool
    in_loop: bool
    description: str


EXECUTIONS = {e.name: e for e in (
    Execution("unrolled", actions.RECOMPUTE_MODES, "except_last", stage_functions=False,
              holds_weight_gradients=True, holds_ops_in_graph=True, in_loop=False,
              description="every action traced; all recompute modes"),
    Execution("stage_functions", actions.RECOMPUTE_MODES, "except_last",
              stage_functions=True, holds_weight_gradients=False, holds_ops_in_graph=False,
              in_loop=False, description="every action called, each stage traced once as "
                                         "a tf.function; all recompute modes"),
    Execution("loop", ("always",), "always", stage_functions=False,
              holds_weight_gradients=True, holds_ops_in_graph=False, in_loop=True,
              description="a tf.while_loop over clock ticks; graph size independent of "
                          "num_microbatches; recompute='always'"),
)}
BATCH_NORM_MODES = ("deferred", "plain")
# "checked": each call loss is measured to be a mean over rows before the
# first step (`tfpipe.assumptions.check_call_losses`), else refused.
# "per_microbatch": GPipe's meaning, taken as given: each micro-batch's call
# losses weighted by its share of the rows.
CALL_LOSS_MODES = ("checked", "per_microbatch")


def execution(name):
    """The `Execution` named `name`; a ValueError naming the choices otherwise."""
    if name not in EXECUTIONS:
        choices = [f"{e.name!r} ({e.description})" for e in EXECUTIONS.values()]
        raise ValueError(
            f"Unknown execution {name!r}. Use {', '.join(choices[:-1])} or {choices[-1]}, or "
            f"leave it unset (None) for tfpipe's choice (tfpipe.config.default_execution).")
    return EXECUTIONS[name]


def resolve_recompute(mode, execution_name, spell=actions.ARGUMENTS):
    """The recompute mode to use: `mode`, or the execution's default; raises
    if the execution cannot run `mode` (the loop only runs "always"). `spell`
    names the settings in the error (`actions.Spelling`)."""
    traits = execution(execution_name)
    if mode is None:
        return traits.default_recompute
    mode = actions.validate_recompute(mode)
    if mode not in traits.recompute_modes:
        need = traits.recompute_modes[0]
        raise ValueError(
            f"{spell('execution', traits.name)} keeps only the stage inputs and recomputes "
            f"every stage in the backward pass, so it needs {spell('recompute', need)} "
            f"(or {spell.unset}); got {spell('recompute', mode)}. Use "
            f"{spell('execution', 'unrolled')} for {mode!r}.")
    return mode


def validate_batch_norm(batch_norm):
    """Returns `batch_norm` if it names a mode, else raises ValueError."""
    if batch_norm not in BATCH_NORM_MODES:
        raise ValueError(
            f"Unknown batch_norm {batch_norm!r}. Use 'deferred' (moving statistics updated once "
            f"per mini-batch with its statistics, as full-batch training) or 'plain' (keep "
            f"BatchNormalization as it is: M updates per step).")
    return batch_norm


def validate_call_losses(call_losses):
    """Returns `call_losses` if it names a mode, else raises ValueError."""
    if call_losses not in CALL_LOSS_MODES:
        raise ValueError(
            f"Unknown call_losses {call_losses!r}. Use 'checked' (the default: a loss added in "
            f"a layer's call must be a mean over rows, measured on the first batch, so the "
            f"micro-batches' losses add up to the whole batch's) or 'per_microbatch' (GPipe's "
            f"meaning, unchecked: each micro-batch's call losses weighted by its rows).")
    return call_losses


def validate_num_microbatches(num_microbatches):
    if (isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int)
            or num_microbatches < 1):
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}.")
    return num_microbatches


# From this many micro-batches on, an unset execution is "stage_functions".
STAGE_FUNCTIONS_FROM_MICROBATCHES = 8


def default_schedule(num_microbatches, execution=None):
    """The schedule of a config that was given none, for the `execution` given
    (None: tfpipe's choice): "zbh1" from 2 micro-batches to fewer than
    `STAGE_FUNCTIONS_FROM_MICROBATCHES` where the execution is unrolled, else
    "gpipe".

    Measured (BUILD.md, "The planner against measured steps"): ZB-H1 ran the
    fastest step of GPipe, 1F1B and ZB-H1 on the transformer and the MLP at
    M = 4 and 8, 8-9% under GPipe at M = 4, with fewer live activations; it
    holds each W apart only in the unrolled form, whose first call passes
    1.5x plain Keras' from M = 8, where GPipe with stage functions is chosen.
    A loss that needs every forward before the first backward makes the model
    fall back to GPipe (`PipelineConfig.fall_back_to_gpipe`).
    """
    if execution in (None, "unrolled") and \
            2 <= num_microbatches < STAGE_FUNCTIONS_FROM_MICROBATCHES:
        return "zbh1"
    return "gpipe"


def default_schedule_reason(num_microbatches, schedule_name):
    """Why `default_schedule` chose `schedule_name` at M = `num_microbatches`
    (a phrase for `summary()`)."""
    if schedule_name == "zbh1":
        return "the fastest step measured from M=2 to 7; it holds each W apart when unrolled"
    if num_microbatches < 2:
        return "one micro-batch: no pipeline order to choose"
    return ("GPipe from M=8 and under stage functions or the loop, where ZB-H1 cannot hold "
            "its W halves apart")


def default_execution(num_microbatches, schedule, xla_per_stage=False):
    """The execution of a config that was given none: "unrolled" or "stage_functions".

    `xla_per_stage` (`compile(jit_compile=True)` on several devices): each
    stage compiled as its own XLA program, which only stage functions are.

    The unrolled form has the fastest steps but its trace grows with M; stage
    functions trace each stage once, so from M = `STAGE_FUNCTIONS_FROM_MICROBATCHES`
    on they are chosen (BUILD.md, "Benchmarks": the speed-up tables). A schedule
    that splits the backward (ZB-H1, ZB-V) stays unrolled: only there is each W held apart
    from its I. The loop form (recompute="always", slower steps) is never chosen.
    """
    if xla_per_stage:
        return "stage_functions"
    if schedule.splits_backward or num_microbatches < STAGE_FUNCTIONS_FROM_MICROBATCHES:
        return "unrolled"
    return "stage_functions"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How a pipeline runs: M, a `Schedule`, and the recompute, execution,
    batch_norm and call_losses modes. Build it with `PipelineConfig.make`, which checks.
    `execution_chosen`: tfpipe chose the execution (`default_execution`), so
    `settings` and `to_json` leave it unset; `schedule_chosen` likewise for the
    schedule (`default_schedule`), and `schedule_reason` says why the model
    fell back to GPipe, if it did. `recompute_chosen`: likewise for
    the recompute mode, which is the execution's default until the model
    chooses it from memory before its first training step
    (`tfpipe.recompute_choice`, `choose_recompute`); `recompute_reason` says why.
    """

    num_microbatches: int = 1
    schedule: schedules.Schedule = dataclasses.field(default_factory=schedules.GPipe)
    recompute: str = "except_last"
    execution: str = "unrolled"
    batch_norm: str = "deferred"
    execution_chosen: bool = False
    call_losses: str = "checked"
    recompute_chosen: bool = False
    recompute_reason: str = ""
    schedule_chosen: bool = False
    schedule_reason: str = ""

    @classmethod
    def make(cls, num_microbatches=None, schedule=None, recompute=None, execution=None,
             batch_norm=None, call_losses=None):
        """A checked config; None takes the default (the execution's is
        `default_execution`, recompute's depends on the execution)."""
        num_microbatches = validate_num_microbatches(
            1 if num_microbatches is None else num_microbatches)
        schedule_chosen = schedule is None
        schedule = schedules.get(default_schedule(num_microbatches, execution)
                                 if schedule_chosen else schedule)
        chosen = execution is None
        if chosen:
            execution = default_execution(num_microbatches, schedule)
        resolved = resolve_recompute(recompute, execution)  # checks the execution too
        # The loop runs one mode: nothing to choose.
        recompute_chosen = recompute is None and len(EXECUTIONS[execution].recompute_modes) > 1
        return cls(
            num_microbatches=num_microbatches,
            schedule=schedule,
            recompute=resolved,
            execution=execution,
            batch_norm=validate_batch_norm("deferred" if batch_norm is None else batch_norm),
            execution_chosen=chosen,
            call_losses=validate_call_losses("checked" if call_losses is None else call_losses),
            recompute_chosen=recompute_chosen,
            schedule_chosen=schedule_chosen,
        )

    @property
    def recompute_pending(self):
        """tfpipe is to choose the recompute mode and has not yet."""
        return self.recompute_chosen and not self.recompute_reason

    def choose_recompute(self, mode, reason):
        """This config running `mode`, chosen by tfpipe for `reason`."""
        return dataclasses.replace(self, recompute=mode, recompute_reason=reason)

    def choose_execution(self, xla_per_stage=False):
        """This config with the execution tfpipe chooses (`default_execution`)
        if it was given none; else this config. Both executions it chooses
        run every recompute mode, so the recompute setting stays."""
        if not self.execution_chosen:
            return self
        schedule = self.schedule
        if self.schedule_chosen and not self.schedule_reason:
            schedule = schedules.get(default_schedule(
                self.num_microbatches, "stage_functions" if xla_per_stage else None))
        return dataclasses.replace(self, schedule=schedule, execution=default_execution(
            self.num_microbatches, schedule, xla_per_stage))

    def fall_back_to_gpipe(self, reason):
        """This config running GPipe, which tfpipe chose for `reason` in place of
        the schedule it chose; a recompute mode it chose is chosen again."""
        execution = (default_execution(self.num_microbatches, schedules.GPipe())
                     if self.execution_chosen else self.execution)
        recompute = (resolve_recompute(None, execution) if self.recompute_chosen
                     else self.recompute)
        # A reason exists only for a mode tfpipe chose, and that is chosen again.
        return dataclasses.replace(self, schedule=schedules.GPipe(), schedule_reason=reason,
                                   execution=execution, recompute=recompute,
                                   recompute_reason="")

    @property
    def traits(self):
        """The `Execution` this config runs (its traits, read by the runtime)."""
        return EXECUTIONS[self.execution]

    def settings(self):
        """The settings as given, a dict of plain values (the schedule as an
        instance); the schedule and execution are None where tfpipe chose them,
        so that making a config from them chooses again (at the M then in force)."""
        out = {name: getattr(self, name) for name in FIELDS}
        if self.schedule_chosen:
            out["schedule"] = None
        if self.execution_chosen:
            out["execution"] = None
        if self.recompute_chosen:
            out["recompute"] = None
        return out

    def to_json(self):
        """The settings as JSON-friendly values (the schedule by its spec)."""
        out = self.settings()
        if out["schedule"] is not None:
            out["schedule"] = schedules.to_config(self.schedule)
        return out

    @classmethod
    def from_json(cls, config):
        config = dict(config)
        if config.get("schedule") is not None:
            config["schedule"] = schedules.from_config(config["schedule"])
        return cls.make(**config)


def merge(*layers):
    """A `PipelineConfig` from dicts of settings, later ones winning; None
    values are skipped. A later layer that sets `execution` without
    `recompute` drops an earlier `recompute` (each execution has its own
    default)."""
    merged = {}
    for layer in layers:
        given = {k: v for k, v in (layer or {}).items() if v is not None}
        if "execution" in given and "recompute" not in given:
            merged.pop("recompute", None)
        merged.update(given)
    return PipelineConfig.make(**merged)
