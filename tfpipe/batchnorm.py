"""Deferred batch normalisation: moving statistics of the whole mini-batch.

With M micro-batches a BatchNormalization layer would apply M momentum
updates per step from N / M rows each. With `batch_norm="deferred"` (the
default; torchgpipe's `DeferredBatchNorm`) each call still normalises with
its own micro-batch's moments (Keras' own code runs), but tfpipe records them
(`Recorder`) and at the end of the step sets the moving statistics once from
their value before the step and the merged moments of all M calls (`merge`,
`commit`), as full-batch training would: once per call site. Replays never
count. `batch_norm="plain"` leaves the layers alone; `renorm=True` is refused.
"""

import contextlib

import keras
import tensorflow as tf

from tfpipe import _internal


def batch_norm_layers(stage):
    """Every `keras.layers.BatchNormalization` in `stage`, nested ones included."""
    return [layer for layer in _internal.flatten_layers(stage)
            if isinstance(layer, keras.layers.BatchNormalization)]


def check_layers(stages, batch_norm, num_replicas=1):
    """Raises ValueError for layers deferred mode cannot handle (renorm), and
    for any BatchNormalization under data-parallel replicas."""
    if num_replicas > 1:
        for k, stage in enumerate(stages):
            for layer in batch_norm_layers(stage):
                # Each replica would normalise with its own rows' moments and
                # update the moving statistics with them: not plain Keras on
                # the global batch, and cross-replica moments are not built.
                raise ValueError(
                    f"Layer {layer.name!r} (stage {k}) is a BatchNormalization, and the strategy "
                    f"has num_replicas={num_replicas} data-parallel replicas: tfpipe does not "
                    f"compute batch statistics across replicas, so training would differ from "
                    f"plain Keras. Use one replica (num_replicas=1, a flat device list), or a "
                    f"model without BatchNormalization (e.g. LayerNormalization).")
    if batch_norm != "deferred":
        return
    for k, stage in enumerate(stages):
        for layer in batch_norm_layers(stage):
            if layer.renorm:
                raise ValueError(
                    f"Layer {layer.name!r} (stage {k}) uses renorm=True, which deferred batch norm "
                    f"does not support; pass batch_norm='plain' to keep it as Keras updates it.")


class Moments:
    """The per-call statistics of one BatchNormalization call site."""

    __slots__ = ("layer", "count", "mean", "variance")

    def __init__(self, layer, count, mean, variance):
        self.layer, self.count, self.mean, self.variance = layer, count, mean, variance


class Recorder:
    """Records a stage's BatchNormalization moments while its forward is traced.

    `with recorder.forward(weight) as moments:` fills `moments` with one
    `Moments` per training BN call, in call order, its count multiplied by
    `weight` (0 for a stand-in for an empty micro-batch). Inactive (plain
    mode, or M = 1), it records nothing.
    """

    def __init__(self, stage, active):
        self.layers = batch_norm_layers(stage) if active else []

    @contextlib.contextmanager
    def forward(self, weight=1.0):
        moments = []
        if not self.layers:
            yield moments
            return
        with contextlib.ExitStack() as stack:
            for layer in self.layers:
                def record(inputs, mask, mean, variance, layer=layer):
                    # float32 at least (a float16 layer's moments), float64 kept.
                    dtype = tf.float64 if mean.dtype == tf.float64 else tf.float32
                    moments.append(Moments(
                        layer, tf.cast(_count(layer, inputs, mask), dtype) * tf.cast(weight, dtype),
                        tf.cast(mean, dtype), tf.cast(variance, dtype)))
                stack.enter_context(_internal.intercept_moments(layer, record))
            yield moments

    def before_step(self):
        """The moving statistics before the step: read them first."""
        return {id(layer): (tf.identity(layer.moving_mean.value),
                            tf.identity(layer.moving_variance.value))
                for layer in self.layers}


def empty_microbatch_guard(batch):
    """With plain BatchNorm a stand-in for an empty micro-batch would update
    the moving statistics: such a batch (fewer rows than M) is refused at
    run time. Returns the assert op."""
    return tf.debugging.assert_greater_equal(
        batch.split.num_rows, batch.num_microbatches, message=(
            f"a batch has fewer rows than num_microbatches={batch.num_microbatches}: with "
            f"batch_norm='plain' the empty micro-batches would update BatchNormalization's moving "
            f"statistics. Use batch_norm='deferred', or batches of at least "
            f"{batch.num_microbatches} rows (drop_remainder=True)."))


def _count(layer, inputs, mask):
    """Elements per channel that one call's statistics are over (float32)."""
    axes = _internal.batch_norm_reduction_axes(layer)
    if mask is None:
        shape = tf.shape(inputs)
        return tf.cast(tf.reduce_prod(tf.gather(shape, axes)), tf.float32)
    mask = tf.cast(tf.expand_dims(mask, -1), tf.float32)
    return tf.reduce_sum(tf.broadcast_to(mask, tf.shape(inputs)), axis=axes)


def merge(counts, means, variances):
    """(mean, biased variance) of the union of M calls' elements, from their
    per-channel counts (M,) or (M, C), means and biased variances (M, C)."""
    counts = tf.broadcast_to(tf.reshape(counts, [tf.shape(counts)[0], -1]), tf.shape(means))
    total = tf.reduce_sum(counts, 0)
    # An empty micro-batch (N < M) has NaN moments and weight 0.
    weights = tf.math.divide_no_nan(counts, total)
    means = tf.where(counts > 0, means, tf.zeros_like(means))
    variances = tf.where(counts > 0, variances, tf.zeros_like(variances))
    mean = tf.reduce_sum(weights * means, 0)
    variance = tf.reduce_sum(weights * (variances + tf.square(means - mean)), 0)
    return mean, variance


def stack_sites(per_microbatch):
    """Call sites from one list of `Moments` per micro-batch (same call order
    in each): [(layer, counts, means, variances)] with a leading M axis."""
    sites = []
    for calls in zip(*per_microbatch):
        sites.append((calls[0].layer,
                      tf.stack([c.count for c in calls]),
                      tf.stack([c.mean for c in calls]),
                      tf.stack([c.variance for c in calls])))
    return sites


def commit(before, sites):
    """Sets each layer's moving statistics once per call site of the step,
    from `before` (`Recorder.before_step()`) and `sites` (`stack_sites`, in
    call-site order); returns the assign ops."""
    current = dict(before)
    layers = {}
    for layer, counts, means, variances in sites:
        with tf.device(layer.moving_mean.value.device):
            mean, variance = merge(counts, means, variances)
            old_mean, old_var = current[id(layer)]
            current[id(layer)] = (
                tf.cast(old_mean, mean.dtype) * layer.momentum + mean * (1.0 - layer.momentum),
                tf.cast(old_var, mean.dtype) * layer.momentum + variance * (1.0 - layer.momentum))
            layers[id(layer)] = layer
    ops = []
    for key, layer in layers.items():
        new_mean, new_var = current[key]
        with tf.device(layer.moving_mean.value.device):
            ops.append(layer.moving_mean.assign(tf.cast(new_mean, layer.moving_mean.dtype)))
            ops.append(layer.moving_variance.assign(tf.cast(new_var, layer.moving_variance.dtype)))
    return ops
