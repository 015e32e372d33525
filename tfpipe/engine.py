"""Runs a pipeline schedule inside a `tf.function`: forward, backward, gradients.

Data flow for one training step with K stages and M micro-batches:

    micro-batch m --stage 0 (device 0)--> b1[m] --stage 1 (device 1)--> ... y_pred[m]
    every action in the schedule's order, stage k under its device:
      F(k, m): stage k's forward on micro-batch m (last stage: and its loss parts)
      B(k, m): d(inputs of k), d(variables used by k) from
               - the next stage's input gradients (k < K - 1), or
               - the loss itself (k = K - 1): the numerators S_jm seeded with
                 weight_j / D_j (`tfpipe.loss`), never through d loss / d y_pred,
                 which Keras' crossentropy on a softmax/sigmoid output leaves
                 unconnected (it reads the hidden logits);
               - the stage's own call losses, seeded with m's share of the batch.

Each stage's backward is its own `tape.gradient` under its own `tf.device`:
one global `tape.gradient` would place the whole backward pass on the default
device. Gradients are summed per variable over micro-batches and over every
stage that uses the variable (a shared layer, a tied embedding), on the
variable's own device, and returned for one optimizer update. Boundaries carry
Keras masks explicitly (`tfpipe.boundary`). A trainable variable that no
gradient reaches is reported by `PipelinedModel`, never fed a zero.
"""

import tensorflow as tf

from tfpipe import _internal
from tfpipe import batchnorm
from tfpipe import boundary
from tfpipe import gradients as gradients_lib
from tfpipe import loss as loss_lib
from tfpipe import recompute as recompute_lib
from tfpipe import schedules


def _is_float(t):
    return isinstance(t, tf.Tensor) and t.dtype.is_floating


float_leaves = boundary.float_leaves


def _sum(values):
    values = [tf.cast(v, tf.float32) for v in values if v is not None]
    return tf.add_n(values) if values else None


class StepResult:
    """What one traced training step produced.

    Attributes:
      y_pred: the last stage's outputs for the whole batch (rows in order,
        Keras masks and logits attached), for metrics.
      loss: the step's loss as Keras reports it (float32 scalar, unscaled).
      term_values: per compiled loss term, its batch value (Keras' per-output
        `<name>_loss` metrics).
      grads: one gradient per `Pipeline.variables` entry (None: unconnected).
    """

    def __init__(self, y_pred, loss, term_values, grads):
        self.y_pred, self.loss, self.term_values, self.grads = y_pred, loss, term_values, grads


