"""One stage at run time: its forward, its backward halves and its replay.

The interpreter (`tfpipe.runtime`) dispatches each action of the schedule to
a `Stage`, as PyTorch's schedules call `forward_one_chunk` and
`backward_one_chunk`; the stage owns what only it knows: its layer and
device, its input and output boundaries (`tfpipe.boundary`), its replay
state (`tfpipe.recompute`), its BatchNorm recording (`tfpipe.batchnorm`)
and, per micro-batch, a split backward's weight half held back for W.

    forward(m, packed)                  F: outputs, call losses, loss parts,
                                        BatchNorm moments, and what to keep
    backward(m, kept, g_out, kind)      B, or I / W replaying the stage
    backward_input(m, kept, g_out)      I built whole; its weight half held
    backward_weight(m)                  W of such an I: the held half

Each stage's backward is its own `tape.gradient` under its own device (one
global tape would put the whole backward on the default device), seeded from
the loss numerators at the last stage (`tfpipe.loss`), never through
d loss / d y_pred, which Keras' crossentropy on a softmax/sigmoid output
leaves unconnected.

Under execution="stage_functions" a forward calls the stage's one traced
`tf.function` (`StageFunction`); a re-materialised backward calls
`StageBackward` (replay, gradients and the sums of dense weight gradients,
all in one call); a kept forward's backward is TF's gradient of its call.
Calls are made through their concrete functions (`CalledFunction`), so the
step's graph grows with M by about one op per action.
"""

import contextlib
import typing

import tensorflow as tf

from tfpipe import _internal
from tfpipe import batchnorm
from tfpipe import boundary
from tfpipe import schedules

float_leaves = boundary.float_leaves


def sum_or_none(values):
    """float32 sum of the non-None `values`, or None if there are none."""
    values = [tf.cast(v, tf.float32) for v in values if v is not None]
    return tf.add_n(values) if values else None


class StepInputs(typing.NamedTuple):
    """What every stage of one traced step shares.

    Attributes:
      batch: the `tfpipe.microbatch.Batch`.
      split: the compiled loss's `tfpipe.loss.LossSplit`; None for a
        forward-only step.
      training: the flag the stages are called with.
      interfaces: the K `tfpipe.boundary.Interface`s of the step.
      recompute: the recompute mode ("always", "except_last", "never").
      traits: the `tfpipe.config.Execution`.
      observer: optional object with `on_stage_call(k)`, told of every
        stage call made while tracing (tests count replays with it).
      scale: the loss scale (Keras' `optimizer.scale_loss` of 1; float32
        scalar), in a training step.
    """

    batch: object
    split: object
    training: bool
    interfaces: list
    recompute: str
    traits: object
    observer: object
    scale: object


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


class Forward(typing.NamedTuple):
    """What F(k, m) computed: the outputs (packed as the boundary unless the
    last stage), the call losses weighted by the micro-batch's share of the
    batch (or None), the loss parts (last stage of a training step), the
    BatchNorm moments, what its backward needs (`Replay`, `Taped`; None in a
    forward-only step), and the tensors the device's next action waits for."""

    out: object
    extra: object
    parts: list
    moments: list
    kept: object
    produced: list


