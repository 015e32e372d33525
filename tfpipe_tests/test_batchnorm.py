"""Deferred BatchNorm: moving statistics of the whole mini-batch, once per step."""

import os

import keras
import numpy as np
import pytest

import tfpipe
from tfpipe import batchnorm
from tfpipe import placement

MODES = ["always", "except_last", "never"]


def _moving(layer):
    return layer.moving_mean.numpy(), layer.moving_variance.numpy()


def test_layer_commits_once_with_the_whole_batch_statistics():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(16, 3, 3, 5)) * 3.0 + 5.0).astype("float32")
    deferred = batchnorm.DeferredBatchNormalization(num_microbatches=4, momentum=0.9)
    plain = keras.layers.BatchNormalization(momentum=0.9)
    deferred.build(x.shape)
    plain.build(x.shape)
    for step in range(2):
        start = _moving(deferred)
        for m in range(4):
            part = x[4 * m:4 * m + 4] + step
            # Each micro-batch is normalised with its own statistics, as plain BN.
            np.testing.assert_array_equal(deferred(part, training=True).numpy(),
                                          _plain_output(part, deferred))
            if m < 3:
                for a, b in zip(_moving(deferred), start):
                    np.testing.assert_array_equal(a, b)  # nothing committed yet
        plain(x + step, training=True)  # one full-batch update
        for a, b in zip(_moving(deferred), _moving(plain)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert float(deferred.accumulated_calls) == 0.0  # reset after the commit


def _plain_output(part, like):
    twin = keras.layers.BatchNormalization(momentum=like.momentum, epsilon=like.epsilon)
    twin.build(part.shape)
    twin.set_weights([w.numpy() for w in like.weights[:4]])
    return twin(part, training=True).numpy()


def _bn_net(seed=0):
    """Conv / BN blocks with a residual skip; every BN sees different activations."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(4, 3, padding="same", name="c1")(x)
    h = keras.layers.BatchNormalization(momentum=0.8, name="bn1")(h)
    a = keras.layers.Activation("relu", name="r1")(h)
    h = keras.layers.Conv2D(4, 3, padding="same", name="c2")(a)
    h = keras.layers.BatchNormalization(momentum=0.8, name="bn2")(h)
    h = keras.layers.Add(name="skip")([keras.layers.Activation("relu", name="r2")(h), a])
    h = keras.layers.Conv2D(3, 3, name="c3")(h)
    h = keras.layers.BatchNormalization(momentum=0.8, name="bn3")(h)
    h = keras.layers.GlobalAveragePooling2D(name="gap")(h)
    return keras.Model(x, keras.layers.Dense(3, name="head")(h), name="bn_net")


def _data(n=16, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 8, 8, 2)) + 1.0).astype("float32"), rng.integers(0, 3, n)


def _compile(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _pipelined(ref, m, mode="except_last", batch_norm="deferred", balance=(3, 3, 3, 2)):
    with tfpipe.PipelineStrategy(num_microbatches=m, recompute=mode).scope():
        pipelined = tfpipe.PipelinedModel.from_model(ref, balance=list(balance),
                                                     batch_norm=batch_norm)
        _compile(pipelined)
    return pipelined


def _bn_layers(pipelined):
    return {l.name: l for s in pipelined.stages for l in s.layers
            if isinstance(l, keras.layers.BatchNormalization)}


def micro_batch_reference(model, x, m):
    """Each BN's moving statistics after one step, from the activations it sees.

    A copy of `model` runs each micro-batch in training mode (normalising with
    micro-batch statistics, as the pipeline does); the expected update uses
    the mean and biased variance, in float64, of all M micro-batches together.
    """
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    bns = [l for l in copy.layers if isinstance(l, keras.layers.BatchNormalization)]
    start = {bn.name: [w.numpy().astype("float64") for w in (bn.moving_mean, bn.moving_variance)]
             for bn in bns}
    probe = keras.Model(copy.input, [bn.input for bn in bns])
    seen = [probe(part, training=True) for part in np.split(x, m)]
    expected = {}
    for i, bn in enumerate(bns):
        acts = np.concatenate([np.asarray(s[i], dtype="float64") for s in seen])
        axes = tuple(range(acts.ndim - 1))
        mean0, var0 = start[bn.name]
        expected[bn.name] = (bn.momentum * mean0 + (1 - bn.momentum) * acts.mean(axes),
                             bn.momentum * var0 + (1 - bn.momentum) * acts.var(axes))
    return expected


@pytest.mark.parametrize("mode", MODES)
def test_pipeline_commits_whole_batch_statistics_once_per_step(mode):
    ref = _bn_net()
    x, y = _data()
    expected = micro_batch_reference(ref, x, 4)
    pipelined = _pipelined(ref, 4, mode)
    bns = _bn_layers(pipelined)
    assert {type(l).__name__ for l in bns.values()} == {"DeferredBatchNormalization"}
    assert {l.num_microbatches for l in bns.values()} == {4}
    pipelined.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for name, (mean, var) in expected.items():
        np.testing.assert_allclose(bns[name].moving_mean.numpy(), mean, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(bns[name].moving_variance.numpy(), var, atol=1e-5, rtol=1e-5)
    # The first BN sees the same activations as in full-batch training: its
    # moving statistics equal plain Keras' after one full-batch step.
    _compile(ref)
    ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(_moving(bns["bn1"]), _moving(ref.get_layer("bn1"))):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_plain_batch_norm_updates_once_per_micro_batch():
    ref = _bn_net()
    x, y = _data()
    pipelined = _pipelined(ref, 4, batch_norm="plain")
    bn1 = _bn_layers(pipelined)["bn1"]
    assert type(bn1) is keras.layers.BatchNormalization
    pipelined.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    # Four momentum updates, each with one micro-batch's statistics.
    copy = keras.models.clone_model(ref)
    copy.set_weights(ref.get_weights())
    probe = keras.Model(copy.input, copy.get_layer("bn1").input)
    mean = ref.get_layer("bn1").moving_mean.numpy().astype("float64")
    for part in np.split(x, 4):
        acts = np.asarray(probe(part), dtype="float64")
        mean = 0.8 * mean + 0.2 * acts.mean((0, 1, 2))
    np.testing.assert_allclose(bn1.moving_mean.numpy(), mean, atol=1e-5)
    deferred = micro_batch_reference(ref, x, 4)["bn1"][0]
    assert np.max(np.abs(bn1.moving_mean.numpy() - deferred)) > 1e-3  # not the full-batch one


def test_one_micro_batch_is_plain_keras_exactly():
    ref = _bn_net()
    x, y = _data(n=32)
    pipelined = _pipelined(ref, 1, "always")
    _compile(ref)
    ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    pipelined.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    got = {(l.name, w.name): w.numpy() for s in pipelined.stages for l in s.layers
           for w in l.weights}
    for layer in ref.layers:
        for w in layer.weights:
            np.testing.assert_allclose(got[(layer.name, w.name)], w.numpy(), atol=1e-6)


def test_hand_written_stages_take_m_from_the_strategy():
    strategy = tfpipe.PipelineStrategy(num_microbatches=4)
    with strategy.scope():
        model = tfpipe.PipelinedModel(
            [keras.Sequential([keras.layers.Dense(4), batchnorm.DeferredBatchNormalization()]),
             keras.layers.Dense(2)], input_shape=(None, 3))
        model.compile(optimizer="sgd", loss="mse")
    bn = model.stages[0].layers[1]
    assert bn.num_microbatches == 4
    for var in bn.weights:
        assert not placement.misplaced_variables([var], model.stage_devices[0]), var.path
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    model.fit(x, np.zeros((8, 2), "float32"), batch_size=8, verbose=0)
    assert float(bn.accumulated_calls) == 0.0  # 4 calls: committed and reset
    assert np.any(bn.moving_mean.numpy() != 0.0)


def test_serialisable_and_saved_inside_a_pipeline(tmp_path):
    layer = batchnorm.DeferredBatchNormalization(num_microbatches=3, momentum=0.7)
    config = keras.saving.serialize_keras_object(layer)
    assert config["registered_name"] == "tfpipe>DeferredBatchNormalization"
    again = keras.saving.deserialize_keras_object(config)
    assert again.num_microbatches == 3 and again.momentum == 0.7
    ref = _bn_net()
    x, y = _data()
    pipelined = _pipelined(ref, 2)
    pipelined.fit(x, y, batch_size=8, verbose=0)
    path = os.path.join(tmp_path, "bn.keras")
    pipelined.save(path)
    with tfpipe.PipelineStrategy(num_microbatches=2).scope():
        loaded = keras.models.load_model(path)
    bns = _bn_layers(loaded)
    assert bns["bn2"].num_microbatches == 2
    np.testing.assert_array_equal(bns["bn2"].moving_variance.numpy(),
                                  _bn_layers(pipelined)["bn2"].moving_variance.numpy())
    np.testing.assert_allclose(loaded.predict(x, batch_size=8, verbose=0),
                               pipelined.predict(x, batch_size=8, verbose=0), atol=1e-6)


def test_bad_batch_norm_arguments():
    with tfpipe.PipelineStrategy().scope():
        with pytest.raises(ValueError, match=r"Unknown batch_norm 'sync'.*'deferred'"):
            tfpipe.PipelinedModel.from_model(_bn_net(), batch_norm="sync")
        x = keras.Input((4,))
        renorm = keras.Model(x, keras.layers.BatchNormalization(renorm=True, name="rn")(x))
        with pytest.raises(ValueError, match=r"Layer 'rn' uses renorm=True.*batch_norm='plain'"):
            tfpipe.PipelinedModel.from_model(renorm, balance=[1])
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer"):
        batchnorm.DeferredBatchNormalization(num_microbatches=0)
