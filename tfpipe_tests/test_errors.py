"""Bad input gets a ValueError that names the argument, the value and the fix.

One table: each row makes something wrong and checks the message.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe_tests import helpers


def _mlp_model(m=2, **strategy_kwargs):
    with tfpipe.PipelineStrategy(num_microbatches=m, **strategy_kwargs).scope():
        return tfpipe.PipelinedModel(helpers.mlp_layers(), input_shape=(None, 8))


def _fit(model, x=None, y=None, **kwargs):
    if x is None:
        x, y = helpers.regression_data(n=32)
    return model.fit(x, y, batch_size=kwargs.pop("batch_size", 16), verbose=0, **kwargs)


def more_stages_than_devices():
    with tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"]).scope():
        tfpipe.PipelinedModel([keras.layers.Dense(2) for _ in range(3)])


def empty_sequential_stage():
    with tfpipe.PipelineStrategy().scope():
        tfpipe.PipelinedModel([keras.layers.Dense(2), keras.Sequential([])])


def none_stage():
    with tfpipe.PipelineStrategy().scope():
        tfpipe.PipelinedModel([None, keras.layers.Dense(2)])


def no_stages():
    with tfpipe.PipelineStrategy().scope():
        tfpipe.PipelinedModel([])


def bad_balance(balance):
    def run():
        with tfpipe.PipelineStrategy().scope():
            tfpipe.PipelinedModel.from_model(helpers.reference(helpers.mlp_layers(), (8,)),
                                             balance=balance)
    return run


def balance_over_devices():
    with tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"]).scope():
        tfpipe.PipelinedModel.from_model(helpers.reference(helpers.mlp_layers(), (8,)),
                                         balance=[1, 1, 1, 1])


def unknown_balance_method():
    with tfpipe.PipelineStrategy().scope():
        tfpipe.PipelinedModel.from_model(helpers.reference(helpers.mlp_layers(), (8,)),
                                         balance="speed")


def loss_with_reduction_none():
    model = _mlp_model()
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="none"))
    _fit(model)


def loss_returning_a_scalar():
    def total_squared_error(y_true, y_pred):  # one number for the whole batch
        return keras.ops.sum(keras.ops.square(y_true - y_pred))
    model = _mlp_model(m=4)
    model.compile(optimizer="sgd", loss=total_squared_error)
    _fit(model)


def variables_without_gradient():
    # The second output has no loss: its head gets no gradient.
    inputs = keras.Input((8,))
    h = keras.layers.Dense(4)(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(3, name="used")(h),
                                 keras.layers.Dense(2, name="unused_head")(h)])
    with tfpipe.PipelineStrategy(num_microbatches=2).scope():
        pipelined = tfpipe.PipelinedModel.from_model(model, balance=[1, 2])
        pipelined.compile(optimizer="sgd", loss=["mse", None])
    x, y = helpers.regression_data(n=32)
    pipelined.fit(x, y, batch_size=16, verbose=0)


def stop_gradient_before_a_stage():
    with tfpipe.PipelineStrategy(num_microbatches=2).scope():
        model = tfpipe.PipelinedModel(
            [keras.layers.Dense(4, name="cut_off"),
             keras.Sequential([keras.layers.Lambda(tf.stop_gradient), keras.layers.Dense(3)])],
            input_shape=(None, 8))
        model.compile(optimizer="sgd", loss="mse")
    _fit(model)


def masked_losses_under_1f1b():
    # Two compiled losses, one averaged over a mask, and a schedule that
    # starts backward passes before every forward ran: refused.
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(10, 4, mask_zero=True)(inputs)
    a = keras.layers.Dense(3, activation="softmax", name="tokens")(h)
    b = keras.layers.Dense(1, name="value")(keras.layers.Flatten()(h))
    model = keras.Model(inputs, [a, b])
    with tfpipe.PipelineStrategy(num_microbatches=2, schedule="1f1b").scope():
        pipelined = tfpipe.PipelinedModel.from_model(model, balance=[2, 2])
        pipelined.compile(optimizer="sgd", loss=["sparse_categorical_crossentropy", "mse"])
    x = np.ones((8, 5), "int32")
    pipelined.fit(x, [np.zeros((8, 5)), np.zeros((8, 1))], batch_size=8, verbose=0)


def renorm_with_deferred_batch_norm():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
                              keras.layers.BatchNormalization(renorm=True, name="rn")])
    with tfpipe.PipelineStrategy(num_microbatches=2).scope():
        tfpipe.PipelinedModel.from_model(model, balance=[1, 1])


def batch_smaller_than_microbatches():
    model = _mlp_model(m=8)
    model.compile(optimizer="sgd", loss="mse")
    _fit(model, batch_size=4)


def validation_batch_smaller_than_microbatches():
    model = _mlp_model(m=8)
    model.compile(optimizer="sgd", loss="mse")
    x, y = helpers.regression_data(n=32)
    model.fit(x, y, batch_size=16, validation_data=(x, y), validation_batch_size=4, verbose=0)


def missing_labels():
    model = _mlp_model()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(helpers.regression_data(n=32)[0], batch_size=16, verbose=0)


def saving_stages_that_share_a_layer():
    shared = keras.layers.Dense(8, name="shared")
    with tfpipe.PipelineStrategy().scope():
        model = tfpipe.PipelinedModel([keras.Sequential([shared]), keras.Sequential([shared])],
                                      input_shape=(None, 8))
    model.get_config()


def jit_compile_on_a_pipeline():
    # Pinned to an execution that cannot compile each stage (left unset,
    # tfpipe chooses stage functions: test_user_setups).
    _mlp_model(execution="unrolled").compile(optimizer="sgd", loss="mse", jit_compile=True)


def other_strategy_in_scope():
    with tf.distribute.OneDeviceStrategy("/CPU:0").scope():
        tfpipe.PipelinedModel([keras.layers.Dense(2)])


def from_model_of_a_layer():
    with tfpipe.PipelineStrategy().scope():
        tfpipe.PipelinedModel.from_model(keras.layers.Dense(2))


def lazy_build_from_a_generator():
    def gen():
        while True:
            yield np.ones((8, 8), "float32"), np.ones((8, 3), "float32")
    with tfpipe.PipelineStrategy(num_microbatches=2).scope():
        model = tfpipe.PipelinedModel(helpers.mlp_layers())
        model.compile(optimizer="sgd", loss="mse")
    model.fit(gen(), steps_per_epoch=1, verbose=0)


def stages_with_mismatched_shapes():
    # Stage 0 ends in (None, 2, 2); stage 1 starts with a Conv2D (rank 4).
    with tfpipe.PipelineStrategy(num_microbatches=2).scope():
        tfpipe.PipelinedModel(
            [keras.Sequential([keras.layers.Dense(4), keras.layers.Reshape((2, 2))],
                              name="to_2x2"),
             keras.Sequential([keras.layers.Conv2D(3, 2)], name="conv")],
            input_shape=(None, 8))


def dict_into_a_single_input_stack():
    model = _mlp_model()
    model.compile(optimizer="sgd", loss="mse")
    x, y = helpers.regression_data(n=32)
    model.fit({"features": x}, y, batch_size=16, verbose=0)


def fit_under_another_strategy():
    model = _mlp_model()
    model.compile(optimizer="sgd", loss="mse")
    x, y = helpers.regression_data(n=32)
    with tf.distribute.OneDeviceStrategy("/CPU:0").scope():
        model.fit(x, y, batch_size=16, verbose=0)


def unbatched_dataset():
    model = _mlp_model()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices(helpers.regression_data(n=32)), verbose=0)


def dataset_batches_smaller_than_microbatches():
    # The batch dimension is not static: the first batch's rows are read.
    model = _mlp_model(m=4)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(tf.data.Dataset.from_tensor_slices(helpers.regression_data(n=32)).batch(2),
              verbose=0)


def predict_on_no_rows():
    _mlp_model().predict(np.zeros((0, 8), "float32"), verbose=0)


def strategy(**kwargs):
    return lambda: tfpipe.PipelineStrategy(**kwargs)


def model_argument(**kwargs):
    def run():
        with tfpipe.PipelineStrategy().scope():
            tfpipe.PipelinedModel([keras.layers.Dense(2)], **kwargs)
    return run


def loop_with_recompute_never():
    tfpipe.PipelineStrategy(execution="loop", recompute="never")


ERRORS = [
    ("more_stages_than_devices", more_stages_than_devices,
     r"3 stages but the strategy has only 2 stage slots on 2 devices"),
    ("empty_sequential_stage", empty_sequential_stage, r"Stage 1 .* empty Sequential"),
    ("none_stage", none_stage, r"Stage 0 is empty"),
    ("no_stages", no_stages, r"stages is empty"),
    ("balance_sum", bad_balance([2, 2, 1]), r"sums to 5 but the model has 4 layers"),
    ("balance_zero", bad_balance([2, 0, 2]), r"gives stage 1 no layers"),
    ("balance_scalar", bad_balance(4), r"must be a list of layer counts"),
    ("balance_over_devices", balance_over_devices,
     r"asks for 4 stages but the strategy has 2 devices"),
    ("balance_method", unknown_balance_method, r"Unknown balance 'speed'"),
    ("schedule_name", strategy(schedule="gpipee"),
     r"Unknown schedule 'gpipee'.*\['gpipe', '1f1b', 'interleaved', 'zbh1', 'zbv'\]"),
    ("recompute_name", strategy(recompute="sometimes"), r"Unknown recompute mode 'sometimes'"),
    ("model_recompute_name", model_argument(recompute="yes"), r"Unknown recompute mode 'yes'"),
    ("execution_name", strategy(execution="graph"), r"Unknown execution 'graph'"),
    # launch.train takes --execution=auto; the library's "auto" is None.
    ("execution_auto", strategy(execution="auto"),
     r"Unknown execution 'auto'.*leave it unset \(None\) for tfpipe's choice"),
    ("batch_norm_name", strategy(batch_norm="sync"), r"Unknown batch_norm 'sync'.*'deferred'"),
    ("loop_with_recompute_never", loop_with_recompute_never,
     r"execution='loop'.*needs recompute='always'"),
    ("num_microbatches_zero", strategy(num_microbatches=0),
     r"num_microbatches must be a positive integer, got 0"),
    ("num_microbatches_float", strategy(num_microbatches=2.5),
     r"num_microbatches must be a positive integer, got 2.5"),
    ("device_missing", strategy(devices=["/CPU:0", "/CPU:9"]), r"Device '/CPU:9' does not exist"),
    ("device_gpu", strategy(devices=["/GPU:0"]), r"Device '/GPU:0' does not exist"),
    ("device_garbled", strategy(devices=["CPU0:x"]), r"Device 'CPU0:x' .*(not a valid|does not)"),
    ("loss_reduction_none", loss_with_reduction_none,
     r"reduction='none'.*Use reduction='sum_over_batch_size'"),
    ("loss_returning_a_scalar", loss_returning_a_scalar,
     r"'total_squared_error' returned a single number for its whole batch.*per-sample values"),
    ("variables_without_gradient", variables_without_gradient,
     r"No gradient reaches 2 trainable variable\(s\).*stage 1.*unused_head/kernel.*"
     r"trainable=False"),
    ("stop_gradient_before_a_stage", stop_gradient_before_a_stage,
     r"No gradient reaches 2 trainable variable\(s\).*stage 0.*cut_off/kernel"),
    ("masked_losses_under_1f1b", masked_losses_under_1f1b,
     r"averaged over the elements its mask.*several compiled losses.*schedule='gpipe'"),
    ("renorm_deferred", renorm_with_deferred_batch_norm,
     r"Layer 'rn' \(stage 1\) uses renorm=True.*batch_norm='plain'"),
    ("batch_smaller_than_m", batch_smaller_than_microbatches,
     r"fit: batch size 4 is smaller than num_microbatches=8.*at least 8"),
    ("validation_batch_smaller_than_m", validation_batch_smaller_than_microbatches,
     r"fit validation: batch size 4 is smaller than num_microbatches=8"),
    ("missing_labels", missing_labels, r"compiled with a loss but the data has no labels"),
    ("save_shared_stages", saving_stages_that_share_a_layer,
     r"layer 'shared' is shared by stages 0 and 1.*from_model"),
    ("jit_compile", jit_compile_on_a_pipeline, r"jit_compile=False"),
    ("other_strategy", other_strategy_in_scope, r"must be created under a tfpipe.PipelineStrategy"),
    ("from_model_of_a_layer", from_model_of_a_layer, r"needs a keras.Sequential or functional"),
    ("lazy_build_from_a_generator", lazy_build_from_a_generator,
     r"pass input_shape=\(None, \.\.\.\)"),
    ("stages_with_mismatched_shapes", stages_with_mismatched_shapes,
     r"Stage 1 \('conv'\) cannot take the output of stage 0 \('to_2x2'\): shape "
     r"\(None, 2, 2\)"),
    ("dict_into_a_single_input_stack", dict_into_a_single_input_stack,
     r"fit: x is a dict \(keys \['features'\]\) but the pipeline takes one input"),
    ("unbatched_dataset", unbatched_dataset,
     r"fit: the tf.data.Dataset yields single examples \(x of shape \(8,\)\), not batches: "
     r"the model takes \(None, 8\), batch dimension first. Batch it: dataset.batch"),
    ("dataset_batches_smaller_than_m", dataset_batches_smaller_than_microbatches,
     r"fit: batch size 2 is smaller than num_microbatches=4"),
    ("predict_on_no_rows", predict_on_no_rows, r"predict: x has no rows"),
    ("fit_under_another_strategy", fit_under_another_strategy,
     r"fit: called under OneDeviceStrategy's scope.*PipelineStrategy"),
]


@pytest.mark.parametrize("make_error, message", [
    *[pytest.param(f, m, id=name) for name, f, m in ERRORS],
])
def test_bad_input_raises_a_clear_value_error(make_error, message):
    with pytest.raises(ValueError, match=message):
        make_error()
