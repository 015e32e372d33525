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
but as calls of functions traced once per stage and step, not M copies of
the stage: a forward calls `StageFunction`; a re-materialised backward calls
`StageBackward` (replay, gradients and the sums of dense weight gradients,
all in one call); a kept forward's backward is TF's gradient of its call.
Calls are made through their concrete functions (`CalledFunction`), each
action is ordered by a control edge on its device's last call, and
micro-batches of static size are cut by one split, so the step's graph
grows with M by about one op per action (K=2, gpipe, recompute="always").
What that gives up: a call is one op, so one stream per device
(`serialize_ops`) orders calls, not the ops inside them, and a split
backward cannot hold the weight half back (I computes both halves and W
only adds them up).

Store protocol (m is an int in the unrolled form, a scalar tensor in the loop):
  begin(d, structure) -> structure     gate an action's inputs (ordering, timeline)
  stage_input(k, m)                    stage k's packed input boundary
  put_output(k, m, out)                stage k's output (packed unless last)
  replays(k, m)                        whether F(k, m) is replayed by its backward
  keep(k, m, record) / take_kept(k, m) a `Replay` (input and seeds) or a `Taped`
  put_bn(k, m, calls)                  deferred BatchNorm moments
  add_extra(d, value), add_loss_parts(parts), divisor_sums(), loss_seeds(plan, scale)
  output_gradients(k, m) / put_input_gradients(k, m, grads) -> tensors
  add_weight_gradient(d, k, m, i, g) -> tensors
  weight_sum(i) / set_weight_sum(i, total)   (stage functions: a sum the
                                       call of `StageBackward` adds to)
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
        y_true, sample_weight = step.labels(k, self.m)
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


class CalledFunction:
    """A stage's `tf.function` for execution="stage_functions": not inlined
    (TF places and optimises its body once, not in every call's copy), and
    called through its concrete function wherever a call's argument types
    repeat ones seen before, on its tensors in TF's order: in a profile of
    the step's trace, TF's own lookup and argument binding cost more than
    making the call op, and a step makes several calls per micro-batch."""

    def __init__(self, body):
        self.function = tf.function(body, autograph=False, reduce_retracing=True,
                                    experimental_attributes={"_noinline": True})
        self.concrete = {}  # argument types -> (concrete function, flat tensors in TF's order)

    def trace(self, *args):
        """Traces for `args` (tensors or `tf.TensorSpec`s) unless a trace fits."""
        return self.function.get_concrete_function(*args)

    def __call__(self, *args):
        leaves = tf.nest.flatten(args)
        key = _argument_types(leaves)
        if key is None:
            return self.function(*args)
        tensors = [t for t in leaves if isinstance(t, tf.Tensor)]
        if key not in self.concrete:
            concrete = self.function.get_concrete_function(*args)
            # Our order is checked against TF's binding once per argument types.
            theirs = _internal.concrete_inputs(concrete, args)
            self.concrete[key] = (concrete, len(theirs) == len(tensors) and all(
                a is b for a, b in zip(theirs, tensors)))
        concrete, flat = self.concrete[key]
        return _internal.call_concrete(concrete, tensors) if flat else concrete(*args)


def _argument_types(leaves):
    """What TF traces a call by, from its arguments' leaves, as a hashable
    key: each leaf's shape and dtype, or its Python value; None if a leaf is
    of another kind (TF's own lookup then decides)."""
    key = []
    for leaf in leaves:
        if leaf is None or isinstance(leaf, (bool, int, float, str)):
            key.append((type(leaf), leaf))
        elif isinstance(leaf, tf.Tensor):
            key.append((tuple(leaf.shape.as_list()) if leaf.shape.rank is not None else None,
                        leaf.dtype))
        else:
            return None
    return tuple(key)


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
        self.function = CalledFunction(self._traced_body)

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


def stage_gradients(step, k, tape, packed, out, extra, parts, g_out, extra_seed,
                    want_inputs=True, want_weights=True):
    """Stage k's backward from its taped forward: (gradients of the input
    boundary's float leaves, or [] without `want_inputs`; gradients of
    `step.stage_vars[k]`, or [] without `want_weights`), None where unconnected.

    `out` is the packed output boundary; `g_out` its incoming gradients, or,
    for the last stage, the seeds of its loss parts' numerators; `extra_seed()`
    the seed of the stage's call losses.
    """
    sources = float_leaves(packed) if k else []
    if k == step.num_stages - 1:
        targets, seeds = [s for s, _, _ in parts], list(g_out)
    else:
        pairs = [(t, g) for t, g in zip(float_leaves(out), g_out) if g is not None]
        targets, seeds = [t for t, _ in pairs], [g for _, g in pairs]
    if extra is not None:
        targets.append(extra)
        seeds.append(tf.cast(extra_seed(), extra.dtype))
    wanted = (sources if want_inputs else []) + (
        [step.variables[i] for i in step.stage_vars[k]] if want_weights else [])
    if targets and wanted:
        grads = tape.gradient(targets, wanted, output_gradients=seeds,
                              unconnected_gradients=tf.UnconnectedGradients.NONE)
    else:
        grads = [None] * len(wanted)
    n = len(sources) if want_inputs else 0
    return grads[:n], grads[n:]


