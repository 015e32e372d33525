"""One step of a schedule: the stage runtime and the action interpreter.

A step (training, or forward only for evaluate/predict) is a walk over the
schedule's actions. Each action kind has one handler here, written once for
both executions:

  F(k, m)  stage k's forward on micro-batch m (last stage: and its loss parts)
  B(k, m)  stage k's whole backward: input and weight gradients
  I(k, m)  the input-gradient half of B (on the critical path)
  W(k, m)  the weight-gradient half of B (can wait to fill a bubble)

The handlers read and write a *store*, keyed by (what, stage, micro-batch);
the two backends differ only in their store and in how they walk the table:

  `tfpipe.unrolled`: a Python dict, every action traced in the schedule's
    order with ordering tokens (one graph node per action);
  `tfpipe.loop`: TensorArrays carried through a `tf.while_loop` over clock
    ticks, each device a `tf.switch_case` over its actions (one traced body).

Under execution="stage_functions" the unrolled backend walks the same actions,
but a forward calls its stage as one `tf.function` per stage and step
(`StageFunction`), traced once and called per micro-batch and per replay, and
a backward is TF's gradient of that call (its backward function, also built
once). The step's graph then grows with M by the actions' bookkeeping only, not
by copies of the stages. What that gives up: a call is one op, so one stream
per device (`serialize_ops`) orders calls, not the ops inside them, and a
split backward cannot hold the weight half back (I computes both halves and W
only adds them up).

Store protocol (m is an int in the unrolled form, a scalar tensor in the loop):
  begin(d, structure) -> structure     gate an action's inputs (ordering, timeline)
  stage_input(k, m)                    stage k's packed input boundary
  put_output(k, m, out)                stage k's output (packed unless last)
  replays(k, m)                        whether F(k, m) is replayed by its backward
  keep(k, m, record) / take_kept(k, m) a `Replay` (input and seeds) or a `Taped`
  put_bn(k, m, calls)                  deferred BatchNorm moments
  add_extra(d, value), add_loss_parts(parts), divisor_sums(), loss_seeds(plan)
  output_gradients(k, m) / put_input_gradients(k, m, grads) -> tensors
  add_weight_gradient(d, k, m, i, g) -> tensors
  splits_in_graph; defer_weights(k, m, grads, ops), has_deferred(k, m),
  take_deferred(k, m)                  a split backward built whole at I
  and, for `Step.finish`: gradients(), numerator_sums(), extra_terms(),
  bn_sites(), merged_outputs().

Each stage's backward is its own `tape.gradient` under its own device (one
global tape would put the whole backward on the default device), seeded from
the loss numerators at the last stage (`tfpipe.loss`), never through
d loss / d y_pred, which Keras' crossentropy on a softmax/sigmoid output
leaves unconnected.
"""

import contextlib
import typing

import tensorflow as tf

from tfpipe import _internal
from tfpipe import batchnorm
from tfpipe import boundary
from tfpipe import devices
from tfpipe import gradients as gradients_lib
from tfpipe import loss as loss_lib

float_leaves = boundary.float_leaves


def sum_or_none(values):
    """float32 sum of the non-None `values`, or None if there are none."""
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


class StageForward:
    """One stage's forward on one micro-batch, with the loss parts when it is
    the last stage of a training step: `run(record)` -> (outputs, call losses
    or None, loss parts, BatchNorm moments).

    `packed` is the stage's input boundary (`tfpipe.boundary`), unpacked here
    so that the Keras masks and logits ride on the tensors the stage sees.
    With `record`, the stage's BatchNorm moments are recorded
    (`tfpipe.batchnorm.Recorder`); otherwise the moments list is empty.
    Under execution="stage_functions" the stage runs as the step's one traced
    function for it (`StageFunction`).
    """

    def __init__(self, step, k, m, packed):
        self.step, self.k, self.m, self.packed = step, k, m, packed

    def __call__(self, record=False):
        step, k = self.step, self.k
        real = step.batch.split.real(self.m)  # 0: a stand-in for an empty micro-batch
        y_true = sample_weight = None
        if k == step.num_stages - 1 and step.split is not None:
            _, y_true, sample_weight = step.batch.micro(self.m)
        function = step.stage_functions[k] if step.stage_functions else None
        if function is not None:
            return function(self.packed, y_true, sample_weight, real)
        return stage_body(step, k, self.packed, y_true, sample_weight, real, record)


