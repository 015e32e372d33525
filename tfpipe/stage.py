"""One stage at run time: its forward, its backward halves and its replay.

The interpreter (`tfpipe.runtime`) dispatches each action to a `Stage`. Each
backward is its own `tape.gradient` under the stage's device (one global tape
would put the whole backward on the default device), seeded at the last stage
by the loss numerators (`tfpipe.loss`): Keras' crossentropy on a
softmax/sigmoid output leaves d loss / d y_pred unconnected. Under
execution="stage_functions" a stage is one traced function that each action
calls (`tfpipe.stage_functions`).
"""

import contextlib
import typing

import tensorflow as tf

from tfpipe import _internal
from tfpipe import actions
from tfpipe import boundary
from tfpipe import xla

float_leaves = boundary.float_leaves


def widest_float(dtypes):
    """float64 if any of `dtypes` is, else float32: what a step adds losses
    and seeds in (a float64 model is then exact to float64's precision)."""
    return tf.float64 if any(tf.as_dtype(d) == tf.float64 for d in dtypes) else tf.float32


def sum_or_none(values):
    """Sum of the non-None `values` (in `widest_float` of theirs), or None."""
    values = [v for v in values if v is not None]
    dtype = widest_float(v.dtype for v in values)
    return tf.add_n([tf.cast(v, dtype) for v in values]) if values else None


class StepInputs(typing.NamedTuple):
    """What every stage of one traced step shares (`split` None: forward only;
    `scale`: the loss scale, `scale_loss(1)`, in `dtype`, the step's
    `widest_float` of its variables, which losses and seeds are added in)."""
    batch: object
    split: object
    training: bool
    interfaces: list
    recompute: str
    traits: object
    observer: object
    scale: object
    stage_xla: bool = False  # stage functions compiled by XLA (`TraceOptions.stage_xla`)
    dtype: object = tf.float32


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
    """What F(k, m) computed; `extra`: its call losses weighted by the
    micro-batch's share; `produced`: what the device's next action waits for."""
    out: object
    extra: object
    parts: list
    moments: list
    kept: object
    produced: list


