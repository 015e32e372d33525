"""A step compiled as one XLA program (`compile(jit_compile=True)`) with every
stage on one logical CPU trains to plain Keras' weights, in every execution;
what XLA needs (one device, static batches for the loop) is refused with the
fix."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe import xla
from tfpipe_tests import helpers

TOL = 1e-5


def _train(ref, execution, schedule, recompute, jit, x, y, m=4, batch_size=16):
    strategy = tfpipe.PipelineStrategy(devices=["/CPU:0"], num_microbatches=m,
                                       schedule=schedule, execution=execution,
                                       recompute=recompute)
    with strategy.scope():
        model = tfpipe.PipelinedModel.from_model(helpers.twin(ref))
        model.compile(optimizer="adam", loss="mse", metrics=["mae"], jit_compile=jit)
    assert model.jit_compile is jit
    assert len(set(model.stage_devices)) == 1 and len(model.stages) == 2
    history = model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0).history
    return model, history


SLOW = pytest.mark.slow
# (execution, schedule, recompute): two stages on one CPU (Segmented cuts each
# stage of a one-device schedule in two). A pairwise table: each schedule in
# each execution and in each recompute mode, each execution in each mode it
# takes (the loop: "always"); the default suite runs the first two rows (a
# split backward in the loop, stage functions).
CASES = [
    ("loop", "zbh1/segments=2", "always"),
    ("stage_functions", "1f1b/segments=2", "except_last"),
    pytest.param("unrolled", "gpipe/segments=2", "except_last", marks=SLOW),
    pytest.param("unrolled", "1f1b/segments=2", "always", marks=SLOW),
    pytest.param("unrolled", "1f1b/segments=2", "never", marks=SLOW),
    pytest.param("unrolled", "zbh1/segments=2", "except_last", marks=SLOW),
    pytest.param("unrolled", "interleaved:2", "never", marks=SLOW),
    pytest.param("stage_functions", "gpipe/segments=2", "always", marks=SLOW),
    pytest.param("stage_functions", "gpipe/segments=2", "never", marks=SLOW),
    pytest.param("stage_functions", "zbh1/segments=2", "never", marks=SLOW),
    pytest.param("stage_functions", "interleaved:2", "except_last", marks=SLOW),
    pytest.param("loop", "gpipe/segments=2", "always", marks=SLOW),
    pytest.param("loop", "1f1b/segments=2", "always", marks=SLOW),
    pytest.param("loop", "interleaved:2", "always", marks=SLOW),
]


def _plain_keras(x, y):
    """Plain Keras' initial and trained weights and history on (x, y), once
    per test process."""
    def train():
        ref = helpers.reference(helpers.mlp_layers(), (8,))
        initial = ref.get_weights()
        ref.compile(optimizer="adam", loss="mse", metrics=["mae"])
        history = ref.fit(x, y, batch_size=16, shuffle=False, verbose=0).history
        return dict(initial=initial, weights=ref.get_weights(), history=history)
    return helpers.plain_reference(("xla", len(x)), train)


def _data_plain_and_ref():
    """48 rows (3 Adam steps of batch 16), plain Keras' run on them, and a
    fresh model at plain Keras' initial weights."""
    x, y = helpers.regression_data(n=48)
    plain = _plain_keras(x, y)
    ref = helpers.reference(helpers.mlp_layers(), (8,))
    ref.set_weights(plain["initial"])
    return x, y, plain, ref


@pytest.mark.parametrize("execution,schedule,recompute", CASES)
def test_xla_step_trains_like_plain_keras(execution, schedule, recompute):
    # 48 rows / batch 16 = 3 Adam steps of M = 4 micro-batches. (That the step
    # without XLA trains like plain Keras is test_exactness'.)
    x, y, plain, ref = _data_plain_and_ref()
    compiled, h_xla = _train(ref, execution, schedule, recompute, True, x, y)
    assert helpers.max_abs_diff(plain["weights"], helpers.stage_weights(compiled)) < TOL
    np.testing.assert_allclose(h_xla["loss"], plain["history"]["loss"], rtol=1e-5)
    np.testing.assert_allclose(h_xla["mae"], plain["history"]["mae"], rtol=1e-5)


@SLOW
def test_xla_unrolled_takes_a_ragged_last_batch():
    # 44 rows / batch 16: the last batch has 12 rows (3 per micro-batch); the
    # unrolled step slices with sizes XLA knows, so it compiles once more.
    x, y = helpers.regression_data(n=44)
    ref = helpers.reference(helpers.mlp_layers(), (8,))
    plain, _ = _train(ref, "unrolled", "1f1b/segments=2", "except_last", False, x, y)
    compiled, _ = _train(ref, "unrolled", "1f1b/segments=2", "except_last", True, x, y)
    assert helpers.max_abs_diff(helpers.stage_weights(plain),
                                helpers.stage_weights(compiled)) < TOL


def _dataset(n, batch, drop_remainder):
    x, y = helpers.regression_data(n=n)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=drop_remainder)