def stage_body(step, k, packed, y_true, sample_weight, real, record):
    """Stage k's forward (see `StageForward`), traced where it is called."""
    h = boundary.unpack(packed, step.interfaces[k - 1]) if k else packed
    recording = (step.recorder.forward(k, real) if record
                 else contextlib.nullcontext([]))
    with recording as calls:
        out, extra = step.pipeline.call_stage(k, h, step.training)
    parts = []
    if y_true is not None:
        parts = [(s * tf.cast(real, s.dtype),
                  None if d is None else d * tf.cast(real, d.dtype), per_row)
                 for s, d, per_row in step.split.parts(y_true, out, sample_weight)]
    return out, extra, parts, calls


def call_scope(execution):
    """Context to trace and call a step of `execution` in (Keras' train,
    test and predict functions; benchmarks that call a step themselves).

    Under stage functions, grappler's function optimizer is off for the
    step: it would specialise a stage function to each action that calls it
    and optimise every copy again at the first call (MobileNetV2 in 4 stages
    at M=8: a first fit 2x longer). Nothing inside a stage is inlined
    either way; the other graph optimisations still run.
    """
    if execution == "stage_functions":
        return _internal.function_optimizer_off()
    return contextlib.nullcontext()


class StageFunction:
    """Stage k's forward traced once per step trace as a `tf.function`, and
    called once per micro-batch (and per replay): the step's graph holds one
    call op per action instead of a copy of the stage, so the stage's Python
    runs once whatever M (TF builds the function's gradient once, too); what
    still grows with M is each action's bookkeeping (slices, ordering,
    gradient sums).

    What crosses the call is tensors only: the output boundary with its Keras
    masks and logits packed (`tfpipe.boundary`), attached again outside; the
    loss parts' numerators and divisors; the BatchNorm moments, whose layers
    are remembered from the trace.
    """

    def __init__(self, step, k):
        self.step, self.k = step, k
        self.record = bool(step.backward_step and step.recorder.layers[k])
        self.traced = {}  # per trace: the BatchNorm layers, and per_row of each part
        # Not inlined into the step, so that TF places and optimises the
        # stage's body once rather than in every call's copy.
        self.function = tf.function(self._traced_body, autograph=False,
                                    reduce_retracing=True,
                                    experimental_attributes={"_noinline": True})

    def _traced_body(self, packed, y_true, sample_weight, real):
        step, k = self.step, self.k
        # A function body does not inherit the caller's device scope: name
        # the stage's device on its ops (its gradient's ops take the device
        # of the op that calls them, the backward action's).
        with devices.scope(step.pipeline.devices[step.pipeline.stage_device[k]]):
            out, extra, parts, calls = stage_body(step, k, packed, y_true, sample_weight,
                                                  real, self.record)
        self.traced.update(layers=[c.layer for c in calls], per_row=[p[2] for p in parts])
        return (boundary.pack(out, step.interfaces[k]), extra, [p[:2] for p in parts],
                [(c.count, c.mean, c.variance) for c in calls])

    def __call__(self, packed, y_true, sample_weight, real):
        packed_out, extra, parts, moments = self.function(packed, y_true, sample_weight, real)
        out = boundary.unpack(packed_out, self.step.interfaces[self.k])
        parts = [(s, d, per_row) for (s, d), per_row in zip(parts, self.traced["per_row"])]
        calls = [batchnorm.Moments(layer, *values)
                 for layer, values in zip(self.traced["layers"], moments)]
        return out, extra, parts, calls


