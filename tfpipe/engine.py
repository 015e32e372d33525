"""A pipeline: K stages on D devices under a schedule, and its executions.

`Pipeline` owns what does not depend on how a step is executed: the stages,
their devices and the trace options. It builds the `tfpipe.step_plan.StepPlan`
its backend runs (the backend, the interpreter and the stages see that plan,
never the `Pipeline`); the config's execution picks the backend:

  "unrolled" (`tfpipe.unrolled`): every action traced in the schedule's order;
  "stage_functions": the same walk, each stage traced once as a `tf.function`
    and called by every action (`tfpipe.stage.StageFunction`);
  "loop" (`tfpipe.loop`): a `tf.while_loop` over clock ticks, traced once.

Gradients are summed per variable over micro-batches and over every stage
that uses the variable (a shared layer, a tied embedding), on the variable's
own device, and returned for one optimizer update. A trainable variable that
no gradient reaches is reported by `PipelinedModel`, never fed a zero.
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
    """`function` (a step Keras made) called in the `call_scope` of
    `config`'s execution, once however often it is wrapped; itself where
    the execution needs no scope."""
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
    """K stages on D devices, run under a schedule.

    Args:
      stages: list of K built Keras layers; stage k maps the output structure
        of stage k-1 to its own (any nest of tensors, batch on axis 0).
      devices: list of D devices: names (as `tfpipe.placement.canonical_device`)
        or `tfpipe.devices.StageDevice`s (a TPU logical core); stage k runs on
        `devices[schedule.stage_device(k, D)]`.
      config: the model's `tfpipe.config.PipelineConfig` (schedule, recompute,
        execution, BatchNorm mode and M are read from it).
      options: `tfpipe.step_plan.TraceOptions` (default: the defaults).
    """

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
        self._states = tuple(recompute_lib.StageState(s) for s in self.stages)
        self.options = options or step_plan.TraceOptions()

    @property
    def num_stages(self):
        return len(self.stages)

    @property
    def num_microbatches(self):
        return self.config.num_microbatches

    @property
    def plan(self):
        """The `StepPlan` every step of this pipeline runs."""
        config = self.config
        return step_plan.StepPlan(
            layers=tuple(self.stages), devices=tuple(self.devices),
            stage_device=tuple(self.stage_device), states=self._states,
            schedule=config.schedule, recompute=config.recompute,
            batch_norm=config.batch_norm, traits=config.traits, options=self.options)

    def variable_table(self):
        """The `tfpipe.step_plan.VariableTable` of the stages as they are now."""
        return step_plan.VariableTable(self.stages)

    @property
    def variables(self):
        """The distinct trainable variables of all stages, in stage order."""
        return self.variable_table().variables

    def stage_of_variables(self):
        """For each of `variables`, the stages that use it (first: its home)."""
        return self.variable_table().users

    def stage_scope(self, k):
        """The placement scope of stage k's device."""
        return self.devices[self.stage_device[k]].scope()

    def forward(self, batch, training=False):
        """Runs the schedule's forward actions, in its order, without gradients.

        Args:
          batch: a `tfpipe.microbatch.Batch`.
          training: the flag the stages are called with.
        Returns:
          (y_pred, call_loss): the last stage's outputs for the whole batch
          (metadata attached) and the stages' call losses, each micro-batch
          weighted by its share of the batch (float32 scalar or None).
        """
        return self.backend.forward(self.plan, batch, training)

    def train(self, batch, split, scale_loss=None, timeline=None):
        """Forward and backward over all micro-batches; gradients summed.

        Args:
          batch: a `tfpipe.microbatch.Batch` (inputs, labels, sample weights).
          split: a `tfpipe.loss.LossSplit` of the model's compiled loss.
          scale_loss: optional `f(loss) -> loss`, linear (Keras'
            `optimizer.scale_loss`, for loss scaling); applied to every seed.
          timeline: optional list; if given, one dict per action is appended:
            device, kind, stage, microbatch (ints/str) and start, end (float64
            scalar tensors from `tf.timestamp()`, seconds).
        Returns:
          A `tfpipe.runtime.StepResult`.
        """
        return self.backend.train(self.plan, batch, split, scale_loss, timeline)
