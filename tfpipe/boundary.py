"""What crosses a stage boundary: tensors, and the Keras metadata riding on them.

Keras keeps two facts on a tensor as hidden Python attributes: a mask
(`Embedding(mask_zero=True)`, `Masking`; read by masked layers and by losses
and metrics) and, on a softmax or sigmoid output, the logits it was computed
from (read by crossentropy losses and metrics). Anything that makes a new
tensor drops them: the `tf.identity` that orders a device's actions, a
TensorArray in the loop step, a concatenation. So tfpipe makes them explicit
where a stage's output leaves it:

    stage k returns  values                       (any nest, batch on axis 0)
    boundary k is    (values, masks, logits)      masks: a tuple with the mask
                                                  of each masked leaf of values;
                                                  logits: likewise

and stage k + 1 attaches them back before its layers run (`unpack`). The
logits are float tensors of the boundary like the values: a softmax output
made in one stage and passed through later ones still reaches the loss as
Keras gives it, logits and their gradient included (`float_leaves` of a
boundary are what a stage's backward takes gradients for).
Which leaves carry what is the same for every micro-batch; `probe` finds it
once per traced step by tracing the stages on the micro-batch's shapes in a
scratch graph (nothing runs).
"""

import contextlib
import dataclasses

import tensorflow as tf

from tfpipe import _internal
from tfpipe import gradients as gradients_lib


@dataclasses.dataclass
class Interface:
    """What stage k returns, as `probe` found it.

    Attributes:
      values: nest of `tf.TypeSpec` of the stage's output (batch dim None).
      masked: flat indices of the output leaves that carry a Keras mask.
      mask_specs: `tf.TensorSpec` of each such mask.
      with_logits: flat indices of leaves carrying softmax/sigmoid logits.
      logit_specs: `tf.TensorSpec` of each.
      call_losses: whether the stage adds losses while it runs.
    """

    values: object
    masked: tuple
    mask_specs: tuple
    with_logits: tuple
    logit_specs: tuple
    call_losses: bool
    inputs_connected: list = None
    variables_connected: list = None
    variables_sparse: list = None
    recorded: object = None

    @property
    def specs(self):
        """Nest of specs of the boundary `(values, masks, logits)`."""
        return (self.values, tuple(self.mask_specs), tuple(self.logit_specs))


def batchless_spec(t):
    """`tf.TypeSpec` of `t` with its batch (axis 0) dimension set to None."""
    if isinstance(t, tf.SparseTensor):
        return tf.SparseTensorSpec([None] + t.shape.as_list()[1:], t.dtype)
    if isinstance(t, tf.RaggedTensor):
        return tf.RaggedTensorSpec([None] + t.shape.as_list()[1:], t.dtype,
                                   t.ragged_rank, t.row_splits.dtype)
    shape = tf.TensorShape(t.shape)
    if shape.rank:
        shape = tf.TensorShape([None]).concatenate(shape[1:])
    return tf.TensorSpec(shape, t.dtype)


def _interface(out, call_losses):
    flat = tf.nest.flatten(out)
    masked, mask_specs, with_logits, logit_specs = [], [], [], []
    for i, t in enumerate(flat):
        mask = _internal.get_keras_mask(t) if t is not None else None
        if mask is not None:
            masked.append(i)
            mask_specs.append(batchless_spec(mask))
        logits = _internal.get_keras_logits(t) if t is not None else None
        if logits is not None:
            with_logits.append(i)
            logit_specs.append(batchless_spec(logits))
    values = tf.nest.map_structure(lambda t: None if t is None else batchless_spec(t), out)
    return Interface(values, tuple(masked), tuple(mask_specs), tuple(with_logits),
                     tuple(logit_specs), bool(call_losses))


def float_leaves(structure):
    """The dense floating-point tensors of a nest, in `tf.nest.flatten` order."""
    return [t for t in tf.nest.flatten(structure)
            if isinstance(t, tf.Tensor) and t.dtype.is_floating]


def pack(out, interface):
    """The boundary `(values, masks, logits)` of a stage output `out`."""
    flat = tf.nest.flatten(out)
    masks = tuple(_internal.get_keras_mask(flat[i]) for i in interface.masked)
    logits = tuple(_internal.get_keras_logits(flat[i]) for i in interface.with_logits)
    if any(m is None for m in masks) or any(l is None for l in logits):
        raise RuntimeError(
            "tfpipe boundary bug: a stage output lost the Keras mask or logits the "
            "probe saw on it.")
    return out, masks, logits


