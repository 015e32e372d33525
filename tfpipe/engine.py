"""Runs a pipeline schedule inside a `tf.function`: forward, backward, gradients.

Data flow for one training step with K stages and M micro-batches:

    micro-batch m --stage 0 (device 0)--> h1[m] --stage 1 (device 1)--> ... y_pred[m]
    loss[m] = loss_fn(m, y_pred[m])                       (on the last device)
    every action in the schedule's order, stage k under its device:
        d(inputs of k), d(vars of k) = grad(outputs of k; output_gradients)

Each stage's backward is its own `tape.gradient` under its own `tf.device`
with `output_gradients` from the next stage: one global `tape.gradient` would
place the whole backward pass on the default device. Gradients are summed over
micro-batches on the stage's device and returned for one optimizer update.
"""

import tensorflow as tf

from tfpipe import _internal
from tfpipe import recompute as recompute_lib
from tfpipe import schedules


def _is_float(t):
    return t is not None and t.dtype.is_floating


def _float_leaves(structure):
    return [t for t in tf.nest.flatten(structure) if _is_float(t)]


def _add_gradients(acc, grad):
    if grad is None:
        return acc
    if acc is None:
        return grad
    if isinstance(acc, tf.IndexedSlices) and isinstance(grad, tf.IndexedSlices):
        # Concatenated slices sum on application; no dense [vocab, d] buffer.
        return tf.IndexedSlices(
            tf.concat([acc.values, grad.values], 0),
            tf.concat([acc.indices, grad.indices], 0),
            acc.dense_shape,
        )
    return tf.convert_to_tensor(acc) + tf.convert_to_tensor(grad)