class StageBackward:
    """Stage k's replay and whole backward, traced once per step trace as a
    `tf.function` (execution="stage_functions", re-materialised micro-batches):
    one call op per backward action, where a replay through `StageFunction`
    costs a call, its gradient's call, a gate and a sum per weight.

    A call takes the kept input boundary and seeds (`Replay`), the incoming
    gradients (so it runs at backward time without a gate), and `sums`: per
    weight of the stage, the sum of its gradients so far, or None where the
    sum stays outside. It returns the input boundary's gradients and, per
    weight, the new sum where one went in, else the gradient itself.

    A sum goes in only for a dense gradient (an `IndexedSlices` is
    concatenated outside, `tfpipe.gradients`) of a weight whose home is this
    stage (a shared weight's sum lives on its home stage's device). Before
    the first call no sum exists: it gets a scalar zero (0 + g is g
    exactly), and the function is traced once for sums of any shape, so
    the later calls do not trace it again. Which gradients are sparse is
    known from that trace; a sparse one ignores its zero, and its weight
    then passes None (one more trace, for stages with an embedding).
    """

    def __init__(self, step, k):
        self.step, self.k = step, k
        self.sparse = set()  # positions in step.stage_vars[k] with IndexedSlices gradients
        self.traced_once = False
        pipeline = step.pipeline
        self.home = [pipeline.home_stage(step.variables[i]) == k for i in step.stage_vars[k]]
        self.position = {i: j for j, i in enumerate(step.stage_vars[k])}
        self.function = CalledFunction(self._traced_body)

    def sums_inside(self, i):
        """Whether variable i's gradient sum may go into the call."""
        j = self.position[i]
        return self.home[j] and j not in self.sparse

    def _traced_body(self, packed, seeds, y_true, sample_weight, real, g_out, extra_seed,
                     sums):
        step, k = self.step, self.k

        def replay():
            with tf.GradientTape() as tape:
                tape.watch(float_leaves(packed) if k else [])
                out, extra, parts, _ = stage_body(step, k, packed, y_true, sample_weight,
                                                  real, False)
            return tape, out, extra, parts

        with devices.scope(step.pipeline.devices[step.pipeline.stage_device[k]]):
            tape, out, extra, parts = step.pipeline.stage_states[k].replay(seeds, replay)
            input_grads, grads = stage_gradients(step, k, tape, packed, step.pack(k, out),
                                                 extra, parts, g_out, lambda: extra_seed)
            self.sparse |= {j for j, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)}
            grads = [g if s is None or isinstance(g, tf.IndexedSlices) else
                     s if g is None else _sum_like(s, g) for s, g in zip(sums, grads)]
        return input_grads, grads

    def __call__(self, packed, seeds, y_true, sample_weight, real, g_out, extra_seed, sums):
        """(input gradients, per weight its new sum or gradient); `sums`:
        per weight the sum so far, a scalar zero for none yet, or None (kept
        outside)."""
        args = (packed, seeds, y_true, sample_weight, real, g_out, extra_seed)
        if not self.traced_once:
            # Traced for sums of any shape: the zeros now, the sums later.
            self.function.trace(
                *args, [None if s is None else tf.TensorSpec(None, s.dtype) for s in sums])
            self.traced_once = True
        return self.function(*args, sums)


