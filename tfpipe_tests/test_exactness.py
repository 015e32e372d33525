"""A pipelined model trains to the same weights as plain Keras (float32, 1e-5)."""

import keras
import numpy as np
import pytest

import tfpipe
from tfpipe_tests import helpers

TOL = 1e-5
MODES = ["always", "except_last", "never"]


def _train_both(make_layers, input_shape, data, m, mode, balance, batch_size=16,
                compile_kwargs=None, fit_kwargs=None):
    compile_kwargs = compile_kwargs or {}
    fit_kwargs = fit_kwargs or {}
    x, y = data
    ref = helpers.reference(make_layers(), input_shape)
    pipelined = helpers.pipelined_copy(ref, m, mode, balance, **compile_kwargs)
    ref.compile(**compile_kwargs)
    h_ref = ref.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, **fit_kwargs)
    h_pipe = pipelined.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0,
                           **fit_kwargs)
    return ref, pipelined, h_ref.history, h_pipe.history


# Every M with every recompute mode: the default suite runs each M once, the modes
# taking turns (helpers.taking_turns); CI's slow step runs all 12.
@pytest.mark.parametrize("m, mode", helpers.taking_turns([1, 2, 4, 8], MODES))
def test_mlp_matches_plain_keras(m, mode):
    # 80 rows / batch 16 = 5 Adam steps.
    ref, pipelined, h_ref, h_pipe = _train_both(
        helpers.mlp_layers, (8,), helpers.regression_data(), m, mode, [1, 1, 1, 1],
        compile_kwargs=dict(optimizer="adam", loss="mse", metrics=["mae"]))
    assert len(pipelined.stages) == 4
    assert helpers.max_abs_diff(ref.get_weights(), helpers.stage_weights(pipelined)) < TOL
    np.testing.assert_allclose(h_pipe["loss"], h_ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(h_pipe["mae"], h_ref["mae"], rtol=1e-5)


@pytest.mark.parametrize("m, mode", helpers.taking_turns([1, 2, 4, 8], MODES))
def test_cnn_matches_plain_keras(m, mode):
    ref, pipelined, h_ref, h_pipe = _train_both(
        helpers.cnn_layers, (8, 8, 1), helpers.image_data(), m, mode, [1, 1, 1, 2],
        compile_kwargs=dict(optimizer="adam",
                            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            metrics=["accuracy"]))
    assert helpers.max_abs_diff(ref.get_weights(), helpers.stage_weights(pipelined)) < TOL
    np.testing.assert_allclose(h_pipe["loss"], h_ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(h_pipe["accuracy"], h_ref["accuracy"], rtol=1e-6)


@pytest.mark.parametrize("mode", helpers.in_default_suite(MODES, default=["except_last"]))
def test_sample_weights_and_ragged_last_batch(mode):
    # 70 rows, batch 16: the last batch has 6 rows, padded to 8 for M=4.
    x, y = helpers.regression_data(n=70)
    sw = np.linspace(0.1, 2.0, 70).astype("float32")
    ref, pipelined, h_ref, h_pipe = _train_both(
        helpers.mlp_layers, (8,), (x, y), 4, mode, [2, 1, 1],
        compile_kwargs=dict(optimizer="adam", loss="mse", weighted_metrics=["mae"]),
        fit_kwargs=dict(sample_weight=sw))
    assert helpers.max_abs_diff(ref.get_weights(), helpers.stage_weights(pipelined)) < TOL
    np.testing.assert_allclose(h_pipe["loss"], h_ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(h_pipe["mae"], h_ref["mae"], rtol=1e-5)


def test_regularisers_counted_once_and_sum_reduction():
    def layers():
        return [keras.layers.Dense(8, activation="relu", kernel_regularizer="l2"),
                keras.layers.Dense(8, activation="relu", kernel_regularizer="l2"),
                keras.layers.Dense(3)]
    ref, pipelined, h_ref, h_pipe = _train_both(
        layers, (8,), helpers.regression_data(n=44), 4, "always", [1, 1, 1], batch_size=12,
        compile_kwargs=dict(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="sum")))
    assert helpers.max_abs_diff(ref.get_weights(), helpers.stage_weights(pipelined)) < TOL
    np.testing.assert_allclose(h_pipe["loss"], h_ref["loss"], rtol=1e-5)


def test_evaluate_and_predict_match_plain_keras():
    x, y = helpers.regression_data(n=50)  # 50 = 3 * 16 + 2: a ragged last batch
    ref = helpers.reference(helpers.mlp_layers(), (8,))
    pipelined = helpers.pipelined_copy(ref, 4, balance=[1, 1, 1, 1], loss="mse",
                                       metrics=["mae"])
    ref.compile(loss="mse", metrics=["mae"])
    np.testing.assert_allclose(pipelined.evaluate(x, y, batch_size=16, verbose=0),
                               ref.evaluate(x, y, batch_size=16, verbose=0), rtol=1e-6)
    got = pipelined.predict(x, batch_size=16, verbose=0)
    assert got.shape == (50, 3)
    np.testing.assert_allclose(got, ref.predict(x, batch_size=16, verbose=0), atol=1e-6)


@pytest.mark.parametrize("execution", ["unrolled", "loop"])
def test_per_token_loss_with_ragged_batches(execution):
    # Labels with one class per position (as a language model has): the
    # padded rows of a ragged batch must drop out of a (N, L) loss too.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(22, 5, 3)).astype("float32")
    y = rng.integers(0, 4, size=(22, 5)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ref = helpers.reference([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(4)],
                            (5, 3))
    strategy = tfpipe.PipelineStrategy(num_microbatches=4, execution=execution)
    with strategy.scope():
        pipelined = tfpipe.PipelinedModel.from_model(helpers.twin(ref), balance=[1, 1])
        pipelined.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
    ref.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
    # 22 rows in batches of 8: the last has 6 rows, padded to 8 (2 per micro-batch).
    h_ref = ref.fit(x, y, batch_size=8, shuffle=False, verbose=0).history
    h_pipe = pipelined.fit(x, y, batch_size=8, shuffle=False, verbose=0).history
    assert helpers.max_abs_diff(ref.get_weights(), helpers.stage_weights(pipelined)) < TOL
    np.testing.assert_allclose(h_pipe["loss"], h_ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(pipelined.evaluate(x, y, batch_size=8, verbose=0),
                               ref.evaluate(x, y, batch_size=8, verbose=0), rtol=1e-5)
