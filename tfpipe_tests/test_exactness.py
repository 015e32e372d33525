"""A pipelined model trains to the same weights as plain Keras (float32, 1e-5)."""

import itertools

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


# -- one pairwise table: model x M x schedule x execution x recompute -----------------
#
# Each row trains a pipeline for one epoch of Adam from a plain model's initial
# weights and asserts every weight within 1e-5 of plain Keras', the history
# (rtol 1e-5; accuracy 1e-6), `evaluate` (rtol 1e-5) and `predict` (atol 1e-5).
# The models: "mlp" (the 4-layer MLP, MSE, 5 full batches), "mlp_weighted" (the
# same with sample weights and weighted metrics, 70 rows: a ragged last batch of
# 6, so at M=8 two micro-batches are empty; cut in 3 uneven stages [2, 1, 1] where
# the schedule has one stage per device) and "cnn" (convolutions with an L2
# kernel regulariser, a call loss, and from-logits crossentropy with accuracy).
# The rows are a pairwise table (`_check_table`): every value of each column
# meets every value of every other column in some row (the loop runs only
# recompute="always", Interleaved needs M even); the default suite runs each
# value of each column at least once. The plain reference does not depend on the
# row: it is trained once per model and test process (`helpers.plain_reference`).

MODELS = ["mlp", "mlp_weighted", "cnn"]
MICROBATCHES = [1, 2, 4, 8]
EXECUTIONS = ["unrolled", "stage_functions", "loop"]
# (model, M, schedule, execution, recompute), in the default suite or not.
DEFAULT = [
    ("mlp", 1, "gpipe", "unrolled", "always"),
    ("mlp", 2, "1f1b", "stage_functions", "except_last"),
    ("mlp_weighted", 2, "interleaved", "loop", "always"),
    ("mlp_weighted", 4, "zbv", "unrolled", "except_last"),
    ("cnn", 2, "1f1b_segmented", "unrolled", "never"),
    ("mlp", 8, "zbh1", "loop", "always"),
]
SLOW = [
    ("mlp", 1, "1f1b", "unrolled", "always"),
    ("mlp", 1, "zbv", "unrolled", "never"),
    ("mlp", 1, "1f1b_segmented", "loop", "always"),
    ("mlp", 2, "zbv", "loop", "always"),
    ("mlp", 4, "gpipe", "loop", "always"),
    ("mlp", 4, "interleaved", "stage_functions", "never"),
    ("mlp", 4, "zbh1", "unrolled", "always"),
    ("mlp", 4, "1f1b_segmented", "unrolled", "always"),
    ("mlp", 8, "gpipe", "stage_functions", "always"),
    ("mlp_weighted", 1, "zbh1", "stage_functions", "never"),
    ("mlp_weighted", 2, "gpipe", "unrolled", "never"),
    ("mlp_weighted", 8, "1f1b", "unrolled", "never"),
    ("mlp_weighted", 8, "1f1b_segmented", "stage_functions", "except_last"),
    ("cnn", 1, "gpipe", "stage_functions", "except_last"),
    ("cnn", 2, "zbh1", "unrolled", "except_last"),
    ("cnn", 4, "1f1b", "loop", "always"),
    ("cnn", 8, "zbv", "stage_functions", "always"),
    ("cnn", 8, "interleaved", "unrolled", "except_last"),
]


def _runnable(model, m, schedule, execution, recompute):
    del model
    return ((execution != "loop" or recompute == "always")
            and (schedule != "interleaved" or m % 2 == 0))


def _check_table():
    columns = [MODELS, MICROBATCHES, list(helpers.SCHEDULES), EXECUTIONS, MODES]
    runnable = [r for r in itertools.product(*columns) if _runnable(*r)]
    assert all(_runnable(*r) for r in DEFAULT + SLOW)
    assert len(set(DEFAULT + SLOW)) == len(DEFAULT + SLOW)
    assert not helpers.missing_values(DEFAULT, columns), helpers.missing_values(DEFAULT, columns)
    missing = helpers.missing_pairs(DEFAULT + SLOW, runnable)
    assert not missing, missing


_check_table()


def _setup(name):
    """(layers, input shape, (x, y, sample weight), compile kwargs) of a model."""
    if name == "cnn":
        layers = [keras.layers.Conv2D(4, 3, activation="relu", kernel_regularizer="l2"),
                  keras.layers.MaxPooling2D(),
                  keras.layers.Conv2D(6, 2, activation="relu"),
                  keras.layers.Flatten(),
                  keras.layers.Dense(5)]
        return layers, (8, 8, 1), (*helpers.image_data(n=64), None), dict(
            optimizer="adam", metrics=["accuracy"],
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if name == "mlp_weighted":
        x, y = helpers.regression_data(n=70)  # 4 full batches of 16 and a ragged 6
        sw = np.linspace(0.1, 2.0, 70).astype("float32")
        return helpers.mlp_layers(), (8,), (x, y, sw), dict(
            optimizer="adam", loss="mse", weighted_metrics=["mae"])
    return helpers.mlp_layers(), (8,), (*helpers.regression_data(), None), dict(
        optimizer="adam", loss="mse", metrics=["mae"])


def _plain(name):
    """Plain Keras' initial and trained weights, history, evaluate and predict."""
    def train():
        layers, input_shape, (x, y, sw), compile_kwargs = _setup(name)
        ref = helpers.reference(layers, input_shape)
        ref.compile(**compile_kwargs)
        return helpers.fit_and_record(ref, x, y, sw)
    return helpers.plain_reference(("exactness", name), train)


@pytest.mark.parametrize("model, m, schedule, execution, recompute", [
    pytest.param(*row, id="-".join(map(str, row)), marks=() if row in DEFAULT else
                 pytest.mark.slow) for row in DEFAULT + SLOW])
def test_pipeline_trains_like_plain_keras(model, m, schedule, execution, recompute):
    plain = _plain(model)
    layers, input_shape, (x, y, sw), compile_kwargs = _setup(model)
    ref = helpers.reference(layers, input_shape)
    ref.set_weights(plain["initial"])
    balance = None
    if model == "cnn":
        balance = [1, 1, 1, 2]
    elif model == "mlp_weighted" and helpers.SCHEDULES[schedule][2] is None:
        balance = [2, 1, 1]  # one stage per device: 3 uneven stages
    pipelined = helpers.scheduled_copy(ref, schedule, m, execution, recompute, compile_kwargs,
                                       balance=balance)
    history = pipelined.fit(x, y, sample_weight=sw, batch_size=16, epochs=1, shuffle=False,
                            verbose=0).history
    assert len(pipelined.stages) == len(balance or [1, 1, 1, 1])
    assert helpers.max_abs_diff(plain["weights"], helpers.stage_weights(pipelined)) < TOL
    assert sorted(history) == sorted(plain["history"])
    for key, want in plain["history"].items():
        np.testing.assert_allclose(history[key], want, rtol=1e-6 if key == "accuracy" else 1e-5,
                                   err_msg=key)
    np.testing.assert_allclose(pipelined.evaluate(x, y, batch_size=16, verbose=0),
                               plain["evaluate"], rtol=1e-5)
    np.testing.assert_allclose(pipelined.predict(x, batch_size=16, verbose=0),
                               plain["predict"], atol=1e-5)


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
