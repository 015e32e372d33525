"""Summing one variable's gradients over micro-batches and stages, exactly.

Dense gradients add. An embedding lookup's gradient is an `IndexedSlices`
with one row per lookup, and Keras' optimizers treat repeated rows
differently from their sum (Adam's second moment), so micro-batch slices are
concatenated, never densified or summed; those of ops that deduplicate rows
within a batch (`tf.nn.embedding_lookup_sparse`) are merged row by row.
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


def add_each(accs, grads):
    """[add_gradients(a, g) for each pair]: one action's weight gradients."""
    return [add_gradients(acc, grad) for acc, grad in zip(accs, grads)]


_UNIQUE_OPS = ("Unique", "UniqueV2", "UniqueWithCounts", "UniqueWithCountsV2")
_PASS_THROUGH = ("Identity", "Reshape", "Cast", "Squeeze", "ExpandDims", "StridedSlice",
                 "GatherV2", "Gather")


def gathers_unique_rows(grad):
    """Whether an IndexedSlices gradient has one entry per distinct row by
    construction (its indices come from a `tf.unique`; then `merge_rows`).

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


def with_static_dense_shape(grad, variable):
    """`grad` with its variable's static shape as an IndexedSlices' dense_shape.

    A dense_shape computed inside a stage function's call is opaque to XLA's
    constant analysis: the optimizer's segment sum, which needs it as a
    compile-time constant, then makes every input of that call (weights,
    data) one too, and a step compiled as one XLA program recompiled at every
    step (3-5 s each on a small transformer, `benchmarks.compile_time`)."""
    if not isinstance(grad, tf.IndexedSlices) or not variable.shape.is_fully_defined():
        return grad
    return tf.IndexedSlices(grad.values, grad.indices,
                            tf.constant(variable.shape.as_list(), grad.dense_shape.dtype))


def scale_gradient(grad, factor):
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype),
                                grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def regularization_loss(variables):
    """The weight regularisers' summed loss (float32, float64 if one is), or
    None; each of R replicas reports its 1/R share (once per step)."""
    values = [v.regularizer(v) for v in variables if getattr(v, "regularizer", None) is not None]
    dtype = tf.float64 if any(t.dtype == tf.float64 for t in values) else tf.float32
    values = [tf.cast(t, dtype) for t in values]
    return tf.add_n(values) / replicas.num_replicas() if values else None


def add_regularization(variables, grads, scale, scope_of, dtype=tf.float32):
    """Adds each weight regulariser's gradient, times the loss `scale`, to
    `grads` (in place) under `scope_of(i)`; returns the summed regularisation
    loss (a `dtype` scalar, or None). Each of R replicas adds 1/R of it."""
    total = []
    share = 1.0 / replicas.num_replicas()
    scale = scale * share
    for i, v in enumerate(variables):
        regularizer = getattr(v, "regularizer", None)
        if regularizer is None:
            continue
        with scope_of(i):
            with tf.GradientTape() as tape:
                value = tf.cast(regularizer(v), dtype)
                target = value * scale
            grads[i] = add_gradients(grads[i], tape.gradient(target, v))
            total.append(value * share)
    return tf.add_n(total) if total else None


def check_reached(table, grads, stage_names, model_name):
    """Raises ValueError naming every trainable variable no gradient reached.

    `table`: the step's `tfpipe.step_plan.VariableTable`; `grads`: one
    gradient (or None) per its variable.
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
        f"No gradient reaches {sum(len(p) for p in missing.values())} trainable variable(s) in a "
        f"training step of {model_name!r}: {where}. Keras would only warn and leave them "
        f"unchanged; tfpipe stops rather than train silently wrong. If they should stay fixed, set "
        f"trainable=False on their layers, or on the variables themselves when their layer's "
        f"other weights train (variable.trainable = False; e.g. an untied output embedding "
        f"that a backbone never reads), before compile; otherwise make the loss depend on them "
        f"(a loss for every output they feed, no stop_gradient on the way).")
