"""Deferred batch normalisation: moving statistics of the whole mini-batch.

With M micro-batches a plain `BatchNormalization` layer runs M times per
training step; each run normalises its micro-batch with that micro-batch's
statistics and updates the moving mean and variance, so one step applies M
momentum updates from statistics of b = N / M rows each.
`DeferredBatchNormalization` (after torchgpipe's `DeferredBatchNorm`) keeps
the normalisation and changes only the update.

Training-time semantics (`training=True`, layer trainable), exactly:

* Each call (one micro-batch, b rows) is normalised with its own mean and
  biased variance over all axes but `axis`, as `BatchNormalization` does: the
  layer's output and its gradients are those of plain BN on that micro-batch.
* The micro-batch's count n_b (rows times the other reduced dimensions), mean
  and sum of squared deviations are merged into non-trainable accumulators:
  `accumulated_mean` and `accumulated_m2` (running mean and sum of squared
  deviations per channel), `accumulated_count` and `accumulated_calls`. The
  merge is Chan et al.'s parallel update: the same mean and variance as a
  sum / sum-of-squares / count accumulation, without its cancellation.
* On the M-th call of a step (M = `num_microbatches`) the accumulated mean
  and biased variance of all M micro-batches, i.e. of the whole mini-batch,
  are committed once:
  `moving_mean = momentum * moving_mean + (1 - momentum) * mean(mini-batch)`
  (likewise `moving_variance` with the biased variance), and the accumulators
  are reset. That is exactly the update full-batch training applies, for the
  activations this layer received.
* With `num_microbatches=1` the layer is plain `BatchNormalization`.

The calls are counted at run time (a variable, not a Python counter), so
the layer works the same in the unrolled and in the loop (`tf.while_loop`)
execution. Every training call counts: calling the pipelined model directly
with `training=True` on a whole batch is one of the M calls.

Inference (`training=False`, or a non-trainable layer) uses the moving
statistics, as plain BN. Recompute is safe: `tfpipe.recompute` replays a stage
and then restores all its non-trainable variables, accumulators included, so
a replayed micro-batch is counted once. A padded ragged last batch (tfpipe
pads with zero rows) contributes its padding rows to the statistics, as it
would to plain BN's.

What does not change: the normalisation itself still uses micro-batch
statistics (a pipeline cannot use the statistics of micro-batches that have not
run yet), so with BN a pipelined step equals full-batch training only for
M = 1. Deferred BN keeps the moving statistics, which evaluation and
inference use, the same as full-batch training's; plain BN's M updates per
step decay the old statistics like momentum**M and average micro-batch
variances, which miss the spread between micro-batches. That is why
`PipelinedModel.from_model(batch_norm="deferred")` is the default.

>>> import keras, numpy as np
>>> bn = DeferredBatchNormalization(num_microbatches=2)
>>> x = np.arange(16, dtype="float32").reshape(8, 2)
>>> _ = bn(x[:4], training=True)          # first micro-batch: accumulated
>>> float(bn.moving_mean.numpy()[0])       # not committed yet
0.0
>>> _ = bn(x[4:], training=True)          # second: commits the 8-row mean
>>> round(float(bn.moving_mean.numpy()[0]), 4)   # 0.01 * mean(x[:, 0]) = 0.01 * 7
0.07
"""

import keras
import tensorflow as tf
from keras import ops

from tfpipe import strategy as strategy_lib

BATCH_NORM_MODES = ("deferred", "plain")