class Stage:
    """Stage k of one traced step.

    Args:
      k: the stage's index; num_stages: K.
      layer: the Keras layer it runs.
      device: its `tfpipe.devices.StageDevice`.
      state: its `tfpipe.recompute.StageState` (seeds, exact replay).
      variables: [(i, variable, home)]: the step's index of each trainable
        variable the stage uses, and whether the stage is its home (the
        first stage using it: its gradient sum lives there).
      shared: the `StepInputs`.
      recorder: its `tfpipe.batchnorm.Recorder` (active in deferred mode, M > 1).
    """

    def __init__(self, k, num_stages, layer, device, state, variables, shared, recorder):
        self.k, self.num_stages, self.layer, self.device = k, num_stages, layer, device
        self.state, self.shared = state, shared
        self.indices = [i for i, _, _ in variables]
        self.variables = [v for _, v, _ in variables]
        self.homes = [home for _, _, home in variables]
        self.is_last = k == num_stages - 1
        self.recorder = recorder
        self.held = {}  # m -> (weight gradients, their ops) of an I built whole
        self.function = self.backward_function = None
        if shared.traits.stage_functions:
            self.function = StageFunction(self)
            self.backward_function = StageBackward(self)

    # -- forward ---------------------------------------------------------------

    def call(self, inputs, training):
        """The layer on `inputs`: (outputs, its call losses summed or None)."""
        if self.shared.observer is not None:
            self.shared.observer.on_stage_call(self.k)
        out = self.layer(inputs, training=training)
        return out, sum_or_none(_internal.call_losses(self.layer))

    def labels(self, m):
        """(y_true, sample_weight) of micro-batch m where this stage needs
        them (the last stage of a training step), else (None, None)."""
        if self.is_last and self.shared.split is not None:
            _, y_true, sample_weight = self.shared.batch.micro(m)
            return y_true, sample_weight
        return None, None

    def run(self, m, packed, record=False):
        """The forward on micro-batch m's input boundary `packed`:
        (outputs, call losses, loss parts, BatchNorm moments)."""
        real = self.shared.batch.split.real(m)  # 0: a stand-in for an empty micro-batch
        y_true, sample_weight = self.labels(m)
        if self.function is not None:
            return self.function(packed, y_true, sample_weight, real)
        return self.body(packed, y_true, sample_weight, real, record)

    def body(self, packed, y_true, sample_weight, real, record):
        """The forward (see `run`), traced where it is called."""
        interfaces = self.shared.interfaces
        h = boundary.unpack(packed, interfaces[self.k - 1]) if self.k else packed
        recording = self.recorder.forward(real) if record else contextlib.nullcontext([])
        with recording as moments:
            out, extra = self.call(h, self.shared.training)
        parts = []
        if y_true is not None:
            parts = [(s * tf.cast(real, s.dtype),
                      None if d is None else d * tf.cast(real, d.dtype), per_row)
                     for s, d, per_row in self.shared.split.parts(y_true, out, sample_weight)]
        return out, extra, parts, moments

    def pack(self, out):
        """`out` as the output boundary (the last stage's stays as it is)."""
        return out if self.is_last else boundary.pack(out, self.shared.interfaces[self.k])

    def forward(self, m, packed):
        """F(k, m). In a training step it records BatchNorm moments and keeps
        what the backward needs: the input and seeds where the recompute
        policy replays micro-batch m, else the forward's tape."""
        kept, moments = None, []
        if self.shared.split is None:
            out, extra, parts, _ = self.run(m, packed)
        elif schedules.is_recomputed(self.shared.recompute, m,
                                     self.shared.batch.num_microbatches):
            kept = Replay(packed, self.state.snapshot_seeds())
            out, extra, parts, moments = self.run(m, packed, record=True)
        else:
            with tf.GradientTape() as tape:
                tape.watch(float_leaves(packed) if self.k else [])
                out, extra, parts, moments = self.run(m, packed, record=True)
            kept = Taped(packed, tape, self.pack(out), extra, parts)
        packed_out = self.pack(out)
        produced = (float_leaves(packed_out) or [t for t in tf.nest.flatten(packed_out)
                                                 if isinstance(t, tf.Tensor)])
        produced += [s for s, _, _ in parts] + ([] if extra is None else [extra])
        weighted = None if extra is None else extra * self.shared.batch.split.fraction(m)
        return Forward(packed_out, weighted, parts, moments, kept, produced)

    def extra_seed(self, m):
        """`seed()`: the seed of micro-batch m's call losses (its share of
        the batch, loss-scaled), made only where the stage has them."""
        return lambda: self.shared.batch.split.fraction(m) * self.shared.scale

    # -- backward --------------------------------------------------------------

    def backward(self, m, kept, g_out, weight_sum=None, want_inputs=True, want_weights=True):
        """B(k, m), or one half of it (I: `want_weights=False`; W:
        `want_inputs=False`), each replaying the stage if `kept` is a `Replay`.

        Args:
          kept: what F(k, m) kept (`Replay` or `Taped`).
          g_out: the gradients of the output boundary's float leaves (None
            where the loss does not reach one), or, for the last stage, the
            seeds of its loss numerators.
          weight_sum: `weight_sum(i)`, the step's running gradient sum of
            variable i (None: none yet); a B under stage functions adds to
            it inside its call.
        Returns:
          (gradients of the input boundary's float leaves, or [] without
          `want_inputs`; per variable of `self.variables` its gradient, or
          [] without `want_weights`; per variable whether that is already the
          new running sum), None where unconnected.
        """
        if (self.backward_function is not None and isinstance(kept, Replay)
                and want_inputs and want_weights):
            return self.backward_function(kept, g_out, m, weight_sum)
        tape, packed, out, extra, parts = self._taped(m, kept, g_out)
        input_grads, grads = stage_gradients(self, tape, packed, out, extra, parts, g_out,
                                             self.extra_seed(m), want_inputs, want_weights)
        return input_grads, grads, [False] * len(grads)

    def backward_input(self, m, kept, g_out):
        """I(k, m) built whole: one `tape.gradient` for both halves; the ops
        only the weight gradients need are held back until
        `backward_weight(m)` (W's place), so W costs only those ops.
        Returns (input gradients, the held ops)."""
        tape, packed, out, extra, parts = self._taped(m, kept, g_out)
        graph = tf.compat.v1.get_default_graph()
        first_op = len(graph.get_operations())
        input_grads, grads = stage_gradients(self, tape, packed, out, extra, parts, g_out,
                                             self.extra_seed(m))
        if self.k:
            input_grads = [None if g is None else tf.convert_to_tensor(g) for g in input_grads]
        ops = weight_only_ops(graph.get_operations()[first_op:], input_grads)
        self.held[m] = (grads, ops)
        return input_grads, ops

    def backward_weight(self, m):
        """W(k, m) after `backward_input(m)`: (the weight gradients, the ops
        held back for them)."""
        return self.held.pop(m)

    def _taped(self, m, kept, g_out):
        """(tape, packed input, packed output, call losses, loss parts) of
        F(k, m) from what its forward kept: its tape, or a replay with its
        seeds."""
        if isinstance(kept, Taped):
            return kept.tape, kept.packed, kept.out, kept.extra, kept.parts
        # The replay must run at backward time, not as soon as its input
        # exists (its intermediates would then live as long as without
        # recompute). A copy of the stage's ops needs a data dependency on
        # the incoming gradient for it, or grappler merges it with the
        # original forward. (Stage functions replay in `StageBackward`,
        # whose call takes the gradient as an input.)
        packed = after_gradient(kept.packed, g_out)

        def replay():
            with tf.GradientTape() as tape:
                tape.watch(float_leaves(packed) if self.k else [])
                result = self.run(m, packed)
            return tape, result

        tape, (out, extra, parts, _) = self.state.replay(kept.seeds, replay)
        return tape, packed, self.pack(out), extra, parts