class Step:
    """One traced step of a schedule over a batch, and its action handlers.

    Args:
      pipeline: the `tfpipe.engine.Pipeline` (stages, devices, config).
      batch: a `tfpipe.microbatch.Batch`.
      order: the (device, action) pairs the step will run, in an order the
        backend walks them (for the loss plan: whether every forward of the
        last stage runs before its first backward).
      split: the compiled loss's `tfpipe.loss.LossSplit`; None for a
        forward-only step (evaluate, predict).
      scale_loss: optional linear `f(loss)` (Keras' `optimizer.scale_loss`).
      training: the flag the stages are called with.
      connectivity: trace the backward pass while probing (the loop form
        sizes its gradient arrays from it).
    """

    def __init__(self, pipeline, batch, order, split=None, scale_loss=None, training=True,
                 connectivity=False):
        self.pipeline, self.batch, self.split = pipeline, batch, split
        self.training = training
        self.backward_step = split is not None
        self.num_stages = pipeline.num_stages
        self.num_microbatches = batch.num_microbatches
        self.recorder = batchnorm.Recorder(
            pipeline.stages,
            self.backward_step and pipeline.config.batch_norm == "deferred"
            and self.num_microbatches > 1)
        self.interfaces = pipeline.probe(
            batch, training, split, connectivity=connectivity,
            around_stage=self.recorder.forward if connectivity else None)
        self.variables, self.stage_vars, _ = pipeline.variable_table()
        self.stage_functions = (
            [StageFunction(self, k) for k in range(self.num_stages)]
            if pipeline.config.execution == "stage_functions" else None)
        if not self.backward_step:
            return
        self.plan = loss_lib.Plan(split, batch.split.total_rows, forwards_first(order),
                                  any(i.call_losses for i in self.interfaces),
                                  in_loop=pipeline.config.execution == "loop")
        self.scale = tf.cast((scale_loss or (lambda v: v))(tf.constant(1.0)), tf.float32)
        self.bn_before = self.recorder.before_step()

    # -- handlers ------------------------------------------------------------

    def run(self, store, d, action):
        """Runs `action` on device d; returns what it produced (`Produced`)."""
        kind, k, m = action.kind, action.stage, action.microbatch
        if kind == "F":
            return self.forward(store, d, k, m)
        if kind == "W" and store.has_deferred(k, m):
            return self.weights_from_input_pass(store, d, k, m)
        return self.backward(store, d, k, m, kind)

    def forward(self, store, d, k, m):
        pipeline, is_last = self.pipeline, k == self.num_stages - 1
        packed = store.begin(d, store.stage_input(k, m))
        run = StageForward(self, k, m, packed)
        if not self.backward_step:
            out, extra, parts, _ = run()
        else:
            if store.replays(k, m):
                store.keep(k, m, Replay(packed, pipeline.stage_states[k].snapshot_seeds()))
                out, extra, parts, calls = run(record=True)
            else:
                with tf.GradientTape() as tape:
                    tape.watch(float_leaves(packed) if k else [])
                    out, extra, parts, calls = run(record=True)
                store.keep(k, m, Taped(packed, tape, self.pack(k, out), extra, parts))
            store.put_bn(k, m, calls)
        if extra is not None:
            store.add_extra(d, extra * self.batch.split.fraction(m))
        store.put_output(k, m, out if is_last else self.pack(k, out))
        if parts:
            store.add_loss_parts(parts)
        produced = (float_leaves(out) or [t for t in tf.nest.flatten(out)
                                          if isinstance(t, tf.Tensor)])
        produced += [s for s, _, _ in parts] + ([] if extra is None else [extra])
        return Produced(produced)

    def pack(self, k, out):
        return out if k == self.num_stages - 1 else boundary.pack(out, self.interfaces[k])

    def backward(self, store, d, k, m, kind):
        """B, I or W (replayed) of stage k on micro-batch m.

        Where the store splits backward passes in the graph (the unrolled
        form), I computes both halves and defers the weight half's ops to W;
        otherwise I computes only input gradients and W replays the stage
        and computes only weight gradients.
        """
        split_in_graph = kind == "I" and store.splits_in_graph
        if k == 0 and kind == "I" and not split_in_graph:
            return Produced([])  # stage 0 has no input gradient to compute
        g_out = store.begin(d, self.output_gradients(store, k, m))
        tape, packed, out, extra, parts = self._taped(store, k, m, g_out)
        sources = float_leaves(packed) if k else []
        if k == self.num_stages - 1:
            targets, seeds = [s for s, _, _ in parts], list(g_out)
        else:
            pairs = [(t, g) for t, g in zip(float_leaves(out), g_out) if g is not None]
            targets, seeds = [t for t, _ in pairs], [g for _, g in pairs]
        if extra is not None:
            targets.append(extra)
            seeds.append(tf.cast(self.batch.split.fraction(m) * self.scale, extra.dtype))
        mine = self.stage_vars[k]
        want_inputs = kind in ("B", "I")
        want_weights = kind in ("B", "W") or split_in_graph
        wanted = (sources if want_inputs else []) + (
            [self.variables[i] for i in mine] if want_weights else [])
        graph = tf.compat.v1.get_default_graph()
        first_op = len(graph.get_operations()) if split_in_graph else None
        if targets and wanted:
            grads = tape.gradient(targets, wanted, output_gradients=seeds,
                                  unconnected_gradients=tf.UnconnectedGradients.NONE)
        else:
            grads = [None] * len(wanted)
        produced = []
        if want_inputs:
            input_grads = grads[:len(sources)]
            grads = grads[len(sources):]
            if k > 0:
                produced += store.put_input_gradients(k, m, input_grads)
        if split_in_graph:
            weight_ops = _weight_only_ops(graph.get_operations()[first_op:], produced)
            store.defer_weights(k, m, grads, weight_ops)
            return Produced(produced, exclude_ops=weight_ops)
        if want_weights:
            for i, g in zip(mine, grads):
                if g is not None:
                    produced += store.add_weight_gradient(self.stage_device(k), k, m, i, g)
        return Produced(produced)

    def weights_from_input_pass(self, store, d, k, m):
        """W(k, m) when I(k, m) already built its ops: release and sum them."""
        grads, weight_ops = store.take_deferred(k, m)
        store.begin(d, [], release=weight_ops)
        produced = []
        for i, g in zip(self.stage_vars[k], grads):
            if g is not None:
                produced += store.add_weight_gradient(self.stage_device(k), k, m, i, g)
        return Produced(produced, include_ops=weight_ops)

    def stage_device(self, k):
        return self.pipeline.stage_device[k]

    def output_gradients(self, store, k, m):
        """d loss / d (stage k's output boundary float leaves), or, for the
        last stage, the seeds of its loss numerators (and call losses)."""
        if k < self.num_stages - 1:
            return store.output_gradients(k, m)
        return [s * self.scale for s in store.loss_seeds(self.plan)]

    def _taped(self, store, k, m, g_out):
        """(tape, packed input, packed output, call losses, loss parts) of
        F(k, m): the tape its forward kept, or a replay with its seeds."""
        record = store.take_kept(k, m)
        if isinstance(record, Taped):
            return record.tape, record.packed, record.out, record.extra, record.parts
        pipeline = self.pipeline
        packed, seeds_state = record
        # The replay must run at backward time, not as soon as its input
        # exists (its intermediates would then live as long as without
        # recompute). A copy of the stage's ops also needs a data dependency
        # on the incoming gradient, or grappler merges it with the original
        # forward; a stage function's call op is stateful, never merged, so a
        # control edge is enough (1 op instead of about 15 per replay).
        packed = after_gradient(packed, g_out, by_data=self.stage_functions is None)
        run = StageForward(self, k, m, packed)

        def replay():
            with tf.GradientTape() as tape:
                tape.watch(float_leaves(packed) if k else [])
                result = run()
            return tape, result

        tape, (out, extra, parts, _) = pipeline.stage_states[k].replay(seeds_state, replay)
        return tape, packed, self.pack(k, out), extra, parts

    # -- the end of the step ----------------------------------------------

    def finish(self, store):
        """The `StepResult` of a training step (after every action ran)."""
        pipeline, variables = self.pipeline, self.variables
        grads = store.gradients()
        divisor_sums = store.divisor_sums()
        final_scale = self.plan.final_scale(divisor_sums)
        if final_scale is not None:
            grads = [pipeline.on_home(v, gradients_lib.scale_gradient, g, final_scale)
                     for v, g in zip(variables, grads)]
        reg_total = pipeline.add_regularization(variables, grads, self.scale)
        bn_ops = pipeline.commit_batch_norm(self.recorder, self.bn_before, store.bn_sites(),
                                            self.batch)
        with devices.scope(pipeline.devices[pipeline.stage_device[-1]]):
            data_loss, term_values = self.plan.values(store.numerator_sums(), divisor_sums)
            loss = tf.add_n([data_loss] + [t for t in store.extra_terms() + [reg_total]
                                           if t is not None])
            y_pred = store.merged_outputs()
        if bn_ops:
            with tf.control_dependencies(bn_ops):
                loss = tf.identity(loss)
        return StepResult(y_pred, loss, term_values, grads)

    def finish_forward(self, store):
        """(y_pred, call losses weighted per micro-batch or None) of a
        forward-only step."""
        pipeline = self.pipeline
        with devices.scope(pipeline.devices[pipeline.stage_device[-1]]):
            y_pred = store.merged_outputs()
        call_loss = (sum_or_none(store.extra_terms())
                     if any(i.call_losses for i in self.interfaces) else None)
        return y_pred, call_loss