class Pipeline:
    """K stages on D devices, run under a schedule.

    Args:
      stages: list of K built Keras layers; stage k maps the output structure
        of stage k-1 to its own (any nest of tensors, batch on axis 0).
      devices: list of D device names (as `tfpipe.placement.canonical_device`);
        stage k runs on `devices[schedule.stage_device(k, D)]`.
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
        self.recompute = recompute_lib.validate(config.recompute)
        self.enforce_order = enforce_order
        # Benchmarks on CPU set this: every op of a device then runs one after
        # another in trace order, as on an accelerator's stream. Without it a
        # logical CPU device runs independent ops of one action (a layer's dW
        # and dx) at once, which a GPU stream would not.
        self.serialize_ops = False
        self.stage_states = [recompute_lib.StageState(s) for s in self.stages]
        # Counts stage calls made while tracing, per stage; tests read it to
        # check that recompute really re-runs stages.
        self.trace_calls = [0] * len(self.stages)

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
        return unique, per_stage, users

    # -- stage calls ---------------------------------------------------------

    def call_stage(self, k, inputs, training):
        """Stage k on `inputs`; returns (outputs, its call losses summed or None)."""
        self.trace_calls[k] += 1
        out = self.stages[k](inputs, training=training)
        return out, _sum(_internal.call_losses(self.stages[k]))

    def _after_previous(self, last, d, structure):
        """`structure`, made to wait for device d's previous action."""
        if not self.enforce_order or last[d] is None:
            return structure
        with tf.control_dependencies([last[d]]):
            return _identity(structure)

    @staticmethod
    def _stamp(timeline, after):
        """A `tf.timestamp()` (seconds) taken once every tensor in `after` exists."""
        if timeline is None:
            return None
        with tf.control_dependencies([t for t in after if t is not None]):
            return tf.timestamp()

    @staticmethod
    def _after_stamp(stamp, structure):
        """`structure`, made to wait for `stamp`: the action's work starts after it.

        Without this the timestamp op could be scheduled late, after the work
        it is meant to precede.
        """
        if stamp is None:
            return structure
        with tf.control_dependencies([stamp]):
            return _identity(structure)

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

    def forwards_first(self, order):
        last = self.num_stages - 1
        positions = [i for i, (_, a) in enumerate(order) if a.stage == last]
        first_b = min((i for i in positions if order[i][1].kind == "B"), default=None)
        last_f = max(i for i in positions if order[i][1].kind == "F")
        return first_b is None or last_f < first_b

    # -- forward only (evaluate / predict) ---------------------------------

    def forward(self, batch, training=False):
        """Runs the schedule's forward actions, in its order, without gradients.

        Args:
          batch: a `tfpipe.microbatch.Batch`.
        Returns:
          (y_pred, call_loss): the last stage's outputs for the whole batch
          (metadata attached) and the stages' call losses, each micro-batch
          weighted by its share of the batch (float32 scalar or None).
        """
        m_count, k_count = batch.num_microbatches, self.num_stages
        interfaces = self.probe(batch, training)
        acts = {}
        last = [None] * len(self.devices)
        outputs, call_terms = [None] * m_count, []
        for d, action in self.run_order(m_count):
            if action.kind != "F":
                continue
            k, m = action.stage, action.microbatch
            with tf.device(self.devices[d]):
                if k == 0:
                    h = self._after_previous(last, d, batch.micro(m)[0])
                else:
                    h = boundary.unpack(self._after_previous(last, d, acts.pop((k, m))),
                                        interfaces[k - 1])
                out, extra = self.call_stage(k, h, training)
                if extra is not None:
                    call_terms.append(extra * batch.split.fraction(m))
                if k < k_count - 1:
                    acts[(k + 1, m)] = boundary.pack(out, interfaces[k])
                else:
                    outputs[m] = out
                leaves = float_leaves(out) or [t for t in tf.nest.flatten(out) if t is not None]
                last[d] = leaves[0] if leaves else last[d]
        with tf.device(self.devices[self.stage_device[-1]]):
            y_pred = batch.split.merge(outputs)
        return y_pred, _sum(call_terms)

    # -- training ------------------------------------------------------

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
          A `StepResult`.
        """
        step = _UnrolledStep(self, batch, split, scale_loss)
        graph = tf.compat.v1.get_default_graph()
        last = [None] * len(self.devices)     # each device's ordering token
        last_op = [None] * len(self.devices)  # each device's last op (serialize_ops)
        for d, action in step.order:
            k, m = action.stage, action.microbatch
            first_op = len(graph.get_operations()) if self.serialize_ops else None
            with tf.device(self.devices[d]):
                run = step.forward if action.kind == "F" else step.backward
                inputs = self._after_previous(last, d, step.inputs(action))
                start = self._stamp(timeline, [t for t in float_leaves(inputs)] + [last[d]])
                token, end_deps = run(k, m, self._after_stamp(start, inputs))
                last[d] = token if token is not None else last[d]
                if timeline is not None:
                    end = self._stamp(timeline, end_deps)
                    last[d] = end  # the device's next action starts after this stamp
                    timeline.append(dict(device=d, kind=action.kind, stage=k, microbatch=m,
                                         start=start, end=end))
            if self.serialize_ops:
                last_op[d] = _internal.chain_ops(graph.get_operations()[first_op:], last_op[d])
        return step.finish()

    def on_home(self, variable, fn, *args):
        with tf.device(variable.value.device):
            return fn(*args)

    def add_regularization(self, variables, grads, scale):
        """Adds each weight regulariser's gradient, once per step; returns
        the summed regularisation loss (None without regularisers)."""
        total = []
        for i, v in enumerate(variables):
            regularizer = getattr(v, "regularizer", None)
            if regularizer is None:
                continue
            with tf.device(v.value.device):
                with tf.GradientTape() as tape:
                    value = tf.cast(regularizer(v), tf.float32)
                    target = value * scale
                grads[i] = gradients_lib.add_gradients(grads[i], tape.gradient(target, v))
                total.append(value)
        return _sum(total)

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
                with tf.device(self.devices[self.stage_device[k]]):
                    ops += batchnorm.commit(before, sites)
        return ops

    @staticmethod
    def after_gradient(h, g_out):
        """`h`, made to depend (by data) on the incoming gradient.

        A data dependency (not only a control one) keeps grappler from merging
        the replay with the original forward, which would undo the memory
        saving, and makes it run at backward time.
        """
        anchor = next((g for g in g_out if g is not None), None)
        if anchor is None:
            return h
        probe = tf.reduce_max(tf.reshape(anchor, [-1])[:1])
        as_bool = tf.cast(probe, tf.bool)  # a bool always equals itself:
        zero = tf.where(tf.equal(as_bool, as_bool), 0.0, float("nan"))
        return tf.nest.map_structure(
            lambda t: t + tf.cast(zero, t.dtype) if _is_float(t) else t, h)


class _UnrolledStep:
    """The state of one traced training step of the unrolled form.

    `inputs(action)` gives what an action consumes (a stage input or the
    gradients of its outputs); `forward(k, m, h)` and `backward(k, m, g_out)`
    run it and return (ordering token, tensors it produced); `finish()`
    returns the `StepResult`.
    """

    def __init__(self, pipeline, batch, split, scale_loss):
        self.pipeline, self.batch, self.split = pipeline, batch, split
        m_count, k_count = batch.num_microbatches, pipeline.num_stages
        self.m_count, self.k_count = m_count, k_count
        self.order = pipeline.run_order(m_count)
        self.interfaces = pipeline.probe(batch, True, split)
        self.plan = loss_lib.Plan(split, batch.split.num_rows,
                                  pipeline.forwards_first(self.order),
                                  any(i.call_losses for i in self.interfaces))
        self.scale = tf.cast((scale_loss or (lambda v: v))(tf.constant(1.0)), tf.float32)
        self.variables, self.stage_vars, _ = pipeline.variable_table()
        self.recorder = batchnorm.Recorder(
            pipeline.stages, pipeline.config.batch_norm == "deferred" and m_count > 1)
        self.bn_before = self.recorder.before_step()
        self.bn_calls = [[None] * m_count for _ in range(k_count)]
        n_terms = len(split.terms)
        self.numerators = [[] for _ in range(n_terms)]
        self.divisors = [[] for _ in range(n_terms)]
        self.seeds = None  # the last stage's numerator seeds, made at its first backward
        self.acts, self.saved, self.out_grads = {}, {}, {}
        self.outputs = [None] * m_count
        self.call_terms = []
        self.grads = [None] * len(self.variables)
        self.unique_rows = set()  # variables whose slices are merged row by row

    def inputs(self, action):
        k, m = action.stage, action.microbatch
        if action.kind == "F":
            return self.batch.micro(m)[0] if k == 0 else self.acts.pop((k, m))
        if k < self.k_count - 1:
            return self.out_grads.pop((k, m))
        if self.seeds is None:
            self.seeds = self.plan.seeds(self._divisor_sums())
        return [s * self.scale for s in self.seeds]

    def _divisor_sums(self):
        return [_sum(ds) if ds and ds[0] is not None else None for ds in self.divisors]

    def forward(self, k, m, packed):
        """F(k, m) on the stage's input boundary `packed` (stage 0: the inputs)."""
        pipeline, is_last = self.pipeline, k == self.k_count - 1
        run = self._forward_fn(k, m, packed)
        with self.recorder.forward(k, self.batch.split.real(m)) as calls:
            if recompute_lib.should_recompute(pipeline.recompute, m, self.m_count):
                seeds_state = pipeline.stage_states[k].snapshot_seeds()
                out, extra, parts = run()
                self.saved[(k, m)] = ("replay", packed, seeds_state)
            else:
                with tf.GradientTape() as tape:
                    tape.watch(float_leaves(packed) if k else [])
                    out, extra, parts = run()
                self.saved[(k, m)] = ("tape", packed, tape, self._pack(k, out), extra, parts)
        self.bn_calls[k][m] = calls
        if extra is not None:
            self.call_terms.append(extra * self.batch.split.fraction(m))
        if is_last:
            self.outputs[m] = out
            for j, (s, divisor, _) in enumerate(parts):
                self.numerators[j].append(s)
                self.divisors[j].append(divisor)
        else:
            self.acts[(k + 1, m)] = self._pack(k, out)
        produced = (float_leaves(out) or [t for t in tf.nest.flatten(out)
                                          if isinstance(t, tf.Tensor)])
        produced += [s for s, _, _ in parts]
        return (produced[0] if produced else None), produced + (
            [] if extra is None else [extra])

    def _pack(self, k, out):
        return out if k == self.k_count - 1 else boundary.pack(out, self.interfaces[k])

    def _forward_fn(self, k, m, packed):
        return StageForward(self.pipeline, k, packed, self.interfaces[k - 1] if k else None,
                        k == self.k_count - 1, self.split, self.batch, m)

    def backward(self, k, m, g_out):
        """B(k, m) given the gradients of the stage's output boundary (last
        stage: the loss terms' seeds)."""
        pipeline, is_last = self.pipeline, k == self.k_count - 1
        record = self.saved.pop((k, m))
        if record[0] == "replay":
            _, packed, seeds_state = record
            # A replay makes new tensors; `StageForward` unpacks the Keras masks
            # and logits back onto them.
            packed = pipeline.after_gradient(packed, g_out)
            run = self._forward_fn(k, m, packed)

            def replay():
                with tf.GradientTape() as tape:
                    tape.watch(float_leaves(packed) if k else [])
                    result = run()
                return tape, result

            tape, (out, extra, parts) = pipeline.stage_states[k].replay(seeds_state, replay)
            out = self._pack(k, out)
        else:
            _, packed, tape, out, extra, parts = record
        sources = float_leaves(packed) if k else []
        if is_last:
            targets, seeds = [s for s, _, _ in parts], list(g_out)
        else:
            pairs = [(t, g) for t, g in zip(float_leaves(out), g_out) if g is not None]
            targets, seeds = [t for t, _ in pairs], [g for _, g in pairs]
        if extra is not None:
            targets.append(extra)
            seeds.append(tf.cast(self.batch.split.fraction(m) * self.scale, extra.dtype))
        mine = self.stage_vars[k]
        stage_variables = [self.variables[i] for i in mine]
        if targets:
            all_grads = tape.gradient(
                targets, sources + stage_variables, output_gradients=seeds,
                unconnected_gradients=tf.UnconnectedGradients.NONE)
        else:
            all_grads = [None] * (len(sources) + len(stage_variables))
        for i, g in zip(mine, all_grads[len(sources):]):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices) and gradients_lib.gathers_unique_rows(g):
                self.unique_rows.add(i)
            self.grads[i] = pipeline.on_home(
                self.variables[i], gradients_lib.add_gradients, self.grads[i], g)
        if k > 0:
            self.out_grads[(k - 1, m)] = [None if g is None else tf.convert_to_tensor(g)
                                          for g in all_grads[: len(sources)]]
        # The token the device's next action waits for: it exists only once
        # everything this action produced does (input gradients and the summed
        # weight gradients). Ordering on the input gradient alone let TF run
        # the weight-gradient ops late, keeping every micro-batch's tensors
        # alive and undoing the memory recompute saves.
        produced = [g for g in self.out_grads.get((k - 1, m), []) if g is not None] + [
            t for i in mine if self.grads[i] is not None
            for t in ((self.grads[i].values, self.grads[i].indices)
                      if isinstance(self.grads[i], tf.IndexedSlices) else (self.grads[i],))]
        if not produced:
            return None, []
        with tf.control_dependencies(produced):
            token = tf.identity(produced[0])
        return token, [token]

    def finish(self):
        pipeline, variables = self.pipeline, self.variables
        grads = [pipeline.on_home(v, gradients_lib.merge_rows, g)
                 if i in self.unique_rows and isinstance(g, tf.IndexedSlices) else g
                 for i, (v, g) in enumerate(zip(variables, self.grads))]
        divisor_sums = self._divisor_sums()
        final_scale = self.plan.final_scale(divisor_sums)
        if final_scale is not None:
            grads = [pipeline.on_home(v, gradients_lib.scale_gradient, g, final_scale)
                     for v, g in zip(variables, grads)]
        reg_total = pipeline.add_regularization(variables, grads, self.scale)
        bn_ops = pipeline.commit_batch_norm(
            self.recorder, self.bn_before,
            [batchnorm.stack_sites(calls) if all(c is not None for c in calls) else []
             for calls in self.bn_calls], self.batch)
        with tf.device(pipeline.devices[pipeline.stage_device[-1]]):
            data_loss, term_values = self.plan.values(
                [_sum(ns) if ns else tf.zeros(()) for ns in self.numerators], divisor_sums)
            loss = tf.add_n([data_loss] + [t for t in (_sum(self.call_terms), reg_total)
                                           if t is not None])
            y_pred = self.batch.split.merge(self.outputs)
        if bn_ops:
            with tf.control_dependencies(bn_ops):
                loss = tf.identity(loss)
        return StepResult(y_pred, loss, term_values, grads)