# (x, batch_size, M) -> what static_batch_problem says (None: nothing).
STATIC_BATCH = [
    (lambda: _dataset(48, 16, True), None, 4, None),
    (lambda: _dataset(48, 16, False), None, 4, "batch dimension is None"),
    (lambda: _dataset(48, 6, True), None, 4, "6 rows, not a multiple of 4"),
    (lambda: helpers.regression_data(n=48)[0], 16, 4, None),
    (lambda: helpers.regression_data(n=44)[0], 16, 4, "last batch of 12 rows"),
    (lambda: helpers.regression_data(n=48)[0], 6, 4, "batch_size=6 is not a multiple of 4"),
    (lambda: helpers.regression_data(n=64)[0], None, 4, None),  # Keras' 32
    (lambda: {"a": np.zeros((40, 2))}, None, 4, "last batch of 8 rows"),
    (lambda: (row for row in range(3)), None, 4, None),  # a generator: unknown
]


@pytest.mark.parametrize("make_x,batch_size,m,expected", STATIC_BATCH)
def test_static_batch_problem(make_x, batch_size, m, expected):
    problem = xla.static_batch_problem(make_x(), batch_size, m)
    if expected is None:
        assert problem is None
    else:
        assert expected in problem


def _one_device_model(execution, devices=("/CPU:0",), schedule="1f1b/segments=2"):
    strategy = tfpipe.PipelineStrategy(devices=list(devices), num_microbatches=4,
                                       schedule=schedule, execution=execution)
    with strategy.scope():
        return tfpipe.PipelinedModel.from_model(
            helpers.reference(helpers.mlp_layers(), (8,)))


def test_loop_under_xla_refuses_a_ragged_batch_with_the_fix():
    model = _one_device_model("loop")
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    x, y = helpers.regression_data(n=44)
    with pytest.raises(ValueError, match=r"fit: execution='loop' under jit_compile=True.*"
                                         r"last batch of 12 rows.*drop_remainder=True"):
        model.fit(x, y, batch_size=16, verbose=0)
    with pytest.raises(ValueError, match=r"evaluate: .*batch dimension is None"):
        model.evaluate(_dataset(48, 16, False), verbose=0)


# devices, schedule -> accepted?
JIT_PLACEMENTS = [
    (("/CPU:0",), "1f1b/segments=2", True),
    (("/CPU:0",), "interleaved:2", True),
    (("/CPU:0", "/CPU:1"), "1f1b", False),
]


@pytest.mark.parametrize("devices,schedule,accepted", JIT_PLACEMENTS)
def test_jit_compile_only_when_every_stage_is_on_one_device(devices, schedule, accepted):
    model = _one_device_model("unrolled", devices, schedule)
    if accepted:
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        assert model.jit_compile is True
    else:
        with pytest.raises(ValueError, match=r"jit_compile=True\) on several devices "
                                             r"\(\['/device:CPU:0', '/device:CPU:1'\]\).*"
                                             r"needs execution='stage_functions'.*or use "
                                             r"jit_compile=False"):
            model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    model.compile(optimizer="sgd", loss="mse")  # "auto" stays off
    assert model.jit_compile is False
    assert isinstance(model, keras.Model)


@pytest.mark.parametrize("loaded_devices, execution, whole, per_stage", [
    (("/CPU:0",), None, True, False),
    (("/CPU:0", "/CPU:1"), None, False, False),
    (("/CPU:0", "/CPU:1"), "stage_functions", False, True),
])
def test_a_saved_jit_compile_is_kept_where_it_applies(tmp_path, loaded_devices, execution,
                                                      whole, per_stage):
    """Saved with XLA on one device: loaded on one device it keeps the whole
    step's XLA; cut again for two devices (tfpipe.load_model) it compiles each
    stage with stage functions, and runs without XLA in another execution, as
    compile allows."""
    model = _one_device_model("unrolled")
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    path = str(tmp_path / "xla.keras")
    model.save(path)
    with tfpipe.PipelineStrategy(devices=list(loaded_devices), schedule="1f1b/segments=2",
                                 num_microbatches=4, execution=execution).scope():
        loaded = tfpipe.load_model(path)
    assert loaded.jit_compile is whole
    assert loaded.trace_options.stage_xla is per_stage


# Several devices: each stage function its own XLA program on its own device
# (`tfpipe.xla.stage_xla`), against plain Keras without XLA. A row per
# schedule family and recompute mode; interleaved puts two stages on a device.
PER_STAGE = [
    ("gpipe", "always", ["/CPU:0", "/CPU:1"]),
    ("1f1b", "except_last", ["/CPU:0", "/CPU:1"]),
    pytest.param("zbh1", "never", ["/CPU:0", "/CPU:1"], marks=SLOW),
    pytest.param("interleaved", "except_last", ["/CPU:0", "/CPU:1"], marks=SLOW),
]


