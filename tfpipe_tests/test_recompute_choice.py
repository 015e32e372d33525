"""A run given no recompute mode gets one chosen from memory before its first
training step (`tfpipe.recompute_choice`): "never" where the predicted peak
fits, else "except_last"; the step really runs the mode chosen."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe_tests import helpers

_NUMBER = r"[\d.]+"
_FITS = r"'never' is predicted to need [\d.]+ (B|KiB|MiB) of "


def _fit(strategy_kwargs, cut):
    x, y = helpers.regression_data(n=32)
    strategy = tfpipe.PipelineStrategy(**strategy_kwargs)
    with strategy.scope():
        if cut:
            model = tfpipe.PipelinedModel.from_model(
                helpers.reference(helpers.mlp_layers(), (8,)))
        else:
            model = tfpipe.PipelinedModel(helpers.mlp_layers(), input_shape=(None, 8))
        model.compile(optimizer="adam", loss="mse")
    pending = model.pipeline_config.recompute_pending
    calls = tfpipe.testing.StageCalls()
    model.set_trace_options(observer=calls)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return model, pending, calls.per_stage


@pytest.mark.parametrize("strategy_kwargs, cut, mode, reason, calls", [
    # CPU devices allocate from the host's memory: a small model keeps all.
    (dict(num_microbatches=4), True, "never",
     _FITS + rf"host memory's {_NUMBER} GiB, within 50% of it", [4] * 4),
    # Per device, as the user states it (replay: M - 1 more calls per stage).
    (dict(num_microbatches=4, device_memory_bytes=2048), True, "except_last",
     _FITS + r"/device:CPU:\d's 2.0 KiB, more than 50% of it", [7] * 4),
    (dict(num_microbatches=4, device_memory_bytes=2**30, schedule="1f1b"), True, "never",
     _FITS + r"/device:CPU:\d's 1.0 GiB, within 50% of it", [4] * 4),
    # Two replicas of two stages draw on the same host memory.
    (dict(num_microbatches=2, num_replicas=2), True, "never", _FITS + "host memory's", None),
    # Nothing to choose between: the mode that fits more.
    (dict(num_microbatches=1), True, "except_last", r"num_microbatches=1: the one", [1] * 4),
    # Hand-made stages taking one tensor are measured as one chain of their layers.
    (dict(num_microbatches=4), False, "never", _FITS + "host memory's", [4] * 4),
    # Given: untouched, and the loop runs one mode only.
    (dict(num_microbatches=4, recompute="always"), True, "always", None, [8] * 4),
    (dict(num_microbatches=4, execution="loop"), True, "always", None, None),
])
def test_an_unset_recompute_is_chosen_from_memory(strategy_kwargs, cut, mode, reason, calls):
    model, pending, per_stage = _fit(strategy_kwargs, cut)
    config = model.pipeline_config
    assert (model.recompute, pending) == (mode, reason is not None)
    line = next(l for l in model.pipeline_summary().splitlines() if "recompute=" in l)
    if reason is None:
        assert not config.recompute_chosen and f"recompute={mode}, " in line
    else:
        assert config.recompute_chosen and config.recompute_reason
        assert re.match(reason, config.recompute_reason), config.recompute_reason
        assert f"recompute={mode} (tfpipe chose it: {config.recompute_reason})" in line
        # Saved unset: a loaded model chooses again, for its own devices.
        assert model.get_config()["pipeline"]["recompute"] is None
    if calls is not None:
        assert per_stage == calls


def test_the_chosen_mode_trains_as_plain_keras():
    """The default run ("never" here) gives plain Keras' weights."""
    x, y = helpers.regression_data(n=32)
    reference = helpers.reference(helpers.mlp_layers(), (8,))
    plain = helpers.twin(reference)
    plain.compile(optimizer="adam", loss="mse")
    with tfpipe.PipelineStrategy(num_microbatches=4).scope():
        model = tfpipe.PipelinedModel.from_model(reference, balance=[1, 1, 1, 1])
        model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert model.recompute == "never"
    plan = tfpipe.plan(model, 16, 4, measure_time=False, recommend=False)  # says the same
    assert (plan.recompute, plan.recompute_reason) == ("never", model.pipeline_config
                                                       .recompute_reason)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("bad", [0, -1, True, "16GB"])
def test_device_memory_bytes_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match=rf"device_memory_bytes must be a positive number of "
                                         rf"bytes per device .*got {bad!r}"):
        tfpipe.PipelineStrategy(device_memory_bytes=bad)


def test_a_model_made_but_not_yet_trained_says_the_choice_is_pending():
    with tfpipe.PipelineStrategy(num_microbatches=4).scope():
        model = tfpipe.PipelinedModel.from_model(helpers.reference(helpers.mlp_layers(), (8,)))
    assert model.pipeline_config.recompute_pending
    assert "until the first training step, where tfpipe chooses it from memory" in \
        model.pipeline_summary()


def test_a_step_traced_outside_fit_chooses_on_its_inputs_shapes():
    """A custom loop calling `train_step` in its own tf.function (as the
    benchmarks do): the choice is made as the step traces, on zeros shaped as
    its inputs."""
    x, y = helpers.regression_data(n=16)
    with tfpipe.PipelineStrategy(num_microbatches=4).scope():
        model = tfpipe.PipelinedModel.from_model(helpers.reference(helpers.mlp_layers(), (8,)))
        model.compile(optimizer="adam", loss="mse")
    step = tf.function(lambda x, y: model.train_step((x, y)), autograph=False)
    with tfpipe.stage.call_scope(model.pipeline_config.traits):
        step(tf.constant(x), tf.constant(y))
    assert model.recompute == "never"
    assert re.match(_FITS + "host memory's", model.pipeline_config.recompute_reason)


@pytest.mark.parametrize("how", ["fit", "train_step"])
def test_the_choice_predicts_what_the_planner_predicts(how):
    """On a model whose layers keep activations inside them (attention), the
    peak behind the choice is `tfpipe.plan`'s, also where the step is traced
    outside fit (the measurement must see every backward's saved tensors)."""
    from models import transformer_lm  # pylint: disable=import-outside-toplevel
    keras_model = transformer_lm.transformer_lm(num_layers=2, width=16, num_heads=2, seq_len=8)
    with tfpipe.PipelineStrategy(num_microbatches=4).scope():
        model = tfpipe.PipelinedModel.from_model(keras_model)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    planned = tfpipe.plan(model, 16, 4, measure_time=False, recommend=False)
    tokens = np.random.default_rng(0).integers(0, 256, size=(16, 8)).astype("int32")
    if how == "fit":
        model.fit(tokens, tokens, batch_size=16, verbose=0)
    else:
        step = tf.function(lambda x, y: model.train_step((x, y)), autograph=False)
        with tfpipe.stage.call_scope(model.pipeline_config.traits):
            step(tf.constant(tokens), tf.constant(tokens))
    assert (model.recompute, model.pipeline_config.recompute_reason) == (
        planned.recompute, planned.recompute_reason)
    assert sum(s.stash_bytes_per_microbatch for s in planned.stages) > 4 * sum(
        s.input_bytes_per_microbatch for s in planned.stages)  # attention inside blocks
