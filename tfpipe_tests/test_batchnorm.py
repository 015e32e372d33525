"""Deferred BatchNorm: moving statistics of the whole mini-batch, once per step,
for every BatchNormalization however deeply nested, with nothing stored in
the layers.

The oracle is plain Keras: a twin of the model with momentum 0 run on one
micro-batch at a time in training mode leaves each BN's moving statistics
equal to that micro-batch's statistics (the activations the pipeline's BN
sees, since both normalise per micro-batch); merged in float64 they give the
expected whole-batch update.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe_tests import helpers

MOMENTUM = 0.8


@keras.saving.register_keras_serializable(package="tfpipe_tests")
class ResidualBlock(keras.layers.Layer):
    """A user's residual block: BatchNormalization nested inside a layer."""

    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.filters = filters
        self.conv = keras.layers.Conv2D(filters, 3, padding="same")
        self.bn = keras.layers.BatchNormalization(momentum=MOMENTUM)

    def build(self, input_shape):
        self.conv.build(input_shape)
        self.bn.build(self.conv.compute_output_shape(input_shape))

    def call(self, x, training=None):
        return keras.ops.relu(self.bn(self.conv(x), training=training) + x)

    def get_config(self):
        return {**super().get_config(), "filters": self.filters}


def bn_net(seed=0):
    """BN at the top level, inside a residual block and inside a nested
    Sequential; every BN sees different activations."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(4, 3, padding="same", name="c1")(x)
    h = keras.layers.BatchNormalization(momentum=MOMENTUM, name="bn1")(h)
    h = keras.layers.Activation("relu")(h)
    h = ResidualBlock(4, name="block")(h)
    nested = keras.Sequential([keras.layers.Conv2D(3, 3),
                               keras.layers.BatchNormalization(momentum=MOMENTUM)],
                              name="nested")
    h = keras.layers.GlobalAveragePooling2D()(nested(h))
    return keras.Model(x, keras.layers.Dense(3, activation="softmax", name="head")(h))


def _data(n=16, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 8, 8, 2)) + 1.0).astype("float32"), rng.integers(0, 3, n)


def _compile(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")


def _bns(model):
    return [l for l in model._flatten_layers() if isinstance(l, keras.layers.BatchNormalization)]


def _pipelined(model, m, balance=(2, 2, 2, 2), **settings):
    with tfpipe.PipelineStrategy(num_microbatches=m, **settings).scope():
        pipelined = tfpipe.PipelinedModel.from_model(model, balance=list(balance))
        _compile(pipelined)
    return pipelined


def micro_batch_statistics(model, x, m):
    """Per BN (in `_bns` order), each micro-batch's (mean, biased variance),
    float64, from a momentum-0 twin of `model` (plain Keras)."""
    twin = helpers.twin(model)
    for bn in _bns(twin):
        bn.momentum = 0.0
    stats = []
    parts = [part for part in np.array_split(x, m) if len(part)]  # empty ones add nothing
    for part in parts:
        twin(part, training=True)
        stats.append([(bn.moving_mean.numpy().astype("float64"),
                       bn.moving_variance.numpy().astype("float64")) for bn in _bns(twin)])
    return stats, [len(part) for part in parts]


def expected_update(model, x, m):
    """Each BN's moving statistics after one step of deferred BN."""
    stats, sizes = micro_batch_statistics(model, x, m)
    w = np.asarray(sizes, "float64") / sum(sizes)
    out = []
    for i, bn in enumerate(_bns(model)):
        means = np.stack([s[i][0] for s in stats])
        variances = np.stack([s[i][1] for s in stats])
        mean = (w[:, None] * means).sum(0)
        variance = (w[:, None] * (variances + (means - mean) ** 2)).sum(0)
        out.append((bn.momentum * bn.moving_mean.numpy() + (1 - bn.momentum) * mean,
                    bn.momentum * bn.moving_variance.numpy() + (1 - bn.momentum) * variance))
    return out


# Each setting once in the default suite, the batch sizes taking turns
# (helpers.taking_turns); CI's slow step runs both sizes with every setting.
@pytest.mark.parametrize("n, settings", helpers.taking_turns([16, 14], [
    dict(recompute="always"), dict(recompute="except_last"), dict(recompute="never"),
    dict(schedule="1f1b"), dict(execution="loop"),
    # Two stages, one holding two BatchNorm call sites: a stage commits
    # every call site it recorded, not only its first.
    dict(balance=(4, 4)), dict(balance=(4, 4), execution="stage_functions"),
    dict(balance=(4, 4), execution="loop"),
], second_ids=["always", "except_last", "never", "1f1b", "loop", "two_sites_per_stage",
               "two_sites_per_stage_functions", "two_sites_per_stage_loop"]))