class Pipeline:
    """K stages on D devices, run under a schedule.

    Args:
      stages: list of K built Keras layers; stage k maps the output structure
        of stage k-1 to its own (any nest of tensors, batch on axis 0).
      devices: list of D device names (as `tfpipe.placement.canonical_device`);
        stage k runs on `devices[schedule.stage_device(k, D)]`.
      schedule: a `tfpipe.schedules.Schedule`; K must be
        `schedule.num_stages(D)`.
      recompute: one of `tfpipe.recompute.RECOMPUTE_MODES`.
      enforce_order: add control dependencies so each device runs its actions
        in exactly the schedule's order (as one accelerator stream would).
    """

    def __init__(self, stages, devices, schedule, recompute, enforce_order=True):
        self.stages = list(stages)
        self.devices = list(devices)
        self.schedule = schedules.get(schedule)
        expected = self.schedule.num_stages(len(self.devices))
        if len(self.stages) != expected:
            raise ValueError(
                f"{self.schedule!r} on {len(self.devices)} device(s) runs {expected} "
                f"stage(s), got {len(self.stages)}."
            )
        self.stage_device = [self.schedule.stage_device(k, len(self.devices))
                             for k in range(len(self.stages))]
        self.recompute = recompute_lib.validate(recompute)
        self.enforce_order = enforce_order
        # Benchmarks on CPU set this: every op of a device then runs one after
        # another in trace order, as on an accelerator's stream. Without it a
        # logical CPU device runs independent ops of one action (a layer's dW
        # and dx) at once, which a GPU stream would not.
        self.serialize_ops = False
        self._states = [recompute_lib.StageState(s) for s in self.stages]
        # Counts stage calls made while tracing, per stage; tests read it to
        # check that recompute really re-runs stages.
        self.trace_calls = [0] * len(self.stages)

    @property
    def num_stages(self):
        return len(self.stages)

    def run_order(self, num_microbatches):
        """The validated (device, action) order the step is traced in."""
        return schedules.validate(self.schedule, num_microbatches, len(self.devices))

    # -- helpers ---------------------------------------------------------

    def _call(self, k, inputs, training):
        self.trace_calls[k] += 1
        out = self.stages[k](inputs, training=training)
        extra = [tf.cast(l, tf.float32) for l in self.stages[k].losses]
        return out, (tf.add_n(extra) if extra else None)

    def _after_previous(self, last, d, structure):
        """`structure`, made to wait for device d's previous action."""
        if not self.enforce_order or last[d] is None:
            return structure
        with tf.control_dependencies([last[d]]):
            return tf.nest.map_structure(
                lambda t: None if t is None else tf.identity(t), structure
            )

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
            return tf.nest.map_structure(
                lambda t: None if t is None else tf.identity(t), structure)

    # -- forward only (evaluate / predict) ---------------------------------

    def forward(self, inputs, training=False):
        """Runs the schedule's forward actions, in its order, without gradients.

        Args:
          inputs: list of M input structures (micro-batches).
        Returns:
          (outputs, extra_losses): M output structures of the last stage, and
          the M * K stage losses (`layer.losses`, may be None) as a flat list.
        """
        m_count, k_count = len(inputs), self.num_stages
        acts = {(0, m): inputs[m] for m in range(m_count)}
        last = [None] * len(self.devices)
        extras = []
        for d, action in self.run_order(m_count):
            if action.kind != "F":
                continue
            k, m = action.stage, action.microbatch
            with tf.device(self.devices[d]):
                h = self._after_previous(last, d, acts.pop((k, m)))
                out, extra = self._call(k, h, training)
                extras.append(extra)
                acts[(k + 1, m)] = out
                leaves = _float_leaves(out)
                last[d] = leaves[0] if leaves else last[d]
        return [acts[(k_count, m)] for m in range(m_count)], extras

    # -- training ------------------------------------------------------

    def train(self, inputs, loss_fn, loss_coefficient, scale_loss=None, timeline=None):
        """Forward and backward over all micro-batches; gradients summed.

        Args:
          inputs: list of M input structures (micro-batches).
          loss_fn: `loss_fn(m, y_pred_m)` -> scalar float32 data loss of
            micro-batch m; called once, under the last stage's device.
          loss_coefficient: scalar; the step loss is
            `sum_m coeff * loss_fn(m) + sum_{m,k} stage_losses[m,k] / M`.
          scale_loss: optional `f(loss) -> loss` applied to what is
            differentiated (Keras `optimizer.scale_loss`, for loss scaling).
          timeline: optional list; if given, one dict per action is appended:
            device, kind, stage, microbatch (ints/str) and start, end (float64
            scalar tensors from `tf.timestamp()`, seconds).
        Returns:
          (outputs, loss, grads): M last-stage outputs, the step loss
          (unscaled), and a list of K lists of gradients aligned with
          `stages[k].trainable_variables` (None where unconnected).
        """
        scale_loss = scale_loss or (lambda v: v)
        m_count, k_count = len(inputs), self.num_stages
        inv_m = 1.0 / m_count
        acts = {(0, m): inputs[m] for m in range(m_count)}
        saved = {}
        out_grads = {}
        outputs = [None] * m_count
        loss_terms = []
        last = [None] * len(self.devices)
        grads = [[None] * len(s.trainable_variables) for s in self.stages]

        graph = tf.compat.v1.get_default_graph()
        last_op = [None] * len(self.devices)
        for d, action in self.run_order(m_count):
            k, m = action.stage, action.microbatch
            first_op = len(graph.get_operations()) if self.serialize_ops else None
            with tf.device(self.devices[d]):
                if action.kind == "F":
                    h = self._after_previous(last, d, acts.pop((k, m)))
                    start = self._stamp(timeline, _float_leaves(h) + [last[d]])
                    h = self._after_stamp(start, h)
                    if recompute_lib.should_recompute(self.recompute, m, m_count):
                        seeds = self._states[k].snapshot_seeds()
                        out, extra = self._call(k, h, True)
                        saved[(k, m)] = ("replay", h, seeds)
                    else:
                        with tf.GradientTape() as tape:
                            tape.watch(_float_leaves(h))
                            out, extra = self._call(k, h, True)
                            extra_target = None if extra is None else scale_loss(extra * inv_m)
                        saved[(k, m)] = ("tape", h, tape, out, extra_target)
                    if extra is not None:
                        loss_terms.append(extra * inv_m)
                    leaves = _float_leaves(out)
                    last[d] = leaves[0] if leaves else last[d]
                    if k < k_count - 1:
                        acts[(k + 1, m)] = out
                    else:
                        outputs[m] = out
                        with tf.GradientTape() as loss_tape:
                            loss_tape.watch(leaves)
                            data_loss = loss_coefficient * tf.cast(loss_fn(m, out), tf.float32)
                            target = scale_loss(data_loss)
                        loss_terms.append(data_loss)
                        out_grads[(k, m)] = loss_tape.gradient(
                            target, leaves, unconnected_gradients=tf.UnconnectedGradients.ZERO
                        )
                        last[d] = out_grads[(k, m)][0] if leaves else last[d]
                    end_deps = leaves + ([] if extra is None else [extra])
                    if k == k_count - 1:
                        end_deps = end_deps + list(out_grads[(k, m)])
                else:
                    g_out = self._after_previous(last, d, out_grads.pop((k, m)))
                    start = self._stamp(timeline, list(g_out) + [last[d]])
                    g_out = self._after_stamp(start, g_out)
                    done = self._backward(k, m, saved.pop((k, m)), g_out, grads, out_grads,
                                          scale_loss, inv_m)
                    last[d] = done if done is not None else last[d]
                    end_deps = [done]
                if timeline is not None:
                    end = self._stamp(timeline, end_deps)
                    last[d] = end  # the device's next action starts after this stamp
                    timeline.append(dict(device=d, kind=action.kind, stage=k, microbatch=m,
                                         start=start, end=end))
            if self.serialize_ops:
                last_op[d] = _internal.chain_ops(graph.get_operations()[first_op:], last_op[d])
        return outputs, tf.add_n(loss_terms), grads

    def _backward(self, k, m, record, g_out, grads, out_grads, scale_loss, inv_m):
        """Stage k's backward for micro-batch m; returns a tensor it produced."""
        stage_vars = self.stages[k].trainable_variables
        if record[0] == "replay":
            _, h, seeds = record
            h, tape, out, extra_target = self._replay(k, h, seeds, g_out, scale_loss, inv_m)
        else:
            _, h, tape, out, extra_target = record
        sources = _float_leaves(h)
        targets = _float_leaves(out)
        seeds_grad = list(g_out)
        if extra_target is not None:
            targets.append(extra_target)
            seeds_grad.append(tf.ones_like(extra_target))
        all_grads = tape.gradient(
            targets,
            sources + list(stage_vars),
            output_gradients=seeds_grad,
            unconnected_gradients=tf.UnconnectedGradients.NONE,
        )
        input_grads = all_grads[: len(sources)]
        for i, g in enumerate(all_grads[len(sources):]):
            grads[k][i] = _add_gradients(grads[k][i], g)
        if k > 0:
            out_grads[(k - 1, m)] = [
                tf.zeros_like(s) if g is None else tf.convert_to_tensor(g)
                for s, g in zip(sources, input_grads)
            ]
        # The token the device's next action waits for: it exists only once
        # everything this action produced does (input gradients and the summed
        # weight gradients). Ordering on the input gradient alone let TF run
        # the weight-gradient ops late, keeping every micro-batch's tensors
        # alive and undoing the memory recompute saves.
        produced = list(out_grads.get((k - 1, m), [])) + [
            t for g in grads[k] if g is not None
            for t in ((g.values, g.indices) if isinstance(g, tf.IndexedSlices) else (g,))]
        if not produced:
            return None
        with tf.control_dependencies(produced):
            return tf.identity(produced[0])

    def _replay(self, k, h, seeds, g_out, scale_loss, inv_m):
        """Recomputes stage k under a tape, after its output gradient exists."""
        if g_out:
            # A data dependency (not only a control one) keeps grappler from
            # merging the replay with the original forward, which would undo
            # the memory saving, and makes it run at backward time.
            probe = tf.reduce_max(tf.reshape(g_out[0], [-1])[:1])
            as_bool = tf.cast(probe, tf.bool)  # a bool always equals itself:
            zero = tf.where(tf.equal(as_bool, as_bool), 0.0, float("nan"))
            h = tf.nest.map_structure(
                lambda t: t + tf.cast(zero, t.dtype) if _is_float(t) else t, h
            )

        def run():
            with tf.GradientTape() as tape:
                tape.watch(_float_leaves(h))
                out, extra = self._call(k, h, True)
                extra_target = None if extra is None else scale_loss(extra * inv_m)
            return tape, out, extra_target

        tape, out, extra_target = self._states[k].replay(seeds, run)
        return h, tape, out, extra_target
