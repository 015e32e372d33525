"""A user's compile and data, taken as plain Keras takes them:

- a keras-hub Task's own `compile` defaults ("auto" optimizer, loss and
  metrics) resolve as on the Task itself: the same history keys and weights;
- a `MultiOptimizer` made before the strategy scope (its inner optimizers
  captured the default strategy) trains as plain Keras, every slot on its
  variable's stage device;
- `compile(jit_compile=True)` on two devices with the execution left to
  tfpipe compiles each stage (stage functions, `model.execution` says so);
  pinned to another execution it is refused;
- a data set smaller than one batch trains as the same rows as arrays do;
- Keras optimizer options (a moving average, accumulated gradients) train as
  plain Keras, their variables on the stage's device.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe import placement
from tfpipe_tests import helpers

TOL = 1e-5
DEVICES = ["/CPU:0", "/CPU:1"]


def _albert_classifier():
    keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is not installed")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.AlbertBackbone(
        vocabulary_size=32, num_layers=2, num_heads=2, num_groups=1, num_inner_repetitions=1,
        embedding_dim=8, hidden_dim=16, intermediate_dim=16, max_sequence_length=8)
    return keras_hub.models.AlbertTextClassifier(backbone=backbone, num_classes=3,
                                                 preprocessor=None, dropout=0.0)


def test_a_keras_hub_tasks_compile_defaults_are_honoured(tmp_path):
    """`compile(optimizer="sgd")`: the Task's "auto" loss and its default
    metric (sparse_categorical_accuracy), as on the Task itself; saved and
    loaded, it evaluates the same (no warning about the Task's own compile)."""
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(1, 32, (16, 8)).astype("int32"),
         "segment_ids": np.zeros((16, 8), "int32"), "padding_mask": np.ones((16, 8), "int32")}
    y = rng.integers(0, 3, 16)
    plain = _albert_classifier()
    plain.compile(optimizer="sgd")
    expected = plain.fit(x, y, batch_size=8, shuffle=False, verbose=0).history
    task = _albert_classifier()
    with tfpipe.PipelineStrategy(num_microbatches=2, devices=DEVICES).scope():
        pipelined = tfpipe.PipelinedModel.from_model(task)
        pipelined.compile(optimizer="sgd")
    history = pipelined.fit(x, y, batch_size=8, shuffle=False, verbose=0).history
    assert sorted(history) == sorted(expected) == ["loss", "sparse_categorical_accuracy"]
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)
    assert helpers.max_abs_diff(plain.get_weights(), task.get_weights()) < TOL
    path = str(tmp_path / "task.keras")
    pipelined.save(path)
    with tfpipe.PipelineStrategy(num_microbatches=2, devices=DEVICES).scope(), \
            warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        loaded = tfpipe.load_model(path)
    assert loaded.evaluate(x, y, verbose=0, return_dict=True) == \
        pipelined.evaluate(x, y, verbose=0, return_dict=True)


def _two_layer_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(8, activation="relu", name="encoder")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="head", activation="softmax")(h))


def _multi_optimizer():
    optimizers = keras.optimizers.OptimizerMap(keras.optimizers.SGD(0.1))
    optimizers["head/.*"] = keras.optimizers.Adam(0.01)
    return keras.optimizers.MultiOptimizer(optimizers)


def _classes(n=16):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8)).astype("float32"), rng.integers(0, 3, n)


def test_a_multi_optimizer_made_before_the_scope_trains_as_plain_keras():
    x, y = _classes()
    plain = _two_layer_model()
    plain.compile(optimizer=_multi_optimizer(), loss="sparse_categorical_crossentropy")
    plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    model, optimizer = _two_layer_model(), _multi_optimizer()  # made outside any scope
    with tfpipe.PipelineStrategy(num_microbatches=2, devices=DEVICES).scope():
        pipelined = tfpipe.PipelinedModel.from_model(model, balance=[1, 1])
        pipelined.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    pipelined.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert helpers.max_abs_diff(plain.get_weights(), model.get_weights()) < TOL
    slots = [v for v in optimizer.variables if "head_" in v.path]
    assert len(slots) == 4  # Adam's two slots of the head's kernel and bias
    assert not placement.misplaced_variables(slots, pipelined.stage_devices[1])


