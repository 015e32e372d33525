"""Summing one variable's gradients over micro-batches and stages, exactly.

Dense gradients add. An embedding lookup's gradient is an `IndexedSlices`,
one row per lookup; full-batch training hands the optimizer all those rows,
and Keras' optimizers treat repeated rows differently from their sum (Adam's
second moment sees each row's square), so micro-batch slices are
concatenated, never densified or summed. Some ops deduplicate their rows
within a batch first (`tf.nn.embedding_lookup_sparse`, which Keras uses to
multiply a SparseTensor by a kernel): their full-batch gradient has each row
once, so micro-batch slices are merged row by row (`merge_rows`).
"""

import tensorflow as tf

from tfpipe import _internal
from tfpipe import replicas


def add_gradients(acc, grad):
    """acc + grad; IndexedSlices stay sparse (no dense [vocab, d] buffer)."""
    if grad is None:
        return acc
    if acc is None:
        return grad
    if isinstance(acc, tf.IndexedSlices) and isinstance(grad, tf.IndexedSlices):
        # Concatenated slices sum on application.
        return tf.IndexedSlices(
            tf.concat([acc.values, grad.values], 0),
            tf.concat([acc.indices, grad.indices], 0),
            acc.dense_shape,
        )
    return tf.convert_to_tensor(acc) + tf.convert_to_tensor(grad)


_UNIQUE_OPS = ("Unique", "UniqueV2", "UniqueWithCounts", "UniqueWithCountsV2")
_PASS_THROUGH = ("Identity", "Reshape", "Cast", "Squeeze", "ExpandDims", "StridedSlice",
                 "GatherV2", "Gather")


def gathers_unique_rows(grad):
    """Whether an IndexedSlices gradient has one entry per distinct row by
    construction (its indices come from a `tf.unique`, as in
    `tf.nn.embedding_lookup_sparse`, which Keras' sparse matmul uses).

    Full-batch training then hands the optimizer each row once, so the
    micro-batches' slices must be merged row by row (`merge_rows`); a plain
    lookup (`Embedding`) has one entry per lookup, which concatenation keeps.
    Keras' Adam treats repeated rows differently from their sum, hence the care.

    The search follows the indices into function calls and back out of their
    arguments: under execution="stage_functions" a stage's gradient is an
    output of TF's backward function, whose indices are the forward call's
    `tf.unique`, passed on as an argument.
    """
    frontier, seen = [(grad.indices, ())], set()
    while frontier:
        t, calls = frontier.pop()  # calls: the call ops whose bodies t is in
        op = getattr(t, "op", None)
        key = (id(op), tuple(id(c) for c in calls))
        if op is None or key in seen:
            continue
        seen.add(key)
        if op.type in _UNIQUE_OPS:
            return True
        if op.type in _PASS_THROUGH and op.inputs:
            frontier.append((op.inputs[0], calls))
            continue
        body = _internal.function_body(op)
        if body is not None:
            frontier.append((body.outputs[t.value_index], calls + (op,)))
        elif op.type == "Placeholder" and calls:
            position = [i for i, x in enumerate(op.graph.inputs) if x is t]
            if position:
                frontier.append((calls[-1].inputs[position[0]], calls[:-1]))
    return False


def merge_rows(grad):
    """An IndexedSlices with each row once (duplicates summed), rows in order
    of first appearance, as `tf.unique` orders them."""
    rows, position = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, position, tf.size(rows))
    return tf.IndexedSlices(values, rows, grad.dense_shape)


def scale_gradient(grad, factor):
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype),
                                grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def add_regularization(variables, grads, scale, scope_of):
    """Adds each weight regulariser's gradient to `grads` (in place), once per
    step, under `scope_of(i)` (variable i's home stage); returns the summed
    regularisation loss (float32 scalar, None without regularisers). With R
    data-parallel replicas each adds 1/R of it (their gradients are summed).
    `scale` is the loss scale (Keras' `optimizer.scale_loss` of 1)."""
    total = []
    share = 1.0 / replicas.num_replicas()
    scale = scale * share
    for i, v in enumerate(variables):
        regularizer = getattr(v, "regularizer", None)
        if regularizer is None:
            continue
        with scope_of(i):
            with tf.GradientTape() as tape:
                value = tf.cast(regularizer(v), tf.float32)
                target = value * scale
            grads[i] = add_gradients(grads[i], tape.gradient(target, v))
            total.append(value * share)
    return tf.add_n(total) if total else None


def check_reached(table, grads, stage_names, model_name):
    """Raises ValueError naming every trainable variable no gradient reached.

    Args:
      table: the step's `tfpipe.step_plan.VariableTable`; grads: one
        gradient per its variable (None: unreached).
      stage_names: the stages' names; model_name: the model's.
    """
    missing = {}
    for i, (v, g) in enumerate(zip(table.variables, grads)):
        if g is None:
            missing.setdefault(table.home(i), []).append(v.path)
    if not missing:
        return
    where = "; ".join(f"stage {k} ({stage_names[k]!r}): {paths}"
                      for k, paths in sorted(missing.items()))
    raise ValueError(
        f"No gradient reaches {sum(len(p) for p in missing.values())} trainable "
        f"variable(s) in a training step of {model_name!r}: {where}. Keras would "
        f"only warn and leave them unchanged; tfpipe stops rather than train "
        f"silently wrong. If they should stay fixed, set trainable=False on their "
        f"layers before compile; otherwise make the loss depend on them (a loss "
        f"for every output they feed, no stop_gradient on the way).")