@pytest.mark.parametrize("schedule, recompute, devices", PER_STAGE)
def test_per_stage_xla_on_several_devices_trains_like_plain_keras(schedule, recompute, devices):
    x, y, plain, ref = _data_plain_and_ref()
    strategy = tfpipe.PipelineStrategy(devices=devices, num_microbatches=4, schedule=schedule,
                                       execution="stage_functions", recompute=recompute)
    with strategy.scope():
        model = tfpipe.PipelinedModel.from_model(helpers.twin(ref))
        model.compile(optimizer="adam", loss="mse", metrics=["mae"], jit_compile=True)
    calls = tfpipe.testing.StageCalls()
    model.set_trace_options(observer=calls)
    assert model.trace_options.stage_xla and model.jit_compile is False  # not one program
    history = model.fit(x, y, batch_size=16, shuffle=False, verbose=0).history
    assert calls.per_stage and [calls.in_xla[k] for k in range(len(calls.per_stage))] == \
        calls.per_stage  # every stage call traced inside its XLA program
    assert helpers.max_abs_diff(plain["weights"], helpers.stage_weights(model)) < TOL
    np.testing.assert_allclose(history["loss"], plain["history"]["loss"], rtol=1e-5)


def test_auto_jit_compile_on_cpus_leaves_the_stages_uncompiled():
    """Keras' "auto" means XLA on GPUs only; on logical CPUs nothing is compiled."""
    with tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"], num_microbatches=2,
                                 execution="stage_functions").scope():
        model = tfpipe.PipelinedModel(helpers.mlp_layers()[:2], input_shape=(None, 8))
        model.compile(optimizer="sgd", loss="mse")
    assert not model.trace_options.stage_xla and model.jit_compile is False
    assert xla.stage_xla("auto", ["/GPU:0", "/GPU:1"], True) == (False, True)
    assert xla.stage_xla("auto", ["/GPU:0", "/GPU:1"], False) == (False, False)


def test_per_stage_xla_on_a_softmax_classifier_with_a_nested_model():
    """A model tfpipe did not write: a nested functional block, a softmax head
    and Keras' default crossentropy (its hidden logits), under per-stage XLA."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 10)).astype("float32")
    y = rng.integers(0, 4, 48)

    def make():
        keras.utils.set_random_seed(0)
        inner_in = keras.Input((16,))
        block = keras.Model(inner_in, keras.layers.Dense(16, activation="relu")(
            keras.layers.LayerNormalization()(inner_in)), name="block")
        inputs = keras.Input((10,))
        h = block(keras.layers.Dense(16, activation="relu")(inputs))
        return keras.Model(inputs, keras.layers.Dense(4, activation="softmax")(
            keras.layers.Dense(16, activation="tanh")(h)))

    plain = make()
    plain.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    expected = plain.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"]
    model = make()
    with tfpipe.PipelineStrategy(num_microbatches=4, schedule="1f1b", devices=["/CPU:0", "/CPU:1"],
                                 execution="stage_functions").scope():
        pipelined = tfpipe.PipelinedModel.from_model(model)
        pipelined.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                          jit_compile=True)
    history = pipelined.fit(x, y, batch_size=16, shuffle=False, verbose=0).history
    assert pipelined.trace_options.stage_xla
    assert helpers.max_abs_diff(plain.get_weights(), model.get_weights()) < TOL
    np.testing.assert_allclose(history["loss"], expected, rtol=1e-5)


_EMBEDDING_XLA_STEPS = """
import re, tensorflow as tf, tfpipe, keras
tfpipe.testing.use_logical_cpus(1)
from models import transformer_lm
with tfpipe.PipelineStrategy(devices=["/CPU:0"], num_microbatches=2, recompute="never",
                             execution={execution!r}).scope():
    model = tfpipe.PipelinedModel.from_model(transformer_lm.transformer_lm(
        num_layers=1, width=16, num_heads=2, seq_len=8))
    model.compile(optimizer="adam", jit_compile=True,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
tokens = tf.zeros((8, 8), tf.int32)
model.fit(tokens, tokens, batch_size=4, epochs=1, verbose=0)
print("trained")
"""


@pytest.mark.parametrize("execution", ["stage_functions", pytest.param("unrolled", marks=SLOW)])
def test_an_xla_step_with_an_embedding_compiles_once(execution):
    # The embedding's IndexedSlices gradient left the stage function's call
    # with a dense_shape XLA could not see as a constant: the optimizer's
    # segment sum then made every weight a compile-time constant, and the step
    # recompiled at every step (3-5 s a step on a small transformer). TF's log
    # of each XLA compilation is the only sign short of timing.
    done = helpers.run_child(["-c", _EMBEDDING_XLA_STEPS.format(execution=execution)], 300,
                             env={"TF_CPP_MIN_LOG_LEVEL": "0",
                                  "TF_CPP_VMODULE": "device_compiler=1"})
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr[-3000:]
    compiles = done.stderr.count("Compilation of XLA executable")
    assert compiles == 1, f"{compiles} XLA compilations over 2 steps"