# Keras optimizer options whose per-variable work runs outside `update_step`:
# the moving average and its overwrite, the accumulated gradients.
@pytest.mark.parametrize("options", [
    {"use_ema": True, "ema_overwrite_frequency": 2},
    {"gradient_accumulation_steps": 2},
], ids=["ema", "accumulation"])
def test_optimizer_options_train_as_plain_keras(options):
    x, y = _classes()
    plain = _two_layer_model()
    plain.compile(optimizer=keras.optimizers.Adam(0.01, **options),
                  loss="sparse_categorical_crossentropy")
    plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model = _two_layer_model()
    with tfpipe.PipelineStrategy(num_microbatches=2, devices=DEVICES).scope():
        pipelined = tfpipe.PipelinedModel.from_model(model, balance=[1, 1])
        pipelined.compile(optimizer=keras.optimizers.Adam(0.01, **options),
                          loss="sparse_categorical_crossentropy")
    pipelined.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert helpers.max_abs_diff(plain.get_weights(), model.get_weights()) < TOL
    optimizer_state = [v for v in pipelined.optimizer.variables if "head_" in v.path]
    assert len(optimizer_state) == 6  # Adam's slots and the average or accumulator, x2
    assert not placement.misplaced_variables(optimizer_state, pipelined.stage_devices[1])


@pytest.mark.parametrize("execution, expected", [
    (None, "stage_functions"),
    ("unrolled", r"jit_compile=True\) on several devices .*needs execution='stage_functions'.*"
                 r"or leave it unset: tfpipe then chooses it"),
])
def test_jit_compile_with_the_execution_left_to_tfpipe_compiles_each_stage(execution, expected,
                                                                          tmp_path):
    x, y = _classes()
    model = _two_layer_model()
    with tfpipe.PipelineStrategy(num_microbatches=2, devices=DEVICES,
                                 execution=execution).scope():
        pipelined = tfpipe.PipelinedModel.from_model(model, balance=[1, 1])
        if execution is not None:
            with pytest.raises(ValueError, match=expected):
                pipelined.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                                  jit_compile=True)
            return
        pipelined.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                          jit_compile=True)
    assert pipelined.execution == expected and pipelined.trace_options.stage_xla
    lines = []
    pipelined.summary(print_fn=lines.append)
    assert "execution=stage_functions (tfpipe chose it)" in "\n".join(lines)
    plain = _two_layer_model()
    plain.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    pipelined.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert helpers.max_abs_diff(plain.get_weights(), model.get_weights()) < TOL
    path = str(tmp_path / "jit.keras")
    pipelined.save(path)  # the execution is saved unset: chosen again when loaded
    with tfpipe.PipelineStrategy(num_microbatches=2, devices=DEVICES).scope():
        loaded = tfpipe.load_model(path)
    assert loaded.execution == expected and loaded.trace_options.stage_xla
    pipelined.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    assert pipelined.execution == "unrolled"  # tfpipe's choice again without XLA


@pytest.mark.parametrize("as_dataset", [True, False])
def test_a_data_set_smaller_than_one_batch_trains_as_plain_keras(as_dataset):
    """3 rows batched at 16 with M=4: one batch of 3 rows, one micro-batch
    empty, as for the same rows as arrays."""
    x, y = _classes(3)
    data = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(16)) if as_dataset \
        else dict(x=x, y=y, batch_size=16)
    plain = _two_layer_model()
    plain.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    plain.fit(**data, shuffle=False, verbose=0)
    model = _two_layer_model()
    with tfpipe.PipelineStrategy(num_microbatches=4, devices=DEVICES).scope():
        pipelined = tfpipe.PipelinedModel.from_model(model, balance=[1, 1])
        pipelined.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    pipelined.fit(**data, shuffle=False, verbose=0)
    assert helpers.max_abs_diff(plain.get_weights(), model.get_weights()) < TOL