class Replay(typing.NamedTuple):
    """What a backward replays F(k, m) from: its input boundary and seeds."""

    packed: object
    seeds: list


class Taped(typing.NamedTuple):
    """F(k, m) kept whole: its tape and what it computed."""

    packed: object
    tape: object
    out: object
    extra: object
    parts: list


class Produced:
    """What an action made: its tensors (the device's next action waits for
    all of them), and graph ops the backend must not chain now
    (`exclude_ops`: a split backward's weight half, left for W) or must chain
    now although made earlier (`include_ops`)."""

    def __init__(self, tensors, exclude_ops=(), include_ops=()):
        self.tensors = [t for t in tensors if t is not None]
        self.exclude_ops, self.include_ops = list(exclude_ops), list(include_ops)


def forwards_first(order):
    """Whether every forward of the last stage precedes its first backward."""
    stages = [a.stage for _, a in order]
    if not stages:
        return True
    last = max(stages)
    positions = [i for i, (_, a) in enumerate(order) if a.stage == last]
    first_back = min((i for i in positions if order[i][1].kind != "F"), default=None)
    last_forward = max((i for i in positions if order[i][1].kind == "F"), default=-1)
    return first_back is None or last_forward < first_back


def after_gradient(h, g_out, by_data=True):
    """`h`, made to wait for the incoming gradient `g_out`: by data, or by a
    control edge (`by_data=False`; an identity per tensor of `h`)."""
    anchor = next((g for g in g_out if g is not None), None)
    if anchor is None:
        return h
    if not by_data:
        with tf.control_dependencies([anchor]):
            return tf.nest.map_structure(
                lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, h)
    probe = tf.reduce_max(tf.reshape(anchor, [-1])[:1])
    as_bool = tf.cast(probe, tf.bool)  # a bool always equals itself:
    zero = tf.where(tf.equal(as_bool, as_bool), 0.0, float("nan"))
    return tf.nest.map_structure(
        lambda t: t + tf.cast(zero, t.dtype)
        if isinstance(t, tf.Tensor) and t.dtype.is_floating else t, h)