@keras.saving.register_keras_serializable(package="tfpipe")
class DeferredBatchNormalization(keras.layers.BatchNormalization):
    """`BatchNormalization` whose moving statistics are updated once per mini-batch.

    Args:
      num_microbatches: M, the number of calls in one training step. None
        takes the current `tfpipe.PipelineStrategy`'s when the layer is built
        (else 1); `PipelinedModel.from_model` sets it to the model's M.
      **kwargs: as `keras.layers.BatchNormalization` (`renorm` unsupported).

    >>> import tfpipe, keras
    >>> bn = tfpipe.batchnorm.DeferredBatchNormalization()
    >>> stage = keras.Sequential([keras.layers.Dense(8), bn, keras.layers.Dense(2)])
    >>> with tfpipe.PipelineStrategy(num_microbatches=4).scope():
    ...     model = tfpipe.PipelinedModel([stage], input_shape=(None, 3))
    >>> bn.num_microbatches          # taken from the strategy when built
    4
    """

    def __init__(self, num_microbatches=None, **kwargs):
        if kwargs.get("renorm"):
            raise ValueError(
                "DeferredBatchNormalization does not support renorm=True; use "
                "keras.layers.BatchNormalization (batch_norm='plain' in from_model)."
            )
        super().__init__(**kwargs)
        self.num_microbatches = _check_m(num_microbatches)

    def build(self, input_shape):
        super().build(input_shape)
        if self.num_microbatches is None:
            strategy = strategy_lib.current_pipeline_strategy()
            self.num_microbatches = strategy.num_microbatches if strategy else 1
        shape = (input_shape[self.axis],)
        add = lambda name, shape: self.add_weight(  # noqa: E731
            name=name, shape=shape, initializer="zeros", trainable=False, autocast=False)
        # Mean, sum of squared deviations (M2) and element count per channel
        # of the calls since the last commit, and the number of those calls.
        self.accumulated_mean = add("accumulated_mean", shape)
        self.accumulated_m2 = add("accumulated_m2", shape)
        self.accumulated_count = add("accumulated_count", ())
        self.accumulated_calls = add("accumulated_calls", ())

    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable) or (self.num_microbatches or 1) == 1:
            return super().call(inputs, training=training, mask=mask)
        # The same ops as BatchNormalization's training branch, so the output
        # is bit-identical to plain BN's on this micro-batch.
        compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
        inputs = ops.cast(inputs, compute_dtype)
        gamma = ops.cast(self.gamma, inputs.dtype) if self.scale else None
        beta = ops.cast(self.beta, inputs.dtype) if self.center else None
        mean, variance = self._moments(inputs, mask)
        self._accumulate(mean, variance, self._count(inputs, mask))
        outputs = ops.batch_normalization(
            x=inputs, mean=mean, variance=variance, axis=self.axis,
            offset=beta, scale=gamma, epsilon=self.epsilon)
        return ops.cast(outputs, self.compute_dtype)

    def _count(self, inputs, mask):
        if mask is not None:
            return tf.reduce_sum(tf.cast(mask, tf.float32))
        channels = 1
        for axis in range(len(inputs.shape)):
            if axis not in self._reduction_axes:
                channels *= inputs.shape[axis]
        return tf.cast(tf.size(inputs), tf.float32) * (1.0 / channels)

    def _accumulate(self, mean, variance, count):
        # Plain TensorFlow ops, as few as possible: this runs once per
        # micro-batch per BN layer, and tracing time grows with the op count.
        mean, variance = tf.cast(mean, tf.float32), tf.cast(variance, tf.float32)
        n_a = tf.convert_to_tensor(self.accumulated_count.value)
        mean_a = tf.convert_to_tensor(self.accumulated_mean.value)
        n = n_a + count
        weight = count / n
        delta = mean - mean_a
        new_mean = mean_a + delta * weight
        new_m2 = self.accumulated_m2.value + variance * count + tf.square(delta) * (n_a * weight)
        calls = self.accumulated_calls.value + 1.0
        commit = calls >= float(self.num_microbatches)
        for moving, stat in ((self.moving_mean, new_mean), (self.moving_variance, new_m2 / n)):
            old = tf.cast(moving.value, tf.float32)
            updated = old * self.momentum + stat * (1.0 - self.momentum)
            moving.assign(tf.cast(tf.where(commit, updated, old), moving.dtype))
        zero = tf.zeros_like(new_mean)
        self.accumulated_mean.assign(tf.where(commit, zero, new_mean))
        self.accumulated_m2.assign(tf.where(commit, zero, new_m2))
        self.accumulated_count.assign(tf.where(commit, 0.0, n))
        self.accumulated_calls.assign(tf.where(commit, 0.0, calls))

    def get_config(self):
        return {**super().get_config(), "num_microbatches": self.num_microbatches}


def _check_m(m):
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise ValueError(f"num_microbatches must be a positive integer or None, got {m!r}.")
    return m


def validate_mode(batch_norm):
    """Returns `batch_norm` if it names a mode of `from_model`, else raises."""
    if batch_norm not in BATCH_NORM_MODES:
        raise ValueError(
            f"Unknown batch_norm {batch_norm!r}. Use 'deferred' (moving statistics "
            f"updated once per mini-batch with its statistics, as full-batch "
            f"training) or 'plain' (keep BatchNormalization: M updates per step)."
        )
    return batch_norm


def clone(op, batch_norm="deferred"):
    """An unbuilt copy of `op`; a `keras.layers.BatchNormalization` becomes
    `DeferredBatchNormalization` when `batch_norm="deferred"`."""
    config = op.get_config()
    if batch_norm == "deferred" and type(op) is keras.layers.BatchNormalization:
        if config.get("renorm"):
            raise ValueError(
                f"Layer {op.name!r} uses renorm=True, which deferred batch norm does "
                f"not support; pass batch_norm='plain' to keep it as it is."
            )
        return DeferredBatchNormalization.from_config(config)
    return op.__class__.from_config(config)


def set_num_microbatches(layer, num_microbatches):
    """Sets M on every `DeferredBatchNormalization` in `layer` (a layer, model
    or list of them); returns how many were set."""
    layers = layer if isinstance(layer, (list, tuple)) else [layer]
    found = 0
    for item in layers:
        for sub in item._flatten_layers(include_self=True, recursive=True):  # pylint: disable=protected-access
            if isinstance(sub, DeferredBatchNormalization):
                sub.num_microbatches = _check_m(num_microbatches)
                found += 1
    return found
