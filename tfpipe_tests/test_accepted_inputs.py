"""Inputs that look risky but are accepted: each row trains and checks what it gets.

The rows of BUILD.md's "Bad input and faults" table that are not errors. A
data set of unknown cardinality and integer features must train exactly like
the same rows given as float arrays; a mixed-precision policy trains with
float16 compute and float32 variables on the stage devices. (Sparse, ragged
and dict inputs are rows of `test_real_models.py`: `sparse_input`,
`ragged_input`, `dict_inputs`.)
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe import placement
from tfpipe_tests import helpers


def _trained(x, y=None, batch_size=8, policy=None):
    """Weights and loss history of the 4-stage MLP after one epoch on (x, y)."""
    previous = keras.mixed_precision.global_policy()
    if policy:
        keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        with tfpipe.PipelineStrategy(num_microbatches=2).scope():
            model = tfpipe.PipelinedModel(helpers.mlp_layers(), input_shape=(None, 8))
            model.compile(optimizer="adam", loss="mse")
        history = model.fit(x, y, batch_size=None if y is None else batch_size,
                            shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    return model, history.history["loss"]


X, Y = helpers.regression_data(n=32)


def unknown_cardinality():
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda a, b: True).batch(8)
    assert ds.cardinality() == tf.data.UNKNOWN_CARDINALITY
    return _trained(ds)


def integer_features():
    return _trained(np.round(X * 4).astype("int32"), Y)


def integer_features_as_floats():
    return _trained(np.round(X * 4).astype("float32"), Y)


ACCEPTED = [
    # (input, what it must equal: same rows as float arrays, in the same batches)
    ("unknown_cardinality_dataset", unknown_cardinality, lambda: _trained(X, Y)),
    ("int32_features", integer_features, integer_features_as_floats),
]


@pytest.mark.parametrize("run, oracle", [pytest.param(r, o, id=i) for i, r, o in ACCEPTED])
def test_accepted_input_trains_like_float_arrays(run, oracle):
    model, loss = run()
    expected_model, expected_loss = oracle()
    assert loss == expected_loss
    for ours, theirs in zip(model.get_weights(), expected_model.get_weights(), strict=True):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("policy, compute", [("mixed_float16", "float16"),
                                             ("mixed_bfloat16", "bfloat16")])
def test_mixed_precision_policy_trains_with_float32_variables_on_stage_devices(
        policy, compute):
    model, loss = _trained(X, Y, policy=policy)
    assert np.isfinite(loss).all()
    for stage, device in zip(model.stages, model.stage_devices):
        assert stage.compute_dtype == compute
        assert {v.dtype for v in stage.weights} == {"float32"}
        assert placement.misplaced_variables(stage.weights, device) == []


@pytest.mark.parametrize("empty", ["arrays", "dataset"])
def test_no_rows_train_and_evaluate_nothing_as_plain_keras_does(empty):
    """Plain Keras runs no step on empty data: `fit` returns an empty history,
    `evaluate` an empty list (under a strategy Keras' own first-batch peek
    raised a bare StopIteration)."""
    x, y = helpers.regression_data(n=32)
    data = (dict(x=x[:0], y=y[:0], batch_size=8) if empty == "arrays" else
            dict(x=tf.data.Dataset.from_tensor_slices((x, y)).take(0).batch(8)))
    results = {}
    for name in ("plain", "pipelined"):
        model = helpers.reference(helpers.mlp_layers(), (8,))
        if name == "pipelined":
            with tfpipe.PipelineStrategy(num_microbatches=2).scope():
                model = tfpipe.PipelinedModel.from_model(model)
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        before = [w.copy() for w in model.get_weights()]
        results[name] = (model.fit(verbose=0, **data).history, model.evaluate(verbose=0, **data))
        assert helpers.max_abs_diff(before, model.get_weights()) == 0.0
    assert results["pipelined"] == results["plain"] == ({}, [])