# n=14: micro-batches of 4, 4, 3, 3
def test_deferred_commits_whole_batch_statistics_once_per_step(settings, n):
    model = bn_net()
    x, y = _data(n)
    expected = expected_update(model, x, 4)
    pipelined = _pipelined(model, 4, **settings)
    assert len(_bns(model)) == 3  # top level, in the residual block, in the nested model
    pipelined.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for bn, (mean, variance) in zip(_bns(model), expected):
        np.testing.assert_allclose(bn.moving_mean.numpy(), mean, atol=1e-5, rtol=1e-5,
                                   err_msg=bn.path)
        np.testing.assert_allclose(bn.moving_variance.numpy(), variance, atol=1e-5, rtol=1e-5,
                                   err_msg=bn.path)


def test_first_batch_norm_equals_full_batch_keras():
    # The first BN sees the same activations as unsplit training: its moving
    # statistics equal plain Keras' after one full-batch step.
    model = bn_net()
    plain = helpers.twin(model)
    x, y = _data()
    _pipelined(model, 4).fit(x, y, batch_size=16, shuffle=False, verbose=0)
    _compile(plain)
    plain.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    for a, b in ((model.get_layer("bn1").moving_mean, plain.get_layer("bn1").moving_mean),
                 (model.get_layer("bn1").moving_variance,
                  plain.get_layer("bn1").moving_variance)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5, rtol=1e-5)


def test_plain_mode_updates_once_per_micro_batch():
    model = bn_net()
    x, y = _data()
    start = [(bn.moving_mean.numpy(), bn.moving_variance.numpy()) for bn in _bns(model)]
    stats, _ = micro_batch_statistics(model, x, 4)
    _pipelined(model, 4, batch_norm="plain").fit(x, y, batch_size=16, shuffle=False, verbose=0)
    # Four momentum updates, one per micro-batch, in order.
    for i, bn in enumerate(_bns(model)):
        mean = start[i][0].astype("float64")
        for s in stats:
            mean = MOMENTUM * mean + (1 - MOMENTUM) * s[i][0]
        np.testing.assert_allclose(bn.moving_mean.numpy(), mean, atol=1e-5, rtol=1e-5)


def test_one_micro_batch_is_plain_keras_exactly():
    model = bn_net()
    plain = helpers.twin(model)
    x, y = _data(n=32)
    _pipelined(model, 1).fit(x, y, batch_size=16, shuffle=False, verbose=0)
    _compile(plain)
    plain.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    for a, b in zip(model.weights, plain.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6, err_msg=a.path)


def test_batch_with_fewer_rows_than_micro_batches():
    # 18 rows in batches of 16: the last has 2 rows for M = 4, so two
    # micro-batches are empty; the statistics are those of the 2 rows.
    model = bn_net()
    x, y = _data(n=18)
    pipelined = _pipelined(model, 4)
    pipelined.fit(x[:16], y[:16], batch_size=16, shuffle=False, verbose=0)
    expected = expected_update(model, x[16:], 4)
    pipelined.fit(x[16:], y[16:], batch_size=16, shuffle=False, verbose=0)
    for bn, (mean, variance) in zip(_bns(model), expected):
        assert np.all(np.isfinite(bn.moving_variance.numpy()))
        np.testing.assert_allclose(bn.moving_mean.numpy(), mean, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(bn.moving_variance.numpy(), variance, atol=1e-5, rtol=1e-5)


def test_layers_are_the_users_and_store_no_microbatch_count(tmp_path):
    model = bn_net()
    pipelined = _pipelined(model, 2)
    assert {type(bn) for bn in _bns(pipelined)} == {keras.layers.BatchNormalization}
    assert sorted(id(bn) for bn in _bns(pipelined)) == sorted(id(bn) for bn in _bns(model))
    x, y = _data()
    pipelined.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    path = os.path.join(tmp_path, "bn.keras")
    pipelined.save(path)
    # Loaded under M = 4, the same layers defer over 4 micro-batches.
    with tfpipe.PipelineStrategy(num_microbatches=4).scope():
        loaded = keras.models.load_model(path)
    assert loaded.num_microbatches == 4
    np.testing.assert_allclose(loaded.predict(x, batch_size=8, verbose=0),
                               pipelined.predict(x, batch_size=8, verbose=0), atol=1e-6)
    expected = expected_update(loaded.source_model, x, 4)
    loaded.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    for bn, (mean, variance) in zip(_bns(loaded.source_model), expected):
        np.testing.assert_allclose(bn.moving_mean.numpy(), mean, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(bn.moving_variance.numpy(), variance, atol=1e-5, rtol=1e-5)


def test_plain_mode_refuses_a_batch_with_fewer_rows_than_micro_batches():
    # Empty micro-batches run a stand-in row, which plain BN would count.
    model = bn_net()
    x, y = _data(n=2)
    pipelined = _pipelined(model, 4, batch_norm="plain")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"fewer rows than num_microbatches=4: with batch_norm="):
        pipelined.fit(x, y, batch_size=16, shuffle=False, verbose=0)
