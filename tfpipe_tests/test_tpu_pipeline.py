"""A PipelinedModel under a user's TPUStrategy, traced on CPU (`tfpipe.testing.tpu_strategy`
makes a real TPUStrategy over cores that do not exist): the whole replica program is
built, every stage's work lands on its logical core, and `fit` gets as far as the
missing TPU kernel. Nothing here runs on a TPU (`benchmarks/tpu_check.py` does)."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from benchmarks import tpu_trace
import tfpipe
from tfpipe import _internal

# Ops the replica program may leave on no core: the input split and its shape
# arithmetic, the global row count's all-reduce, the optimizer's step counter
# (Keras syncs it with an AllToAll), the loop's While and TensorList set-up.
RESIDUE = {"StridedSlice", "Cast", "ReadVariableOp", "AssignVariableOp", "FloorDiv",
           "FloorMod", "Mul", "AddV2", "Pack", "AllToAll", "CrossReplicaSum", "Split",
           "ConcatV2", "Reshape", "GatherV2", "TensorListReserve", "While", "Shape"}


def _units(stages):
    """A classifier from outside tfpipe's own tests: softmax head, Keras' default
    sparse cross-entropy, a nested Sequential block; 3 units (2 stages) or 4."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,), name="features")
    h = keras.layers.Dense(16, activation="relu", name="d0")(inputs)
    h = keras.Sequential([keras.layers.Dense(16, activation="tanh", name="d1")],
                         name="block")(h)
    if stages == 4:
        h = keras.layers.Dense(16, activation="relu", name="d2")(h)
    outputs = keras.layers.Dense(4, activation="softmax", name="head")(h)
    return keras.Model(inputs, outputs, name="classifier")


def _pipelined(strategy, stages, **settings):
    plain = _units(stages)
    with strategy.scope():
        balance = [2, 1] if stages == 2 else [1] * stages
        model = tfpipe.PipelinedModel.from_model(plain, balance=balance, **settings)
        model.compile(optimizer=keras.optimizers.AdamW(weight_decay=0.01),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return plain, model


def _specs(global_batch):
    return tf.TensorSpec((global_batch, 8)), tf.TensorSpec((global_batch,), tf.int32)


# (K cores per replica, R replicas, stages, schedule, execution, recompute): K x R,
# the schedules, executions and recompute modes pairwise; interleaved puts two
# stages on each core.
PROGRAMS = [
    (2, 1, 2, "gpipe", "unrolled", "never"),
    (4, 1, 4, "1f1b", "unrolled", "always"),
    (2, 4, 2, "zbh1", "unrolled", "except_last"),
    (4, 2, 4, "gpipe", "stage_functions", "except_last"),
    (2, 4, 2, "gpipe", "loop", "always"),
    (4, 1, 4, "1f1b", "loop", "always"),
    (2, 2, 4, "interleaved", "unrolled", "always"),
]


@pytest.mark.parametrize("k, r, stages, schedule, execution, recompute", PROGRAMS)
def test_every_stage_runs_on_its_core(k, r, stages, schedule, execution, recompute):
    strategy = tfpipe.testing.tpu_strategy("v3-8", cores_per_replica=k, num_replicas=r)
    plain, model = _pipelined(strategy, stages, num_microbatches=4, schedule=schedule,
                              execution=execution, recompute=recompute)
    cores = [tfpipe.schedules.get(schedule).stage_device(i, k) for i in range(stages)]
    assert [str(d) for d in model.stage_devices] == [f"TPU logical core {c}" for c in cores]
    placed = tpu_trace.read(tpu_trace.trace_train_step(model, *_specs(8 * r)))
    assert (placed.num_replicas, placed.cores_per_replica) == (r, k)
    # Each stage variable is mirrored over the R replicas, named by its path,
    # and read, decayed and updated only on its stage's core; so are its slots.
    homes = {v.path: cores[i] for i, stage in enumerate(model.stages)
             for v in stage.trainable_weights}
    assert len(homes) == 2 * len(plain.layers[1:]) and set(homes.values()) == set(range(k))
    for path, home in homes.items():
        variable = next(v for v in model.trainable_variables if v.path == path)
        assert len(_internal.local_copies(variable)) == r
        handles = placed.variable_handles(path)
        assert len(handles) == 3 and all(c == [home] for c in handles.values()), handles
    metrics = {n: c for n, c in placed.handles.items() if "/total" in n or "/count" in n}
    assert len(metrics) == 4 and all(c == [k - 1] for c in metrics.values()), metrics
    off_core = [n for n, c in placed.handles.items() if None in c]
    assert all(n.endswith("/iteration") for n in off_core), off_core
    # Forward and backward matmuls on every core, none elsewhere; the gradient
    # all-reduce per stage on its core (one more, the global row count, on none).
    assert set(placed.matmuls) == set(range(k)), placed.matmuls
    assert all(placed.all_reduces[c] >= 1 for c in range(k)), placed.all_reduces
    assert placed.all_reduces[None] <= 1
    assert placed.unplaced_work == []
    assert set(placed.unplaced) <= RESIDUE, placed.unplaced


def test_the_reader_sees_plain_keras_leave_its_updates_off_core():
    """The same check on plain Keras under the strategy: its optimizer runs in no
    core's scope (why tfpipe places it), so the reader must report it."""
    strategy = tfpipe.testing.tpu_strategy("v3-8", cores_per_replica=2)
    with strategy.scope():
        plain = _units(2)
        plain.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    placed = tpu_trace.read(tpu_trace.trace_train_step(plain, *_specs(8)))
    momentum = [c for n, c in placed.handles.items() if n.endswith("_momentum")]
    assert momentum and all(c == [None] for c in momentum)
    assert placed.matmuls[None] > 0


def test_fit_evaluate_predict_trace_to_the_missing_tpu_kernel():
    """Keras' whole fit/evaluate/predict trace is done; only running it needs a TPU."""
    strategy = tfpipe.testing.tpu_strategy("v3-8", cores_per_replica=2, num_replicas=2)
    _, model = _pipelined(strategy, 2, num_microbatches=4)
    x = np.random.default_rng(0).random((32, 8), dtype=np.float32)
    y = np.arange(32) % 4
    for call in (lambda: model.fit(x, y, batch_size=16, epochs=1, verbose=0),
                 lambda: model.evaluate(x, y, batch_size=16, verbose=0),
                 lambda: model.predict(x, batch_size=16, verbose=0)):
        with pytest.raises(tf.errors.InvalidArgumentError, match="'TPUReplicatedInput'"):
            call()


def test_weights_leave_through_to_keras_and_save_load(tmp_path):
    strategy = tfpipe.testing.tpu_strategy("v3-8", cores_per_replica=2)
    plain, model = _pipelined(strategy, 2, num_microbatches=2)
    expected = [w.numpy() for w in plain.weights]
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(expected, model.to_keras().weights))
    path = os.fspath(tmp_path / "tpu.keras")
    model.save(path)
    with strategy.scope():
        loaded = tfpipe.load_model(path)
    assert [str(d) for d in loaded.stage_devices] == ["TPU logical core 0", "TPU logical core 1"]
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(expected, loaded.weights))


