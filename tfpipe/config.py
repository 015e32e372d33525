"""`PipelineConfig`: the one owner of how a pipelined model runs.

A `PipelinedModel` has exactly one configuration: the number of
micro-batches M, the schedule, the recompute policy, the execution form and
the BatchNorm mode. Everything that needs one of them (the engine, deferred
BatchNorm, the batch-size checks, the summary) reads it from the model's
config when it traces a step; no layer stores a copy. The config is saved
with the model (`get_config`) and restored on load.

Where each setting comes from, in order: the argument given to
`PipelinedModel(...)`/`from_model(...)`; else the `PipelineStrategy` in scope.
When a saved model is loaded, its saved settings are used, except those the
`PipelineStrategy` in scope was given explicitly (e.g.
`PipelineStrategy(num_microbatches=4)`), which win: M, the schedule and the
recompute policy change speed and memory, never the trained weights (with
BatchNorm, M sets the micro-batch the normalisation sees).
"""

import dataclasses

from tfpipe import batchnorm
from tfpipe import recompute as recompute_lib
from tfpipe import schedules

FIELDS = ("num_microbatches", "schedule", "recompute", "execution", "batch_norm")


def validate_num_microbatches(num_microbatches):
    if (isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int)
            or num_microbatches < 1):
        raise ValueError(
            f"num_microbatches must be a positive integer, got {num_microbatches!r}."
        )
    return num_microbatches


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How a pipeline runs. Build it with `PipelineConfig.make`, which checks.

    Attributes:
      num_microbatches: M, micro-batches per mini-batch.
      schedule: a `tfpipe.schedules.Schedule`.
      recompute: "always", "except_last" or "never".
      execution: "unrolled", "stage_functions" or "loop".
      batch_norm: "deferred" or "plain" (`tfpipe.batchnorm`).
    """

    num_microbatches: int = 1
    schedule: schedules.Schedule = dataclasses.field(default_factory=schedules.GPipe)
    recompute: str = "except_last"
    execution: str = "unrolled"
    batch_norm: str = "deferred"

    @classmethod
    def make(cls, num_microbatches=None, schedule=None, recompute=None, execution=None,
             batch_norm=None):
        """A checked config; None takes the default (recompute's depends on execution)."""
        execution = "unrolled" if execution is None else execution
        return cls(
            num_microbatches=validate_num_microbatches(
                1 if num_microbatches is None else num_microbatches),
            schedule=schedules.get("gpipe" if schedule is None else schedule),
            recompute=recompute_lib.resolve(recompute, execution),
            execution=execution,
            batch_norm=batchnorm.validate_mode("deferred" if batch_norm is None else batch_norm),
        )

    def settings(self):
        """The settings as a dict of plain values (the schedule as an instance)."""
        return {name: getattr(self, name) for name in FIELDS}

    def to_json(self):
        """The settings as JSON-friendly values (the schedule by its spec)."""
        out = self.settings()
        out["schedule"] = schedules.to_config(self.schedule)
        return out

    @classmethod
    def from_json(cls, config):
        config = dict(config)
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
