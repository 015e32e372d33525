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
