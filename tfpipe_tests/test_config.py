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
    # An unset execution is chosen at the model's own M.
    (dict(num_microbatches=8), {}, dict(execution="stage_functions", recompute="except_last",
                                        execution_chosen=True)),
    (dict(num_microbatches=8), dict(num_microbatches=4), dict(execution="unrolled",
                                                              execution_chosen=True)),
    (dict(num_microbatches=8), dict(execution="unrolled"), dict(execution="unrolled",
                                                                execution_chosen=False)),
    (dict(execution="loop"), dict(num_microbatches=8), dict(execution="loop")),
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
    # tfpipe chose the recompute mode ("never", from memory): saved unset, chosen again.
    assert (model.recompute, config["num_microbatches"], config["recompute"]) == ("never", 2, None)
    if load_scope is None:
        loaded = keras.models.load_model(path)
    else:
        with tfpipe.PipelineStrategy(**load_scope).scope():
            loaded = keras.models.load_model(path)
    assert loaded.num_microbatches == expected["num_microbatches"]
    assert loaded.schedule == schedules.get(expected["schedule"])
    assert loaded.balance == [1, 1, 1, 1] and loaded.pipeline_config.recompute_pending
    np.testing.assert_allclose(loaded.predict(x, batch_size=16, verbose=0),
                               model.predict(x, batch_size=16, verbose=0), atol=1e-6)
    for stage, device in zip(loaded.stages, loaded.stage_devices):
        assert not tfpipe.placement.misplaced_variables(stage.weights, device)


def test_config_round_trips_through_json():
    config = tfpipe.PipelineConfig.make(num_microbatches=3, schedule="interleaved:2",
                                        execution="loop", batch_norm="plain")
    again = tfpipe.PipelineConfig.from_json(config.to_json())
    assert again == config and again.recompute == "always"


# (M, execution given, the schedule tfpipe chooses, its execution): ZB-H1 where
# it runs unrolled below M = 8 (BUILD.md: the fastest measured step there);
# GPipe at M = 1, from M = 8 (stage functions) and under other executions.
@pytest.mark.parametrize("num_microbatches, execution, schedule, chosen_execution", [
    (1, None, "gpipe", "unrolled"),
    (2, None, "zbh1", "unrolled"),
    (7, "unrolled", "zbh1", "unrolled"),
    (8, None, "gpipe", "stage_functions"),
    (4, "stage_functions", "gpipe", "stage_functions"),
    (4, "loop", "gpipe", "loop"),
])
def test_an_unset_schedule_is_chosen_and_saved_unset(num_microbatches, execution, schedule,
                                                     chosen_execution):
    config = tfpipe.PipelineConfig.make(num_microbatches=num_microbatches, execution=execution)
    assert (config.schedule.name, config.schedule_chosen, config.execution) == (
        schedule, True, chosen_execution)
    assert config.to_json()["schedule"] is None and config.settings()["schedule"] is None
    assert tfpipe.PipelineConfig.from_json(config.to_json()) == config
    # Chosen again at another M; `jit_compile=True` on several devices (stage
    # functions) chooses GPipe; a given schedule stays.
    again = tfpipe.PipelineConfig.make(**{**config.settings(), "num_microbatches": 8})
    assert again.schedule.name == "gpipe"
    if execution is None:
        assert config.choose_execution(xla_per_stage=True).schedule.name == "gpipe"
    given = tfpipe.PipelineConfig.make(num_microbatches=num_microbatches, schedule="zbh1")
    assert (given.schedule_chosen, given.to_json()["schedule"]["class"]) == (
        False, "ZeroBubbleH1")
    why = {"zbh1": "the fastest step measured from M=2 to 7",
           "gpipe": "one micro-batch" if num_microbatches == 1 else "GPipe from M=8"}
    assert tfpipe.config.default_schedule_reason(num_microbatches, schedule).startswith(
        why[schedule])


@pytest.mark.parametrize("num_microbatches, schedule, expected", [
    (1, "gpipe", "unrolled"),
    (4, "1f1b", "unrolled"),
    (7, "gpipe", "unrolled"),
    (8, "gpipe", "stage_functions"),
    (16, "interleaved", "stage_functions"),
    (32, "1f1b", "stage_functions"),
    # A split backward holds W back from I only when unrolled.
    (8, "zbh1", "unrolled"),
    (32, "zbv", "unrolled"),
    (8, "zbh1/segments=2", "unrolled"),
    (8, "gpipe/segments=2", "stage_functions"),
    (8, schedules.Table([[f"F0.{m}" for m in range(8)] + [f"I0.{m}" for m in range(8)]
                         + [f"W0.{m}" for m in range(8)]]), "unrolled"),
    (8, schedules.Table([[f"F0.{m}" for m in range(8)] + [f"B0.{m}" for m in range(8)]]),
     "stage_functions"),
])
def test_an_unset_execution_is_chosen_from_m_and_the_schedule(num_microbatches, schedule,
                                                               expected):
    config = tfpipe.PipelineConfig.make(num_microbatches=num_microbatches, schedule=schedule)
    assert (config.execution, config.execution_chosen) == (expected, True)
    assert config.recompute == "except_last"
    # Saved unset, so a config made from it chooses again.
    assert config.to_json()["execution"] is None
    assert tfpipe.PipelineConfig.from_json(config.to_json()) == config
    given = tfpipe.PipelineConfig.make(num_microbatches=num_microbatches, schedule=schedule,
                                       execution="loop")
    assert (given.execution, given.execution_chosen, given.to_json()["execution"]) == (
        "loop", False, "loop")


@pytest.mark.parametrize("saved_execution, load_m, expected", [
    (None, 8, "stage_functions"),      # chosen at M=2, chosen again at M=8
    ("unrolled", 8, "unrolled"),       # given: kept
    (None, None, "unrolled"),          # the saved M=2
])
def test_a_loaded_model_chooses_its_execution_again_unless_it_was_given(
        tmp_path, saved_execution, load_m, expected):
    model, path, x = _saved(tmp_path, num_microbatches=2, execution=saved_execution)
    assert model.execution == "unrolled"
    assert model.get_config()["pipeline"]["execution"] == saved_execution
    with tfpipe.PipelineStrategy(num_microbatches=load_m).scope():
        loaded = keras.models.load_model(path)
    assert loaded.execution == expected
    assert loaded.pipeline_config.execution_chosen == (saved_execution is None)
    np.testing.assert_allclose(loaded.predict(x, batch_size=16, verbose=0),
                               model.predict(x, batch_size=16, verbose=0), atol=1e-6)
