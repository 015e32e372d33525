"""A pipeline: K stages on D devices under a schedule, and its executions.

`Pipeline` owns the stages, their devices and the trace options, and builds
the `tfpipe.step_plan.StepPlan` its backend (`BACKENDS`, by execution) runs.
Gradients are summed per variable over micro-batches and stages, on the
variable's own device.
"""

import functools

from tfpipe import devices as devices_lib
from tfpipe import loop
from tfpipe import recompute as recompute_lib
from tfpipe import schedules
from tfpipe import stage as stage_lib
from tfpipe import step_plan
from tfpipe import unrolled

TraceOptions = step_plan.TraceOptions
call_scope = stage_lib.call_scope


def in_call_scope(function, config):
    """`function` (a Keras step) run in `config`'s `call_scope`, wrapped once."""
    if (function is None or not config.traits.stage_functions
            or getattr(function, "tfpipe_call_scope", False)):
        return function

    @functools.wraps(function)
    def call(*args, **kwargs):
        with call_scope(config.traits):
            return function(*args, **kwargs)
    call.tfpipe_call_scope = True
    return call

BACKENDS = {"unrolled": unrolled.UnrolledBackend,
            "stage_functions": unrolled.UnrolledBackend, "loop": loop.LoopBackend}


class Pipeline:
    """K built stage layers (each maps stage k-1's output nest to its own) on D
    `devices` (names or `StageDevice`s; stage k on `schedule.stage_device(k,
    D)`), run as the `PipelineConfig` says, traced with `TraceOptions`."""

    def __init__(self, stages, devices, config, options=None):
        self.stages = list(stages)
        self.devices = [devices_lib.as_stage_device(d) for d in devices]
        self.config = config
        schedule = config.schedule
        expected = schedule.num_stages(len(self.devices))
        if len(self.stages) != expected:
            raise ValueError(
                f"{schedule!r} on {len(self.devices)} device(s) runs {expected} "
                f"stage(s), got {len(self.stages)}."
            )
        # Validates the schedule for this (M, D) now, not at the first step.
        schedules.validate(schedule, config.num_microbatches, len(self.devices))
        self.stage_device = [schedule.stage_device(k, len(self.devices))
                             for k in range(len(self.stages))]
        self.backend = BACKENDS[config.execution]()
        # The static part of every step (`StepPlan`), made once.
        self.plan = step_plan.StepPlan(
            layers=tuple(self.stages), devices=tuple(self.devices),
            stage_device=tuple(self.stage_device),
            states=tuple(recompute_lib.StageState(s) for s in self.stages),
            schedule=schedule, recompute=config.recompute, batch_norm=config.batch_norm,
            traits=config.traits, options=options or step_plan.TraceOptions(),
            call_losses=config.call_losses)

    @property
    def num_stages(self):
        return len(self.stages)

    @property
    def num_microbatches(self):
        return self.config.num_microbatches

    @property
    def variables(self):
        """The distinct trainable variables of all stages, in stage order."""
        return self.plan.variable_table().variables

    def stage_of_variables(self):
        """For each of `variables`, the stages that use it (first: its home)."""
        return self.plan.variable_table().users

    def stage_scope(self, k):
        """The placement scope of stage k's device."""
        return self.plan.stage_scope(k)

    def forward(self, batch, training=False):
        """The forward actions on a `Batch`: (y_pred for the whole batch, the call
        losses weighted by each micro-batch's share: float32 scalar or None)."""
        return self.backend.forward(self.plan, batch, training)

    def train(self, batch, split, scale_loss=None, timeline=None):
        """Forward and backward over all micro-batches: a `runtime.StepResult`.
        `scale_loss`: linear (Keras' `optimizer.scale_loss`); `timeline`: a list
        to append a dict per action to (device, kind, stage, microbatch, and
        start, end: float64 scalar seconds)."""
        return self.backend.train(self.plan, batch, split, scale_loss, timeline)
