"""Bad configurations raise a ValueError that names the fix."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe_tests import helpers


def _compiled(m=8, **kwargs):
    strategy = tfpipe.PipelineStrategy(num_microbatches=m)
    with strategy.scope():
        model = tfpipe.PipelinedModel(helpers.mlp_layers(), input_shape=(None, 8))
        model.compile(optimizer="sgd", loss="mse", **kwargs)
    return model


def test_batch_size_not_divisible_by_microbatches():
    x, y = helpers.regression_data(n=60)
    model = _compiled(m=8)
    with pytest.raises(ValueError, match=r"batch size 30 is not divisible by "
                                         r"num_microbatches=8.*multiple of 8 \(e\.g\. 32\)"):
        model.fit(x, y, batch_size=30, verbose=0)
    with pytest.raises(ValueError, match="batch size 30"):
        model.evaluate(x, y, batch_size=30, verbose=0)
    with pytest.raises(ValueError, match="batch size 30"):
        model.predict(x, batch_size=30, verbose=0)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(30, drop_remainder=True)
    with pytest.raises(ValueError, match="batch size 30"):
        model.fit(dataset, verbose=0)
    with pytest.raises(ValueError, match="fit validation: batch size 20"):
        model.fit(x, y, batch_size=32, validation_data=(x, y), validation_batch_size=20,
                  verbose=0)


def test_keras_default_batch_size_checked():
    x, y = helpers.regression_data(n=64)
    with pytest.raises(ValueError, match="batch size 32 is not divisible by num_microbatches=3"):
        _compiled(m=3).fit(x, y, verbose=0)  # Keras' default batch_size is 32


def test_more_stages_than_devices():
    strategy = tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"])
    with strategy.scope():
        with pytest.raises(ValueError, match=r"3 stages but the strategy has only 2 stage slots on 2 devices"):
            tfpipe.PipelinedModel([keras.layers.Dense(2) for _ in range(3)])


def test_empty_stage():
    with tfpipe.PipelineStrategy().scope():
        with pytest.raises(ValueError, match="Stage 1 .* empty Sequential"):
            tfpipe.PipelinedModel([keras.layers.Dense(2), keras.Sequential([])])
        with pytest.raises(ValueError, match="Stage 0 is empty"):
            tfpipe.PipelinedModel([None, keras.layers.Dense(2)])
        with pytest.raises(ValueError, match="stages is empty"):
            tfpipe.PipelinedModel([])


@pytest.mark.parametrize("balance, message", [
    ([2, 2, 1], r"sums to 5 but the model has 4 layers"),
    ([2, 0, 2], r"gives stage 1 no layers"),
    ([1, 1, 1, 1, 0], r"gives stage 4 no layers"),
    (4, r"must be a list of layer counts"),
])
def test_bad_balance(balance, message):
    ref = helpers.reference(helpers.mlp_layers(), (8,))
    with tfpipe.PipelineStrategy().scope():
        with pytest.raises(ValueError, match=message):
            tfpipe.PipelinedModel.from_model(ref, balance=balance)


def test_balance_with_more_stages_than_devices():
    ref = helpers.reference(helpers.mlp_layers(), (8,))
    with tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"]).scope():
        with pytest.raises(ValueError, match="asks for 4 stages but the strategy has 2 devices"):
            tfpipe.PipelinedModel.from_model(ref, balance=[1, 1, 1, 1])


def test_unknown_schedule_and_recompute_names():
    with pytest.raises(ValueError, match=r"Unknown schedule 'gpipee'.*\['gpipe', '1f1b', 'interleaved'\]"):
        tfpipe.PipelineStrategy(schedule="gpipee")
    with pytest.raises(ValueError, match=r"Unknown recompute mode 'sometimes'.*'always'"):
        tfpipe.PipelineStrategy(recompute="sometimes")
    with tfpipe.PipelineStrategy().scope():
        with pytest.raises(ValueError, match="Unknown recompute mode 'yes'"):
            tfpipe.PipelinedModel([keras.layers.Dense(2)], recompute="yes")


@pytest.mark.parametrize("device", ["/CPU:9", "/GPU:0", "/device:TPU:0", "CPU0:x"])
def test_device_that_does_not_exist(device):
    with pytest.raises(ValueError, match=r"Device .* (does not exist|is not a valid)"):
        tfpipe.PipelineStrategy(devices=["/CPU:0", device])


def test_bad_num_microbatches():
    for bad in (0, -2, 2.5, "4"):
        with pytest.raises(ValueError, match="num_microbatches must be a positive integer"):
            tfpipe.PipelineStrategy(num_microbatches=bad)


def test_unsupported_loss_reduction():
    with pytest.raises(ValueError, match=r"reduction='sum_over_batch_size'.*"
                                         r"got \['mean_with_sample_weight'\]"):
        strategy = tfpipe.PipelineStrategy(num_microbatches=2)
        with strategy.scope():
            model = tfpipe.PipelinedModel(helpers.mlp_layers(), input_shape=(None, 8))
            model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(
                reduction="mean_with_sample_weight"))


def test_jit_compile_true_rejected():
    strategy = tfpipe.PipelineStrategy(num_microbatches=2)
    with strategy.scope():
        model = tfpipe.PipelinedModel(helpers.mlp_layers(), input_shape=(None, 8))
        with pytest.raises(ValueError, match="jit_compile=False"):
            model.compile(optimizer="sgd", loss="mse", jit_compile=True)


def test_prebuilt_stage_on_wrong_device():
    layer = keras.layers.Dense(2)
    layer.build((None, 3))  # on CPU:0
    with tfpipe.PipelineStrategy().scope():
        with pytest.raises(ValueError, match=r"Stage 1 .* was built before PipelinedModel "
                                             r"could place it.*from_model"):
            tfpipe.PipelinedModel([keras.layers.Dense(3), layer], input_shape=(None, 3))


def test_other_strategy_in_scope():
    with tf.distribute.OneDeviceStrategy("/CPU:0").scope():
        with pytest.raises(ValueError, match="must be created under a tfpipe.PipelineStrategy"):
            tfpipe.PipelinedModel([keras.layers.Dense(2)])


def test_from_model_rejects_shared_layers_and_non_keras_models():
    # DAGs (skips, branches) are cut; a layer called twice cannot be.
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    model = keras.Model(inputs, keras.layers.Add()([shared(inputs), shared(inputs)]))
    with tfpipe.PipelineStrategy().scope():
        with pytest.raises(ValueError, match="layer 'shared' is called at more than one node"):
            tfpipe.PipelinedModel.from_model(model, balance=[1, 1, 1])
        with pytest.raises(ValueError, match="needs a keras.Sequential or functional"):
            tfpipe.PipelinedModel.from_model(keras.layers.Dense(2))


def test_lazy_build_from_generator_explains_fix():
    def gen():
        while True:
            yield np.ones((8, 8), "float32"), np.ones((8, 3), "float32")
    strategy = tfpipe.PipelineStrategy(num_microbatches=2)
    with strategy.scope():
        model = tfpipe.PipelinedModel(helpers.mlp_layers())
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"pass input_shape=\(None, \.\.\.\)"):
        model.fit(gen(), steps_per_epoch=1, verbose=0)
