"""A pipeline: K stages on D devices under a schedule, and its two executions.

`Pipeline` owns what does not depend on how a step is executed: the stages
and their devices, the variable table (each distinct trainable variable, the
stages that use it: the first is its home), the probe of the stage
boundaries, weight regularisers and the deferred BatchNorm commit. A step is
the action interpreter of `tfpipe.runtime`, walked by one of two backends
chosen by the config's execution:

  "unrolled" (`tfpipe.unrolled`): every action traced in the schedule's order;
  "stage_functions": the same, each stage traced once as a `tf.function` and
    called by every action (`tfpipe.runtime.StageFunction`);
  "loop" (`tfpipe.loop`): a `tf.while_loop` over clock ticks, traced once.

Gradients are summed per variable over micro-batches and over every stage
that uses the variable (a shared layer, a tied embedding), on the variable's
own device, and returned for one optimizer update. A trainable variable that
no gradient reaches is reported by `PipelinedModel`, never fed a zero.
"""

import tensorflow as tf

from tfpipe import _internal
from tfpipe import batchnorm
from tfpipe import boundary
from tfpipe import devices as devices_lib
from tfpipe import gradients as gradients_lib
from tfpipe import loop
from tfpipe import recompute as recompute_lib
from tfpipe import replicas
from tfpipe import runtime
from tfpipe import schedules
from tfpipe import unrolled

BACKENDS = {"unrolled": unrolled.UnrolledBackend,
            "stage_functions": unrolled.UnrolledBackend, "loop": loop.LoopBackend}
StepResult = runtime.StepResult