def stage_gradients(stage, tape, packed, out, extra, parts, g_out, extra_seed,
                    want_inputs=True, want_weights=True):
    """Stage k's backward from its taped forward (see `Stage.backward`);
    `out` is the packed output boundary, `extra_seed()` the seed of the
    stage's call losses."""
    sources = float_leaves(packed) if stage.k else []
    if stage.is_last:
        targets, seeds = [s for s, _, _ in parts], list(g_out)
    else:
        pairs = [(t, g) for t, g in zip(float_leaves(out), g_out) if g is not None]
        targets, seeds = [t for t, _ in pairs], [g for _, g in pairs]
    if extra is not None:
        targets.append(extra)
        seeds.append(tf.cast(extra_seed(), extra.dtype))
    wanted = (sources if want_inputs else []) + (stage.variables if want_weights else [])
    if targets and wanted:
        grads = tape.gradient(targets, wanted, output_gradients=seeds,
                              unconnected_gradients=tf.UnconnectedGradients.NONE)
    else:
        grads = [None] * len(wanted)
    n = len(sources) if want_inputs else 0
    return grads[:n], grads[n:]


# -- stage functions -------------------------------------------------------------


def call_scope(traits):
    """Context to trace and call a step of the execution `traits` in (Keras'
    train, test and predict functions; benchmarks that call a step themselves).

    Under stage functions, grappler's function optimizer is off for the
    step: it would specialise a stage function to each action that calls it
    and optimise every copy again at the first call (MobileNetV2 in 4 stages
    at M=8: a first fit 2x longer). Nothing inside a stage is inlined
    either way; the other graph optimisations still run.
    """
    if traits.stage_functions:
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
    """A stage's forward traced once per step trace as a `tf.function`, and
    called once per micro-batch (and per replay): the step's graph holds one
    call op per action instead of a copy of the stage, so the stage's Python
    runs once whatever M (TF builds the function's gradient once, too).

    What crosses the call is tensors only: the output boundary with its Keras
    masks and logits packed (`tfpipe.boundary`), attached again outside; the
    loss parts' numerators and divisors; the BatchNorm moments, whose layers
    are remembered from the trace.
    """

    def __init__(self, stage):
        self.stage = stage
        self.record = bool(stage.shared.split is not None and stage.recorder.layers)
        self.traced = {}  # per trace: the BatchNorm layers, and per_row of each part
        self.function = CalledFunction(self._traced_body)

    def _traced_body(self, packed, y_true, sample_weight, real):
        stage = self.stage
        # A function body does not inherit the caller's device scope: name
        # the stage's device on its ops (its gradient's ops take the device
        # of the op that calls them, the backward action's).
        with stage.device.scope():
            out, extra, parts, moments = stage.body(packed, y_true, sample_weight, real,
                                                    self.record)
        self.traced.update(layers=[c.layer for c in moments], per_row=[p[2] for p in parts])
        return (boundary.pack(out, stage.shared.interfaces[stage.k]), extra,
                [p[:2] for p in parts], [(c.count, c.mean, c.variance) for c in moments])

    def __call__(self, packed, y_true, sample_weight, real):
        packed_out, extra, parts, moments = self.function(packed, y_true, sample_weight, real)
        out = boundary.unpack(packed_out, self.stage.shared.interfaces[self.stage.k])
        parts = [(s, d, per_row) for (s, d), per_row in zip(parts, self.traced["per_row"])]
        moments = [batchnorm.Moments(layer, *values)
                   for layer, values in zip(self.traced["layers"], moments)]
        return out, extra, parts, moments