def unpack(boundary, interface):
    """The stage output from its boundary, with masks and logits attached again."""
    values, masks, logits = boundary
    flat = tf.nest.flatten(values)
    for i, mask in zip(interface.masked, masks):
        _internal.set_keras_mask(flat[i], mask)
    for i, logit in zip(interface.with_logits, logits):
        _internal.set_keras_logits(flat[i], logit)
    return values


def probe(stages, inputs, training, extra=None, on_output=None, connectivity=False,
          around_stage=None):
    """Traces the stages once on `inputs`' shapes; returns their `Interface`s.

    Args:
      stages: the K stage layers (built).
      inputs: one micro-batch of stage 0's inputs (tensors; only their specs
        are used).
      training: the training flag the stages are traced with.
      extra: optional nest of tensors (labels, sample weights) handed to
        `on_output` as batch-None placeholders.
      on_output: optional `on_output(y_pred, extra)`, called in the scratch
        graph with the last stage's raw output (its metadata intact); it may
        return the loss's scalar terms (for `connectivity`).
      connectivity: also trace the backward pass and set each Interface's
        `inputs_connected` (per float leaf of the stage's input boundary,
        whether the loss reaches it) and `variables_connected` (per variable of
        `stage.trainable_variables`).
      around_stage: optional `around_stage(k)`, a context manager entered
        around stage k's call; what it yields is kept as `Interface.recorded`.
    Returns:
      K `Interface`s.
    """
    interfaces = []
    specs = tf.nest.map_structure(batchless_spec, inputs)
    extra_specs = tf.nest.map_structure(lambda t: None if t is None else batchless_spec(t), extra)

    def trace(x, more):
        packed, records = x, []
        for k, stage in enumerate(stages):
            # A tape only when the backward pass is traced. Under a tape a
            # while loop (a Keras LSTM or GRU) is traced with the functions
            # its gradient needs: on a 2-core AMD EPYC a Bidirectional LSTM
            # and GRU traced in 7-9 s under a tape and 0.8 s without (20
            # library functions against 8), and the `wrappers` pattern's
            # probe took 15 s against 2.
            with (tf.GradientTape(persistent=True) if connectivity
                  else contextlib.nullcontext()) as tape:
                sources = float_leaves(packed) if k and connectivity else []
                if connectivity:
                    tape.watch(sources)
                h = unpack(packed, interfaces[k - 1]) if k else packed
                with (around_stage(k) if around_stage else contextlib.nullcontext()) as recorded:
                    out = stage(h, training=training)
                losses = _internal.call_losses(stage)
                last = k == len(stages) - 1
                interfaces.append(_interface(out, losses))
                interfaces[-1].recorded = recorded
                targets = []
                if last and on_output is not None:
                    targets = list(on_output(out, more) or [])
            packed = pack(out, interfaces[-1])
            records.append((tape, sources, packed, losses, targets))
        if connectivity:
            _connect(stages, interfaces, records)
        return [t for t in tf.nest.flatten(packed, expand_composites=True) if t is not None]

    tf.function(trace, autograph=False, reduce_retracing=False).get_concrete_function(
        specs, extra_specs)
    return interfaces


def _connect(stages, interfaces, records):
    """Which stage inputs and variables the loss reaches (NONE gradients)."""
    downstream = None  # per float leaf of the next stage's input: connected?
    for k in reversed(range(len(stages))):
        tape, sources, out, losses, targets = records[k]
        targets = list(targets) + list(losses)
        if downstream is not None:
            targets += [t for t, connected in zip(float_leaves(out), downstream) if connected]
        variables = list(stages[k].trainable_variables)
        if targets:
            grads = tape.gradient(targets, sources + variables,
                                  unconnected_gradients=tf.UnconnectedGradients.NONE)
        else:
            grads = [None] * (len(sources) + len(variables))
        interfaces[k].inputs_connected = [g is not None for g in grads[:len(sources)]]
        interfaces[k].variables_connected = [g is not None for g in grads[len(sources):]]
        # (index dtype, one entry per distinct row) of each variable's
        # IndexedSlices gradient (a lookup), or None for a dense one.
        interfaces[k].variables_sparse = [
            (g.indices.dtype, gradients_lib.gathers_unique_rows(g)) if isinstance(g, tf.IndexedSlices) else None
            for g in grads[len(sources):]]
        downstream = interfaces[k].inputs_connected
