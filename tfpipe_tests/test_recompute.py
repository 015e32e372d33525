"""Re-materialisation really re-runs stages, and replays them exactly."""

import keras
import numpy as np
import pytest

import tfpipe
from tfpipe_tests import helpers


@pytest.mark.parametrize("schedule, execution, mode, calls_per_stage", [
    ("gpipe", "unrolled", "never", [4] * 4),          # M forward calls
    ("gpipe", "unrolled", "except_last", [7] * 4),    # M forwards + (M - 1) replays
    ("gpipe", "unrolled", "always", [8] * 4),         # M forwards + M replays
    # A split backward in the unrolled form is one tape.gradient at I: no replay for W.
    ("zbh1", "unrolled", "never", [4] * 4),
    ("zbh1", "unrolled", "always", [8] * 4),
    # The loop traces each branch once: F, I (none on stage 0: no input gradient), W.
    ("zbh1", "loop", "always", [2, 3, 3, 3]),
    ("1f1b", "loop", "always", [2] * 4),
])
def test_recompute_mode_counts_stage_calls(schedule, execution, mode, calls_per_stage):
    x, y = helpers.regression_data(n=16)
    strategy = tfpipe.PipelineStrategy(num_microbatches=4, recompute=mode, schedule=schedule,
                                       execution=execution)
    with strategy.scope():
        model = tfpipe.PipelinedModel(helpers.mlp_layers(), input_shape=(None, 8))
        model.compile(optimizer="sgd", loss="mse")
    calls = tfpipe.testing.StageCalls()
    model.set_trace_options(observer=calls)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    # One trace of the training step; the pipeline does not retrace per step.
    assert calls.per_stage == calls_per_stage


def _dropout_layers():
    return [
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dropout(0.5, seed=3),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dropout(0.5, seed=4),
        keras.layers.Dense(3),
    ]


def _train_dropout(mode, steps_data):
    keras.utils.set_random_seed(0)
    base = keras.Sequential([keras.Input((8,))] + _dropout_layers())
    model = helpers.pipelined_copy(base, 4, mode, [2, 2, 1], optimizer="adam", loss="mse")
    x, y = steps_data
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return helpers.stage_weights(model), history.history["loss"]


def test_dropout_replay_gives_the_same_gradients_as_no_recompute():
    # A replay that redrew dropout masks would make "always" diverge from
    # "never"; identical weights mean the replay used the forward's masks.
    data = helpers.regression_data(n=64)
    never_w, never_loss = _train_dropout("never", data)
    always_w, always_loss = _train_dropout("always", data)
    except_w, _ = _train_dropout("except_last", data)
    assert helpers.max_abs_diff(never_w, always_w) < 1e-6
    assert helpers.max_abs_diff(never_w, except_w) < 1e-6
    np.testing.assert_allclose(always_loss, never_loss, rtol=1e-6)


def test_replay_does_not_update_batchnorm_statistics_twice():
    def layers():
        return [keras.layers.Dense(8), keras.layers.BatchNormalization(momentum=0.5),
                keras.layers.Dense(3)]
    data = helpers.regression_data(n=32)
    results = {}
    for mode in ("never", "always"):
        keras.utils.set_random_seed(0)
        base = keras.Sequential([keras.Input((8,))] + layers())
        model = helpers.pipelined_copy(base, 2, mode, [2, 1], optimizer="sgd", loss="mse")
        model.fit(*data, batch_size=16, epochs=1, shuffle=False, verbose=0)
        results[mode] = helpers.stage_weights(model)
    assert helpers.max_abs_diff(results["never"], results["always"]) < 1e-6
