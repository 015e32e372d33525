"""Real architectures (random init, offline) cut into 4 stages with from_model.

Tolerances (float32): forward outputs to atol 1e-5 (plus rtol 1e-5 for the
training-mode logits, whose scale reaches ~50); one SGD step with lr=1, so
each weight change is minus its gradient, to atol 1e-5 on the gradients
(gradients reach ~17); deferred BN moving statistics with M=2 to atol 1e-5 +
rtol 1e-5 against a float64 reference (relative, because activation
variances differ in scale from layer to layer). Observed on CPU: forward and
gradients bit-identical at M=1 (the same kernels run, on each stage's
device); BN statistics within 1e-7 relative.
"""

import keras
import numpy as np
import pytest

import tfpipe
from tfpipe import placement
from tfpipe_tests.test_batchnorm import micro_batch_reference

TOL = 1e-5
ARCHS = [
    "mobilenet_v2",
    pytest.param("resnet50", marks=pytest.mark.slow),  # ~30 s per test on 2 cores
]


def _model(arch):
    keras.utils.set_random_seed(0)
    if arch == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10,
                                           classifier_activation=None)
    return keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3), alpha=0.35,
                                          classes=10, classifier_activation=None)


def _data(n=8):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 64, 64, 3)).astype("float32"), np.arange(n) % 10


def _compile(model):
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _cut(model, m, recompute="except_last"):
    with tfpipe.PipelineStrategy(num_microbatches=m, recompute=recompute).scope():
        pipelined = tfpipe.PipelinedModel.from_model(model)  # balance by parameters
        _compile(pipelined)
    return pipelined


def _weights(layers):
    return {(l.name, w.name): w.numpy() for l in layers for w in l.weights}


def _stage_layers(pipelined):
    return [l for s in pipelined.stages for l in s.layers]


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_and_one_step_gradients_match_the_unsplit_model(arch):
    model = _model(arch)
    x, y = _data()
    pipelined = _cut(model, 1)
    assert len(pipelined.stages) == 4 and sum(pipelined.balance) == len(model.layers) - 1
    for stage, device in zip(pipelined.stages, pipelined.stage_devices):
        assert stage.weights and not placement.misplaced_variables(stage.weights, device)
    # (a) inference forward.
    np.testing.assert_allclose(pipelined.predict(x, batch_size=8, verbose=0),
                               model.predict(x, batch_size=8, verbose=0), atol=TOL)
    # (b) one SGD step (lr=1): weight change = -gradient, for every variable,
    # and the BN moving statistics of that step.
    before = _weights(model.layers)
    _compile(model)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    pipelined.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    want, got = _weights(model.layers), _weights(_stage_layers(pipelined))
    worst = max(float(np.max(np.abs((got[k] - before[k]) - (want[k] - before[k]))))
                for k in want)
    assert worst < TOL, worst
    # Training-mode forward (BN on batch statistics, so O(1) activations).
    np.testing.assert_allclose(np.asarray(pipelined(x, training=True)),
                               np.asarray(model(x, training=True)), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_deferred_batch_norm_statistics_match_the_whole_batch(arch):
    model = _model(arch)
    x, y = _data()
    expected = micro_batch_reference(model, x, 2)
    # Recompute with deferred BN is checked for every mode in test_batchnorm;
    # "never" keeps the trace of the small model cheap.
    pipelined = _cut(model, 2, "except_last" if arch == "resnet50" else "never")
    pipelined.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    bns = {l.name: l for l in _stage_layers(pipelined)
           if isinstance(l, keras.layers.BatchNormalization)}
    assert set(bns) == set(expected) and len(bns) > 30
    for name, (mean, var) in expected.items():
        np.testing.assert_allclose(bns[name].moving_mean.numpy(), mean, atol=TOL, rtol=TOL,
                                   err_msg=name)
        np.testing.assert_allclose(bns[name].moving_variance.numpy(), var, atol=TOL, rtol=TOL,
                                   err_msg=name)
    # The first BN sees the same input as in unsplit full-batch training: its
    # statistics equal those of Keras' own BN after one full-batch update.
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    first = next(l for l in copy.layers if isinstance(l, keras.layers.BatchNormalization))
    keras.Model(copy.input, first.output)(x, training=True)
    np.testing.assert_allclose(bns[first.name].moving_variance.numpy(),
                               first.moving_variance.numpy(), atol=TOL, rtol=TOL)
    np.testing.assert_allclose(bns[first.name].moving_mean.numpy(),
                               first.moving_mean.numpy(), atol=TOL, rtol=TOL)
