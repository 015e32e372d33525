"""What crosses a stage boundary: tensors, and the Keras metadata riding on them.

Keras keeps a mask (`Embedding(mask_zero=True)`, `Masking`) and, on a softmax
or sigmoid output, its logits as hidden attributes of a tensor; any op that
makes a new tensor (an identity, a TensorArray, a concat) drops them. So
stage k's output `values` crosses as the boundary `(values, masks, logits)`
(`pack`; masks and logits: one per leaf that carries one) and stage k + 1
attaches them back (`unpack`). Logits are float leaves of the boundary, so a
loss reaches them with their gradient. Which leaves carry what is found once
per traced step by `probe`, which traces the stages in a scratch graph.
"""

import contextlib
import dataclasses

import tensorflow as tf

from tfpipe import _internal
from tfpipe import assumptions
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
      writes: the variables its forward writes (`tfpipe.assumptions.Write`s).
      inputs_connected, variables_connected, variables_sparse: see `probe`.
      recorded: what `probe`'s `around_stage` yielded.
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
    writes: tuple = ()

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
      stages: the K built stage layers; inputs: one micro-batch of stage 0's
        inputs (only their specs are used); training: the training flag.
      extra: optional nest of tensors (labels, sample weights) handed to
        `on_output(y_pred, extra)` as batch-None placeholders, with the last
        stage's raw output; it may return the loss's scalar terms.
      connectivity: also trace the backward and set each Interface's
        `inputs_connected` (per float leaf of the input boundary: does the
        loss reach it), `variables_connected` and `variables_sparse`.
      around_stage: optional `around_stage(k)`, a context manager around
        stage k's call; what it yields is kept as `Interface.recorded`.
    """
    interfaces = []
    specs = tf.nest.map_structure(batchless_spec, inputs)
    extra_specs = tf.nest.map_structure(lambda t: None if t is None else batchless_spec(t), extra)
    model_variables = list({id(v): v for s in stages for v in s.variables}.values())

    def trace(x, more):
        packed, records = x, []
        for k, stage in enumerate(stages):
            # A tape only when the backward is traced: under one, a while loop
            # (an LSTM) also traces its gradient functions, several times slower.
            with (tf.GradientTape(persistent=True) if connectivity
                  else contextlib.nullcontext()) as tape:
                sources = float_leaves(packed) if k and connectivity else []
                if connectivity:
                    tape.watch(sources)
                h = unpack(packed, interfaces[k - 1]) if k else packed
                graph = tf.compat.v1.get_default_graph()
                first_op = len(graph.get_operations())
                with (around_stage(k) if around_stage else contextlib.nullcontext()) as recorded:
                    out = stage(h, training=training)
                losses = _internal.call_losses(stage)
                last = k == len(stages) - 1
                interfaces.append(_interface(out, losses))
                interfaces[-1].recorded = recorded
                interfaces[-1].writes = assumptions.variable_writes(
                    stage, graph.get_operations()[first_op:], model_variables)
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
            (g.indices.dtype, gradients_lib.gathers_unique_rows(g))
            if isinstance(g, tf.IndexedSlices) else None for g in grads[len(sources):]]
        downstream = interfaces[k].inputs_connected