class Pipeline:
    """K stages on D devices, run under a schedule.

    Args:
      stages: list of K built Keras layers; stage k maps the output structure
        of stage k-1 to its own (any nest of tensors, batch on axis 0).
      devices: list of D devices: names (as `tfpipe.placement.canonical_device`)
        or `tfpipe.devices.StageDevice`s (a TPU logical core); stage k runs on
        `devices[schedule.stage_device(k, D)]`, placed by `tfpipe.devices.scope`.
      config: the model's `tfpipe.config.PipelineConfig` (schedule, recompute,
        BatchNorm mode and M are read from it).
      enforce_order: add control dependencies so each device runs its actions
        in exactly the schedule's order (as one accelerator stream would).
    """

    def __init__(self, stages, devices, config, enforce_order=True):
        self.stages = list(stages)
        self.devices = list(devices)
        self.config = config
        self.schedule = config.schedule
        expected = self.schedule.num_stages(len(self.devices))
        if len(self.stages) != expected:
            raise ValueError(
                f"{self.schedule!r} on {len(self.devices)} device(s) runs {expected} "
                f"stage(s), got {len(self.stages)}."
            )
        self.stage_device = [self.schedule.stage_device(k, len(self.devices))
                             for k in range(len(self.stages))]
        self.recompute = recompute_lib.resolve(config.recompute, config.execution)
        self.backend = BACKENDS[config.execution]()
        self.enforce_order = enforce_order
        # Benchmarks on CPU set this: every op of a device then runs one after
        # another in trace order, as on an accelerator's stream. Without it a
        # logical CPU device runs independent ops of one action (a layer's dW
        # and dx) at once, which a GPU stream would not.
        self.serialize_ops = False
        self.stage_states = [recompute_lib.StageState(s) for s in self.stages]
        # Counts stage calls made while tracing, per stage; tests read it to
        # check that recompute really re-runs stages (and that stage functions
        # trace each stage once).
        self.trace_calls = [0] * len(self.stages)
        self._home_stage = {}  # id(variable) -> its home stage (variable_table)

    @property
    def num_stages(self):
        return len(self.stages)

    @property
    def num_microbatches(self):
        return self.config.num_microbatches

    def run_order(self, num_microbatches):
        """The validated (device, action) order the step is traced in."""
        return schedules.validate(self.schedule, num_microbatches, len(self.devices))

    # -- variables ---------------------------------------------------------

    @property
    def variables(self):
        """The distinct trainable variables of all stages, in stage order."""
        return self.variable_table()[0]

    def stage_of_variables(self):
        """For each of `variables`, the stages that use it (first: its home)."""
        return self.variable_table()[2]

    def variable_table(self):
        """(variables, per_stage, users): the distinct trainable variables in
        stage order; per stage, the indices of those it uses; per variable, the
        stages that use it (the first is its home)."""
        unique, index, users = [], {}, []
        per_stage = []
        for k, stage in enumerate(self.stages):
            mine = []
            for v in stage.trainable_variables:
                if id(v) not in index:
                    index[id(v)] = len(unique)
                    unique.append(v)
                    users.append([])
                i = index[id(v)]
                if i not in mine:
                    mine.append(i)
                    users[i].append(k)
            per_stage.append(mine)
        self._home_stage = {id(v): u[0] for v, u in zip(unique, users)}
        return unique, per_stage, users

    # -- stage calls ---------------------------------------------------------

    def call_stage(self, k, inputs, training):
        """Stage k on `inputs`; returns (outputs, its call losses summed or None)."""
        self.trace_calls[k] += 1
        out = self.stages[k](inputs, training=training)
        return out, runtime.sum_or_none(_internal.call_losses(self.stages[k]))

    # -- planning ------------------------------------------------------------

    def probe(self, batch, training, split=None, connectivity=False, around_stage=None):
        """The stages' `boundary.Interface`s for this batch; with `split` (a
        `tfpipe.loss.LossSplit`) also builds and classifies the loss terms."""
        x0, y0, sw0 = batch.micro(0)

        def on_output(y_pred, extra):
            if split is None:
                return []
            y_true, sample_weight = extra
            with tf.init_scope():
                split.build(y_true, y_pred)
            return split.classify(y_true, y_pred, sample_weight)

        return boundary.probe(self.stages, x0, training, extra=(y0, sw0), on_output=on_output,
                              connectivity=connectivity, around_stage=around_stage)

    # -- steps ---------------------------------------------------------------

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
        return self.backend.forward(self, batch, training)

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
        return self.backend.train(self, batch, split, scale_loss, timeline)

    def home_scope(self, variable):
        """The placement scope of `variable`'s home stage (the first that uses
        it; its storage is there), where its gradient is summed and scaled."""
        k = self.home_stage(variable)
        if k is None:  # not a stage's trainable variable: where it is stored
            return tf.device(variable.value.device)
        return devices_lib.scope(self.devices[self.stage_device[k]])

    def home_stage(self, variable):
        """The first stage that uses `variable` (None: not a stage's trainable
        variable)."""
        return self._home_stage.get(id(variable))

    def on_home(self, variable, fn, *args):
        with self.home_scope(variable):
            return fn(*args)

    def add_regularization(self, variables, grads, scale):
        """Adds each weight regulariser's gradient, once per step; returns
        the summed regularisation loss (None without regularisers). With R
        data-parallel replicas each adds 1/R of it (their gradients are summed)."""
        total = []
        share = 1.0 / replicas.num_replicas()
        scale = scale * share
        for i, v in enumerate(variables):
            regularizer = getattr(v, "regularizer", None)
            if regularizer is None:
                continue
            with self.home_scope(v):
                with tf.GradientTape() as tape:
                    value = tf.cast(regularizer(v), tf.float32)
                    target = value * scale
                grads[i] = gradients_lib.add_gradients(grads[i], tape.gradient(target, v))
                total.append(value * share)
        return runtime.sum_or_none(total)

    def commit_batch_norm(self, recorder, before, sites_per_stage, batch):
        """Deferred BatchNorm: one moving-statistics update per call site.

        With plain BatchNorm a stand-in for an empty micro-batch would update
        the moving statistics; such a batch (fewer rows than M) is refused at
        run time instead.
        """
        ops = []
        if (self.config.batch_norm == "plain" and batch.num_microbatches > 1
                and any(batchnorm.batch_norm_layers(s) for s in self.stages)):
            ops.append(tf.debugging.assert_greater_equal(
                batch.split.num_rows, batch.num_microbatches, message=(
                    f"a batch has fewer rows than num_microbatches="
                    f"{batch.num_microbatches}: with batch_norm='plain' the empty "
                    f"micro-batches would update BatchNormalization's moving statistics. "
                    f"Use batch_norm='deferred', or batches of at least "
                    f"{batch.num_microbatches} rows (drop_remainder=True).")))
        for k, sites in enumerate(sites_per_stage):
            if recorder.layers[k] and sites:
                with devices_lib.scope(self.devices[self.stage_device[k]]):
                    ops += batchnorm.commit(before, sites)
        return ops