def _weight_only_ops(new_ops, input_gradients):
    """Of the ops one `tape.gradient` call made, those only weight gradients
    need: every stateless op that is not an ancestor of an input gradient or
    of a stateful op.

    These are the W half of a split backward (each layer's dW from its input
    and its output gradient); the rest (the chain of activation gradients)
    is the I half.
    """
    if any(op.type in _CONTROL_FLOW for op in new_ops):
        # A backward through a loop or branch (an LSTM's while loop) builds
        # ops whose order TF ties together: holding some back made cycles.
        # Such a stage's W then only adds up what I computed.
        return []
    created = {id(op) for op in new_ops}
    # Stateful ops (and what they need) stay at I: tf.function orders
    # stateful ops in creation order, so one held back to W would wait for
    # later actions that wait for it (a cycle; seen with an LSTM's backward).
    needed, frontier = set(), [_op_of(t) for t in input_gradients] + [
        op for op in new_ops if _is_stateful(op)]
    while frontier:
        op = frontier.pop()
        if op is None or id(op) in needed or id(op) not in created:
            continue
        needed.add(id(op))
        frontier += [t.op for t in op.inputs] + list(op.control_inputs)
    return [op for op in new_ops if id(op) not in needed]


def _op_of(t):
    return getattr(t, "op", None)


_CONTROL_FLOW = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "Case",
                           "StatelessCase"})


def _is_stateful(op):
    op_def = getattr(op, "op_def", None)
    return True if op_def is None else op_def.is_stateful


def release(ops, after):
    """Makes the first ops of `ops` (those with no input from `ops`) wait for
    `after` (an op or tensor): the weight half runs where W sits in the
    schedule, not where I built it."""
    if after is None or not ops:
        return
    after = getattr(after, "op", after)
    inside = {id(op) for op in ops}
    for op in ops:
        if not any(id(t.op) in inside for t in op.inputs):
            _internal.chain_ops([op], after)