class StageBackward:
    """A stage's replay and whole backward, traced once per step trace as a
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

    def __init__(self, stage):
        self.stage = stage
        self.sparse = set()  # positions in stage.variables with IndexedSlices gradients
        self.traced_once = False
        self.zeros = {}  # dtype -> the zero a first weight gradient is added to
        self.function = CalledFunction(self._traced_body)

    def _traced_body(self, packed, seeds, y_true, sample_weight, real, g_out, extra_seed,
                     sums):
        stage = self.stage

        def replay():
            with tf.GradientTape() as tape:
                tape.watch(float_leaves(packed) if stage.k else [])
                out, extra, parts, _ = stage.body(packed, y_true, sample_weight, real, False)
            return tape, out, extra, parts

        with stage.device.scope():
            tape, out, extra, parts = stage.state.replay(seeds, replay)
            input_grads, grads = stage_gradients(stage, tape, packed, stage.pack(out), extra,
                                                 parts, g_out, lambda: extra_seed)
            self.sparse |= {j for j, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)}
            grads = [g if s is None or isinstance(g, tf.IndexedSlices) else
                     s if g is None else _sum_like(s, g) for s, g in zip(sums, grads)]
        return input_grads, grads

    def __call__(self, kept, g_out, m, weight_sum):
        """(input gradients, per weight its gradient or new sum, per weight
        whether it is a sum); `weight_sum(i)`: the sum so far of the step's
        variable i, or None."""
        stage = self.stage
        sums = []
        for j, i in enumerate(stage.indices):
            if not stage.homes[j] or j in self.sparse:
                sums.append(None)
                continue
            total = weight_sum(i)
            if total is None:
                dtype = stage.variables[j].dtype
                if dtype not in self.zeros:
                    self.zeros[dtype] = tf.zeros((), dtype)
                total = self.zeros[dtype]
            sums.append(total)
        y_true, sample_weight = stage.labels(m)
        extra_seed = (stage.extra_seed(m)() if stage.shared.interfaces[stage.k].call_losses
                      else None)
        args = (kept.packed, kept.seeds, y_true, sample_weight,
                stage.shared.batch.split.real(m), list(g_out), extra_seed)
        if not self.traced_once:
            # Traced for sums of any shape: the zeros now, the sums later.
            self.function.trace(
                *args, [None if s is None else tf.TensorSpec(None, s.dtype) for s in sums])
            self.traced_once = True
        input_grads, grads = self.function(*args, sums)
        summed = [s is not None and j not in self.sparse and g is not None
                  for j, (s, g) in enumerate(zip(sums, grads))]
        return input_grads, grads, summed


def _sum_like(total, grad):
    """total + grad, with grad's static shape (`total` may be a scalar zero)."""
    out = total + grad
    out.set_shape(grad.shape)
    return out


# -- replays and held weight halves ----------------------------------------------


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


_CONTROL_FLOW = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "Case",
                           "StatelessCase"})


def weight_only_ops(new_ops, input_gradients):
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
    needed, frontier = set(), [getattr(t, "op", None) for t in input_gradients] + [
        op for op in new_ops if _is_stateful(op)]
    while frontier:
        op = frontier.pop()
        if op is None or id(op) in needed or id(op) not in created:
            continue
        needed.add(id(op))
        frontier += [t.op for t in op.inputs] + list(op.control_inputs)
    return [op for op in new_ops if id(op) not in needed]


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
