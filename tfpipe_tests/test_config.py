"""One owner for the pipeline's configuration: `PipelinedModel.pipeline_config`.

Settings come from the model's arguments, else the strategy's; they are saved
with the model and restored on load, where settings the strategy in scope was
given explicitly win. Nothing else (no layer) keeps a copy.
"""

import os

import keras
import numpy as np
import pytest

import tfpipe
from tfpipe import schedules
from tfpipe_tests import helpers


@pytest.mark.parametrize("strategy_kwargs, model_kwargs, expected", [
    ({}, {}, dict(num_microbatches=1, schedule="gpipe", recompute="except_last",
                  execution="unrolled", batch_norm="deferred")),
    (dict(num_microbatches=4), {}, dict(num_microbatches=4)),
    (dict(num_microbatches=4), dict(num_microbatches=2), dict(num_microbatches=2)),
    (dict(execution="loop"), {}, dict(execution="loop", recompute="always")),
    (dict(recompute="never"), dict(execution="loop"), dict(execution="loop", recompute="always")),
    (dict(schedule="1f1b", batch_norm="plain"), dict(recompute="never"),
     dict(schedule="1f1b", batch_norm="plain", recompute="never")),
])
def test_settings_come_from_the_model_then_the_strategy(strategy_kwargs, model_kwargs, expected):
    with tfpipe.PipelineStrategy(**strategy_kwargs).scope():
        model = tfpipe.PipelinedModel(helpers.mlp_layers(), input_shape=(None, 8), **model_kwargs)
    config = model.pipeline_config
    for key, value in expected.items():
        got = config.schedule.name if key == "schedule" else getattr(config, key)
        assert got == value, key
    assert model.num_microbatches == config.num_microbatches
    assert model.pipeline.config is config


def _saved(tmp_path, **strategy_kwargs):
    ref = helpers.reference(helpers.mlp_layers(), (8,))
    with tfpipe.PipelineStrategy(**strategy_kwargs).scope():
        model = tfpipe.PipelinedModel.from_model(ref, balance=[1, 1, 1, 1])
        model.compile(optimizer="adam", loss="mse")
    x, y = helpers.regression_data(n=32)
    model.fit(x, y, batch_size=16, verbose=0)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    return model, path, x


@pytest.mark.parametrize("load_scope, expected", [
    (None, dict(num_microbatches=2, schedule="1f1b")),
    (dict(num_microbatches=4), dict(num_microbatches=4, schedule="1f1b")),
    (dict(schedule="gpipe"), dict(num_microbatches=2, schedule="gpipe")),
], ids=["outside_any_scope", "strategy_sets_m", "strategy_sets_schedule"])
def test_saved_settings_are_restored_unless_the_strategy_sets_them(tmp_path, load_scope,
                                                                    expected):
    model, path, x = _saved(tmp_path, num_microbatches=2, schedule="1f1b")
    config = model.get_config()["pipeline"]
    assert config["num_microbatches"] == 2 and config["recompute"] == "except_last"
    if load_scope is None:
        loaded = keras.models.load_model(path)
    else:
        with tfpipe.PipelineStrategy(**load_scope).scope():
            loaded = keras.models.load_model(path)
    assert loaded.num_microbatches == expected["num_microbatches"]
    assert loaded.schedule == schedules.get(expected["schedule"])
    assert loaded.balance == [1, 1, 1, 1]
    np.testing.assert_allclose(loaded.predict(x, batch_size=16, verbose=0),
                               model.predict(x, batch_size=16, verbose=0), atol=1e-6)
    for stage, device in zip(loaded.stages, loaded.stage_devices):
        assert not tfpipe.placement.misplaced_variables(stage.weights, device)


def test_config_round_trips_through_json():
    config = tfpipe.PipelineConfig.make(num_microbatches=3, schedule="interleaved:2",
                                        execution="loop", batch_norm="plain")
    again = tfpipe.PipelineConfig.from_json(config.to_json())
    assert again == config and again.recompute == "always"