class StageForward:
    """One stage's forward on one micro-batch, with the loss parts when it is
    the last stage: `run()` -> (outputs, call losses or None, loss parts).

    `packed` is the stage's input boundary (`tfpipe.boundary`), unpacked here
    so that the Keras masks and logits ride on the tensors the stage sees.
    """

    def __init__(self, pipeline, k, packed, interface, is_last, split, batch, m):
        self.pipeline, self.k, self.packed, self.interface = pipeline, k, packed, interface
        self.is_last, self.split, self.batch, self.m = is_last, split, batch, m

    def __call__(self):
        h = self.packed if self.interface is None else boundary.unpack(self.packed,
                                                                       self.interface)
        out, extra = self.pipeline.call_stage(self.k, h, True)
        parts = []
        if self.is_last:
            _, y_true, sample_weight = self.batch.micro(self.m)
            real = self.batch.split.real(self.m)  # 0: a stand-in for an empty micro-batch
            parts = [(s * tf.cast(real, s.dtype), None if d is None else d * tf.cast(real, d.dtype),
                      per_row)
                     for s, d, per_row in self.split.parts(y_true, out, sample_weight)]
        return out, extra, parts


def _identity(structure):
    """tf.identity of every dense tensor of a nest (others pass through)."""
    return tf.nest.map_structure(
        lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, structure)