def _sum_like(total, grad):
    """total + grad, with grad's static shape (`total` may be a scalar zero)."""
    out = total + grad
    out.set_shape(grad.shape)
    return out


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
        batch.cut_at_once = pipeline.config.execution == "stage_functions"
        self.interfaces = pipeline.probe(
            batch, training, split, connectivity=connectivity,
            around_stage=self.recorder.forward if connectivity else None)
        self.variables, self.stage_vars, _ = pipeline.variable_table()
        self.stage_functions = self.backward_functions = None
        if pipeline.config.execution == "stage_functions":
            self.stage_functions = [StageFunction(self, k) for k in range(self.num_stages)]
            self.backward_functions = [StageBackward(self, k) for k in range(self.num_stages)]
            self.zeros = {}  # (dtype, stage) -> the zero a first weight gradient is added to
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
        record = store.take_kept(k, m)
        if self.backward_functions is not None and isinstance(record, Replay):
            return self.called_backward(store, k, m, record, g_out, split_in_graph)
        tape, packed, out, extra, parts = self._taped(record, k, m, g_out)
        want_inputs = kind in ("B", "I")
        want_weights = kind in ("B", "W") or split_in_graph
        graph = tf.compat.v1.get_default_graph()
        first_op = len(graph.get_operations()) if split_in_graph else None
        input_grads, grads = stage_gradients(
            self, k, tape, packed, out, extra, parts, g_out,
            lambda: self.batch.split.fraction(m) * self.scale, want_inputs, want_weights)
        produced = []
        if want_inputs and k > 0:
            produced += store.put_input_gradients(k, m, input_grads)
        if split_in_graph:
            weight_ops = _weight_only_ops(graph.get_operations()[first_op:], produced)
            store.defer_weights(k, m, grads, weight_ops)
            return Produced(produced, exclude_ops=weight_ops)
        if want_weights:
            for i, g in zip(self.stage_vars[k], grads):
                if g is not None:
                    produced += store.add_weight_gradient(self.stage_device(k), k, m, i, g)
        return Produced(produced)

    def called_backward(self, store, k, m, record, g_out, split_in_graph):
        """B (or I, both halves) of a replayed stage under stage functions:
        one call of the stage's `StageBackward`, which replays the stage,
        takes its gradients and adds each weight gradient it can to its sum.
        The call waits for the incoming gradient, so the replay runs at
        backward time with no gate."""
        function, mine = self.backward_functions[k], self.stage_vars[k]
        # Sums go in only at B (I's weight half is summed at W) and only
        # where the stage function may add them (`StageBackward.sums_inside`).
        sums = [self.weight_sum(store, k, i) if not split_in_graph and function.sums_inside(i)
                else None for i in mine]
        extra_seed = (self.batch.split.fraction(m) * self.scale
                      if self.interfaces[k].call_losses else None)
        y_true, sample_weight = self.labels(k, m)
        input_grads, grads = function(record.packed, record.seeds, y_true, sample_weight,
                                      self.batch.split.real(m), list(g_out), extra_seed, sums)
        produced = store.put_input_gradients(k, m, input_grads) if k > 0 else []
        if split_in_graph:
            store.defer_weights(k, m, grads, [])
            return Produced(produced)
        for j, (i, g, summed) in enumerate(zip(mine, grads, sums)):
            if g is None:
                continue
            if summed is not None and j not in function.sparse:
                store.set_weight_sum(i, g)
                produced.append(g)
            else:
                produced += store.add_weight_gradient(self.stage_device(k), k, m, i, g)
        return Produced(produced)

    def weight_sum(self, store, k, i):
        """Variable i's gradient sum so far, or, if it has none yet, a scalar
        zero (one per dtype and stage, made on the stage's device)."""
        total = store.weight_sum(i)
        if total is None:
            key = (self.variables[i].dtype, k)
            if key not in self.zeros:
                self.zeros[key] = tf.zeros((), key[0])
            total = self.zeros[key]
        return total

    def labels(self, k, m):
        """(y_true, sample_weight) of micro-batch m where stage k needs them
        (the last stage of a training step), else (None, None)."""
        if k == self.num_stages - 1 and self.split is not None:
            _, y_true, sample_weight = self.batch.micro(m)
            return y_true, sample_weight
        return None, None

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
        return store.loss_seeds(self.plan, self.scale)

    def _taped(self, record, k, m, g_out):
        """(tape, packed input, packed output, call losses, loss parts) of
        F(k, m) from what its forward kept (`record`): its tape, or a replay
        with its seeds."""
        if isinstance(record, Taped):
            return record.tape, record.packed, record.out, record.extra, record.parts
        pipeline = self.pipeline
        packed, seeds_state = record
        # The replay must run at backward time, not as soon as its input
        # exists (its intermediates would then live as long as without
        # recompute). A copy of the stage's ops needs a data dependency on
        # the incoming gradient for it, or grappler merges it with the
        # original forward. (Stage functions replay in `StageBackward`,
        # whose call takes the gradient as an input.)
        packed = after_gradient(packed, g_out)
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


def after_gradient(h, g_out):
    """`h`, made to wait by data for the incoming gradient `g_out`."""
    anchor = next((g for g in g_out if g is not None), None)
    if anchor is None:
        return h
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