def _spmd_model():
    _pipelined(tfpipe.testing.tpu_strategy("v3-8", 2, spmd_xla_partitioning=True), 2)


def _jit_model():
    strategy = tfpipe.testing.tpu_strategy("v3-8", 2)
    _, model = _pipelined(strategy, 2)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", jit_compile=True)


def _three_stages_on_two_cores(cut):
    def make():
        strategy = tfpipe.testing.tpu_strategy("v3-8", 2)
        with strategy.scope():
            if cut:
                tfpipe.PipelinedModel.from_model(_units(4), balance=[2, 1, 1])
            else:
                tfpipe.PipelinedModel([keras.layers.Dense(4) for _ in range(3)])
    return make


def _fit(data, **kwargs):
    def run():
        strategy = tfpipe.testing.tpu_strategy("v3-8", 2, num_replicas=2)
        _, model = _pipelined(strategy, 2, num_microbatches=4)
        x = np.zeros((48, 8), np.float32)
        y = np.zeros((48,), np.int32)
        inputs = {"arrays": (x, y),
                  "ragged_dataset": (tf.data.Dataset.from_tensor_slices((x, y)).batch(16),)}
        model.fit(*inputs[data], epochs=1, verbose=0, **kwargs)
    return run


def _timed(call):
    """tfpipe.plan or tfpipe.timeline.record_step on a model under a TPUStrategy."""
    def run():
        _, model = _pipelined(tfpipe.testing.tpu_strategy("v3-8", 2), 2, num_microbatches=4)
        x, y = np.zeros((16, 8), np.float32), np.zeros((16,), np.int32)
        model.build((None, 8))
        if call == "plan":
            tfpipe.plan(model, 16, 4)
        else:
            tfpipe.timeline.record_step(model, x, y)
    return run


# what the user did -> the error they get
REFUSALS = [
    (_spmd_model, r"experimental_spmd_xla_partitioning=True.*Make the TPUStrategy without it"),
    (_jit_model, r"jit_compile=True\) under a TPUStrategy.*Leave jit_compile unset"),
    (_three_stages_on_two_cores(cut=False), r"3 stages but the TPUStrategy gives each replica "
                                            r"2 core\(s\), so at most 2 stages fit"),
    (_three_stages_on_two_cores(cut=True), r"balance \[2, 1, 1\] asks for 3 stages but the "
                                           r"strategy has 2 devices; use at most 2 stages"),
    (_fit("arrays", batch_size=12), r"fit: a TPUStrategy \(one XLA program per replica\) needs "
                                    r"every batch.*num_replicas x num_microbatches = 2 x 4 = 8, "
                                    r"but batch_size=12 is not a multiple of 8"),
    (_fit("arrays", batch_size=32), r"48 examples in batches of 32 leave a last batch of 16"),
    (_fit("ragged_dataset"), r"batch dimension is None.*drop_remainder=True"),
    # Timing from outside the replica program would time the host's CPU instead.
    (_timed("plan"), r"tfpipe.plan\('pipelined_classifier'\): a TPUStrategy's logical cores run "
                     r"only inside its replica program.*devices=\[\.\.\.\]"),
    (_timed("record_step"), r"record_step\('pipelined_classifier'\): a TPUStrategy's logical "
                            r"cores run only inside its replica program"),
]


@pytest.mark.parametrize("make, message", REFUSALS)
def test_refusals(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_model_saved_with_xla_loads_under_a_tpu_strategy_without_it(tmp_path):
    """jit_compile=True is refused under a TPUStrategy; a file saved with it (from
    one device, where it compiles the whole step) loads there compiled without it."""
    with tfpipe.PipelineStrategy(devices=["/CPU:0"]).scope():
        model = tfpipe.PipelinedModel.from_model(_units(2))
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      jit_compile=True)
    path = os.fspath(tmp_path / "xla.keras")
    model.save(path)
    # One core per replica: where one device alone would take jit_compile=True.
    with tfpipe.testing.tpu_strategy("v3-8", cores_per_replica=1, num_replicas=2).scope():
        loaded = tfpipe.load_model(path)
    assert loaded.compiled and len(loaded.stages) == 1
    assert _internal.jit_compile(loaded) is False