class Stage:
    """Stage k of K in one traced step; `variables`: [(table index, variable, is home)]."""

    def __init__(self, k, num_stages, layer, device, state, variables, shared, recorder):
        self.k, self.num_stages, self.layer, self.device = k, num_stages, layer, device
        self.state, self.shared = state, shared
        self.indices = [i for i, _, _ in variables]
        self.variables = [v for _, v, _ in variables]
        self.homes = [home for _, _, home in variables]
        self.is_last = k == num_stages - 1
        self.recorder = recorder
        self.held = {}  # m -> (weight gradients, their ops) of an I built whole
        # Under stage functions, its `StageFunction` and `StageBackward`
        # (`tfpipe.stage_functions`, set by the step that made it).
        self.function = self.backward_function = None

    def call(self, inputs, training):
        """The layer on `inputs`: (outputs, its call losses summed or None)."""
        if self.shared.observer is not None:
            self.shared.observer.on_stage_call(self.k, xla.in_xla_program())
        out = self.layer(inputs, training=training)
        return out, sum_or_none(_internal.call_losses(self.layer))

    def labels(self, m):
        """(y_true, sample_weight) of micro-batch m if this stage takes the loss, else Nones."""
        if self.is_last and self.shared.split is not None:
            _, y_true, sample_weight = self.shared.batch.micro(m)
            return y_true, sample_weight
        return None, None

    def run(self, m, packed, record=False):
        """(outputs, call losses, loss parts, moments) of the forward on boundary `packed`."""
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
        """F(k, m); a training step keeps m's input and seeds if replayed, else its tape."""
        kept, moments = None, []
        if self.shared.split is None:
            out, extra, parts, _ = self.run(m, packed)
        elif actions.is_recomputed(self.shared.recompute, m,
                                     self.shared.batch.num_microbatches):
            kept = Replay(packed, self.state.snapshot_seeds())
            out, extra, parts, moments = self.run(m, packed, record=True)
        else:
            tape, (out, extra, parts, moments) = taped_run(
                self.k, packed, lambda: self.run(m, packed, record=True))
            kept = Taped(packed, tape, self.pack(out), extra, parts)
        packed_out = self.pack(out)
        produced = (float_leaves(packed_out) or [t for t in tf.nest.flatten(packed_out)
                                                 if isinstance(t, tf.Tensor)])
        produced += [s for s, _, _ in parts] + ([] if extra is None else [extra])
        weighted = (None if extra is None
                    else extra * self.shared.batch.split.fraction(m, extra.dtype))
        return Forward(packed_out, weighted, parts, moments, kept, produced)

    def extra_seed(self, m):
        """`seed()`: micro-batch m's call-loss seed (its batch share, loss-scaled)."""
        return lambda: self.shared.batch.split.fraction(m, self.shared.dtype) * self.shared.scale

    def backward(self, m, kept, g_out, weight_sum=None, want_inputs=True, want_weights=True):
        """B(k, m), or its I or W half, replaying the stage if `kept` is a
        `Replay`. `g_out`: the output float leaves' gradients, or the last
        stage's loss seeds. Returns (input gradients, weight gradients, per
        weight whether it is already the running sum `weight_sum(i)`)."""
        if (self.backward_function is not None and isinstance(kept, Replay)
                and want_inputs and want_weights):
            return self.backward_function(kept, g_out, m, weight_sum)
        tape, packed, out, extra, parts = self._taped(m, kept, g_out)
        input_grads, grads = stage_gradients(self, tape, packed, out, extra, parts, g_out,
                                             self.extra_seed(m), want_inputs, want_weights)
        return input_grads, grads, [False] * len(grads)

    def backward_input(self, m, kept, g_out):
        """I(k, m) as one `tape.gradient` for both halves; the weight-only ops
        are held for `backward_weight(m)`. Returns (input gradients, held ops)."""
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
        """W(k, m) after `backward_input(m)`: (weight gradients, their held ops)."""
        return self.held.pop(m)

    def _taped(self, m, kept, g_out):
        """(tape, input, output, call losses, loss parts) of F(k, m): kept, or replayed."""
        if isinstance(kept, Taped):
            return kept.tape, kept.packed, kept.out, kept.extra, kept.parts
        # The replay waits by data for the incoming gradient: else it runs as
        # soon as its input exists (its intermediates live as long as without
        # recompute), or grappler merges it with the original forward.
        packed = after_gradient(kept.packed, g_out)
        tape, (out, extra, parts, _) = self.state.replay(
            kept.seeds, lambda: taped_run(self.k, packed, lambda: self.run(m, packed)))
        return tape, packed, self.pack(out), extra, parts


def taped_run(k, packed, fn):
    """(tape, fn()), the float leaves of stage k's input boundary watched."""
    with tf.GradientTape() as tape:
        tape.watch(float_leaves(packed) if k else [])
        result = fn()
    return tape, result


def stage_gradients(stage, tape, packed, out, extra, parts, g_out, extra_seed,
                    want_inputs=True, want_weights=True):
    """Stage k's backward from its taped forward (see `Stage.backward`)."""
    sources = float_leaves(packed) if stage.k else []
    if stage.is_last:
        targets = [s for s, _, _ in parts]
        seeds = [tf.cast(g, t.dtype) for t, g in zip(targets, g_out)]
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


def call_scope(traits):
    """Context to trace and call a step of the execution `traits` in:
    grappler runs one pass (`_internal.grappler_options`), and under stage
    functions without its function optimizer, which would specialise and
    optimise a stage function again for each action calling it."""
    return _internal.grappler_options(function_optimizer=not traits.stage_functions)


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
    """The W half of the ops one `tape.gradient` call made: every stateless
    op that is not an ancestor of an input gradient or of a stateful op."""
    if any(op.type in _CONTROL_FLOW for op in new_ops):
        # TF ties the order of a loop's or branch's backward ops (an LSTM):
        # holding some back made cycles, so W only adds up what I computed.
        return []
    created = {id(op) for op in new_ops}
    # Stateful ops (and what they need) stay at I: tf.function runs them in
    # creation order, so one held back to W would wait on actions waiting on it.
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
    """Makes the first ops of `ops` wait for `after`: a held W half runs at W's place."""
    if after is None or not ops:
        return
    after = getattr(after, "op", after)
    inside = {id(op) for op in ops}
    for op in ops:
        if not any(id(t.op) in inside for t in op.inputs):
            _internal.chain_ops([op], after)
