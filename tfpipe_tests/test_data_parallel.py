"""Data parallel x pipeline: `PipelineStrategy(num_replicas=R)` on a device grid.

Row r of the grid is replica r's pipeline, column k holds stage k of every
replica. What a user relies on: the grid they asked for, each stage's
variables and optimizer slots mirrored over its column, and training that
equals plain Keras on the global batch (history, weights, evaluate, predict).
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe import _internal
from tfpipe_tests import helpers

CPU = [f"/device:CPU:{i}" for i in range(4)]


@pytest.mark.parametrize("devices, num_replicas, grid", [
    (None, 2, [[CPU[0], CPU[1]], [CPU[2], CPU[3]]]),
    (None, 4, [[CPU[0]], [CPU[1]], [CPU[2]], [CPU[3]]]),
    (None, None, [CPU]),
    ([[CPU[0], CPU[2]], [CPU[1], CPU[3]]], None, [[CPU[0], CPU[2]], [CPU[1], CPU[3]]]),
    ([[CPU[0], CPU[1]]], 1, [[CPU[0], CPU[1]]]),
    (["cpu:3", "cpu:2"], 2, [[CPU[3]], [CPU[2]]]),
])
def test_device_grid(devices, num_replicas, grid):
    strategy = tfpipe.PipelineStrategy(devices=devices, num_replicas=num_replicas)
    assert [list(row) for row in strategy.device_grid] == grid
    assert strategy.num_replicas == strategy.num_replicas_in_sync == len(grid)
    assert list(strategy.devices) == grid[0]


@pytest.mark.parametrize("devices, num_replicas, message", [
    (None, 3, "num_replicas=3 must be a positive int that divides the 4 devices"),
    (None, 0, "use one of [1, 2, 4]"),
    ([[CPU[0], CPU[1]], [CPU[2]]], None, "same number of devices, at least one; got rows of [2, 1]"),
    ([[CPU[0]], [CPU[1]]], 3, "num_replicas=3 but devices has 2 rows"),
    ([[CPU[0], CPU[1]], CPU[2]], None, "mixes names and lists"),
    ([[CPU[0], CPU[1]], [CPU[1], CPU[2]]], None, "must be distinct"),
    ([[CPU[0]], ["/device:CPU:9"]], None, "'/device:CPU:9' does not exist"),
])
def test_device_grid_errors(devices, num_replicas, message):
    with pytest.raises(ValueError) as err:
        tfpipe.PipelineStrategy(devices=devices, num_replicas=num_replicas)
    assert message in str(err.value)


def _classifier(seed=0):
    """A softmax classifier with the hidden-logits head, a weight and an
    activity regulariser (a call loss): the model people bring."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", kernel_regularizer="l2")(inputs)
    h = keras.layers.Dense(16, activation="tanh", activity_regularizer="l2")(h)
    h = keras.layers.Dense(16, activation="relu")(h)
    outputs = keras.layers.Dense(3, activation="softmax")(h)
    return keras.Model(inputs, outputs)


def _data(n=84):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = rng.integers(0, 3, n)
    sample_weight = rng.uniform(size=n).astype("float32")
    return x, y, sample_weight


def _compile(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])


def _train_both(strategy, model_fn=_classifier, batch_size=16):
    x, y, sw = _data()
    plain = model_fn()
    with strategy.scope():
        pipelined = tfpipe.PipelinedModel.from_model(helpers.twin(plain))
        _compile(pipelined)
    _compile(plain)
    # 84 rows in batches of 16: the last batch (4 rows) is ragged.
    kwargs = dict(sample_weight=sw, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return (plain, plain.fit(x, y, **kwargs).history,
            pipelined, pipelined.fit(x, y, **kwargs).history)


def test_stage_variables_and_slots_are_mirrored_over_their_column():
    strategy = tfpipe.PipelineStrategy(num_replicas=2, num_microbatches=2)
    with strategy.scope():
        model = tfpipe.PipelinedModel.from_model(_classifier(), balance=[2, 2])
        _compile(model)
    columns = {0: [CPU[0], CPU[2]], 1: [CPU[1], CPU[3]]}
    slots = {id(v): [s for s in model.optimizer.variables if s.path.split("/", 1)[-1] in (
                         f"{v.path.replace('/', '_')}_momentum",
                         f"{v.path.replace('/', '_')}_velocity")]
             for v in model.trainable_variables}
    for k, stage in enumerate(model.stages):
        for v in stage.trainable_variables:
            for var in [v] + slots[id(v)]:
                devices = [c.device for c in _internal.local_copies(var)]
                assert [d.split("/")[-1] for d in devices] == [
                    c.split("/")[-1] for c in columns[k]], var.path
        assert all(len(slots[id(v)]) == 2 for v in stage.trainable_variables)


def _masked_tagger(activity=None):
    """Embedding(mask_zero=True) + a softmax per token: the loss averages over
    the valid tokens, a count summed over the replicas."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(10, 8, mask_zero=True)(inputs)
    h = keras.layers.Dense(8, activation="tanh", activity_regularizer=activity)(h)
    outputs = keras.layers.Dense(4, activation="softmax")(h)
    return keras.Model(inputs, outputs)


def _tokens(n=84):
    rng = np.random.default_rng(0)
    return rng.integers(0, 10, (n, 6)).astype("int32"), rng.integers(0, 4, (n, 6)), None


MODELS = {"classifier": (_classifier, _data), "masked_tagger": (_masked_tagger, _tokens)}


def _plain(name):
    """Plain Keras on the global batch (2 epochs): initial and trained weights,
    history, evaluate, predict; trained once per test process."""
    def train():
        make, data = MODELS[name]
        plain = make()
        _compile(plain)
        x, y, sw = data()
        return helpers.fit_and_record(plain, x, y, sw, epochs=2)
    return helpers.plain_reference(("data_parallel", name), train)


# Two replicas of a 2-device pipeline against plain Keras on the global batch:
# gradients and metrics summed over the replicas in each execution, and (the
# masked tagger) the loss divided by every replica's count of valid tokens,
# which each schedule seeds before its first backward. Pairwise: each model in
# each execution, each schedule once at least; the default suite runs the first.
@pytest.mark.parametrize("model, schedule, execution", [
    ("classifier", "gpipe", "unrolled"),
    pytest.param("classifier", "1f1b", "loop", marks=pytest.mark.slow),
    pytest.param("classifier", "interleaved", "stage_functions", marks=pytest.mark.slow),
    pytest.param("masked_tagger", "1f1b", "unrolled", marks=pytest.mark.slow),
    pytest.param("masked_tagger", "gpipe", "loop", marks=pytest.mark.slow),
    pytest.param("masked_tagger", "zbh1", "stage_functions", marks=pytest.mark.slow),
])
def test_two_replicas_of_two_stages_train_like_plain_keras(model, schedule, execution):
    plain = _plain(model)
    make, data = MODELS[model]
    source = make()
    source.set_weights(plain["initial"])
    strategy = tfpipe.PipelineStrategy(
        num_replicas=2, num_microbatches=2, schedule=schedule, execution=execution,
        recompute="always" if execution == "loop" else None)
    with strategy.scope():
        pipelined = tfpipe.PipelinedModel.from_model(source)
        _compile(pipelined)
    x, y, sw = data()
    # 84 rows in batches of 16: the last batch (4 rows) is ragged.
    history = pipelined.fit(x, y, sample_weight=sw, batch_size=16, epochs=2, shuffle=False,
                            verbose=0).history
    assert sorted(history) == sorted(plain["history"]) == ["accuracy", "loss"]
    for key, want in plain["history"].items():
        np.testing.assert_allclose(history[key], want, rtol=1e-5, atol=1e-6, err_msg=key)
    assert helpers.max_abs_diff(plain["weights"], helpers.stage_weights(pipelined)) < 1e-5
    np.testing.assert_allclose(pipelined.evaluate(x, y, batch_size=16, verbose=0),
                               plain["evaluate"], rtol=1e-5)
    np.testing.assert_allclose(pipelined.predict(x, batch_size=16, verbose=0),
                               plain["predict"], atol=1e-5)


# (replicas, schedule given): the schedule tfpipe chose (ZB-H1 at M = 2) falls
# back to GPipe for a masked-count loss with call losses, and says so; a given
# ZB-H1 is refused with the fix.
@pytest.mark.parametrize("replicas, schedule", [(1, None), (2, None), (1, "zbh1")])
def test_a_loss_only_gpipe_splits_makes_the_chosen_schedule_fall_back(replicas, schedule):
    x, y, _ = _tokens(32)
    plain = _masked_tagger(activity="l2")
    strategy = tfpipe.PipelineStrategy(num_replicas=replicas, num_microbatches=2,
                                       schedule=schedule)
    with strategy.scope():
        pipelined = tfpipe.PipelinedModel.from_model(helpers.twin(plain), balance=[2, 1])
        _compile(pipelined)
    assert pipelined.schedule.name == "zbh1"
    if schedule is not None:
        with pytest.raises(ValueError, match="Use schedule='gpipe'"):
            pipelined.fit(x, y, batch_size=16, verbose=0)
        return
    _compile(plain)
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    pipelined.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert helpers.max_abs_diff(plain.get_weights(), pipelined.source_model.get_weights()) < 1e-5
    assert (pipelined.schedule.name, pipelined.execution) == ("gpipe", "unrolled")
    assert ("schedule=gpipe (tfpipe chose it: the loss needs every forward before the first "
            "backward, so not zbh1)") in pipelined.pipeline_summary()


def test_masked_loss_with_call_losses_in_the_loop_names_the_fix():
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 10, (16, 6)).astype("int32"), rng.integers(0, 4, (16, 6))
    strategy = tfpipe.PipelineStrategy(num_replicas=2, num_microbatches=2,
                                       execution="loop", recompute="always")
    with strategy.scope():
        pipelined = tfpipe.PipelinedModel.from_model(_masked_tagger(activity="l2"))
        _compile(pipelined)
    with pytest.raises(ValueError, match="with data-parallel replicas the loop execution cannot "
                                         "sum it over the replicas.*Use execution='unrolled'"):
        pipelined.fit(x, y, batch_size=16, epochs=1, verbose=0)


@pytest.mark.parametrize("batch_size, message", [
    (6, "batch size 6 is split over num_replicas=2 data-parallel replicas of "
        "num_microbatches=4 micro-batches each"),
    (7, "Use a global batch size of at least 8"),
])
def test_global_batch_smaller_than_replicas_times_microbatches_is_refused(batch_size, message):
    strategy = tfpipe.PipelineStrategy(num_replicas=2, num_microbatches=4)
    with strategy.scope():
        pipelined = tfpipe.PipelinedModel.from_model(_classifier())
        _compile(pipelined)
    x, y, _ = _data()
    with pytest.raises(ValueError) as err:
        pipelined.fit(x, y, batch_size=batch_size, verbose=0)
    assert message in str(err.value)


def test_batch_normalization_under_replicas_is_refused():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(8)(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    strategy = tfpipe.PipelineStrategy(num_replicas=2)
    with strategy.scope(), pytest.raises(
            ValueError, match="Layer 'bn' .* is a BatchNormalization, and the strategy has "
                              "num_replicas=2 .*Use one replica"):
        tfpipe.PipelinedModel.from_model(model)


@pytest.mark.slow
def test_two_replicas_of_four_stages_on_eight_devices():
    """2 x 4 on 8 logical CPUs (a child process: the suite's TF has 4)."""
    script = textwrap.dedent("""
        import json, sys
        import tfpipe
        tfpipe.testing.use_logical_cpus(8)
        import numpy as np
        from tfpipe import _internal
        from tfpipe_tests import helpers, test_data_parallel as t
        out = {}
        for schedule in ("gpipe", "1f1b"):
            strategy = tfpipe.PipelineStrategy(num_replicas=2, num_microbatches=2,
                                               schedule=schedule)
            plain, ph, pipelined, h = t._train_both(strategy)
            out[schedule] = dict(
                loss=[h["loss"], ph["loss"]],
                diff=helpers.max_abs_diff(plain.get_weights(), helpers.stage_weights(pipelined)),
                columns=[[c.device[-5:] for c in _internal.local_copies(s.trainable_variables[0])]
                         for s in pipelined.stages])
        print("RESULT" + json.dumps(out))
    """)
    done = helpers.run_child(["-c", script], timeout=400)
    line = [l for l in done.stdout.splitlines() if l.startswith("RESULT")]
    assert done.returncode == 0 and line, done.stderr[-3000:]
    result = json.loads(line[0][len("RESULT"):])
    for schedule, r in result.items():
        np.testing.assert_allclose(r["loss"][0], r["loss"][1], rtol=1e-5)
        assert r["diff"] < 1e-5, (schedule, r["diff"])
        assert r["columns"] == [["CPU:0", "CPU:4"], ["CPU:1", "CPU:5"],
                                ["CPU:2", "CPU:6"], ["CPU:3", "CPU:7"]]


def test_pipeline_summary_names_every_replicas_devices():
    strategy = tfpipe.PipelineStrategy(num_replicas=2)
    with strategy.scope():
        model = tfpipe.PipelinedModel.from_model(_classifier())
    summary = model.pipeline_summary()
    assert "Data parallel: 2 replicas" in summary
    assert "r=1: ['/device:CPU:2', '/device:CPU:3']" in summary


# -- several processes: one pipeline per worker of a TF_CONFIG cluster --------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_TIMEOUT = 300  # seconds; two TensorFlow processes on 2 busy cores


def _tf_config(ports, index):
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


def _run_workers(args_of, ports, extra_env=None):
    """Starts one `python *args_of(i)` per worker with its TF_CONFIG, waits for
    all, kills every one still alive at the deadline; returns their
    CompletedProcess-like (returncode, stdout, stderr) and asserts none is left."""
    procs = [subprocess.Popen(
        [sys.executable, *args_of(i)], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=_tf_config(ports, i),
                 **(extra_env or {})))
        for i in range(len(ports))]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=CHILD_TIMEOUT)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(30)
    assert all(proc.poll() is not None for proc in procs)
    return results


_WORKER_SCRIPT = textwrap.dedent("""
    import json
    import tfpipe
    tfpipe.testing.use_logical_cpus(2)
    import tensorflow as tf
    from tfpipe import _internal
    from tfpipe_tests import helpers, test_data_parallel as t
    strategy = tfpipe.PipelineStrategy(
        num_microbatches=2,
        cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver())
    x, y, sw = t._data()
    plain = t._classifier()
    with strategy.scope():
        pipelined = tfpipe.PipelinedModel.from_model(helpers.twin(plain))
        t._compile(pipelined)
    t._compile(plain)
    kwargs = dict(sample_weight=sw, batch_size=16, epochs=2, shuffle=False, verbose=0)
    history = pipelined.fit(x, y, **kwargs).history
    expected = plain.fit(x, y, **kwargs).history
    print("RESULT" + json.dumps(dict(
        replicas=strategy.num_replicas_in_sync, history=history, expected=expected,
        diff=helpers.max_abs_diff(plain.get_weights(), helpers.stage_weights(pipelined)),
        devices=[[c.device for c in _internal.local_copies(v)]
                 for v in pipelined.stages[1].trainable_variables])))
""")


@pytest.mark.slow
def test_one_pipeline_per_worker_process_trains_like_plain_keras():
    from launch import local_cluster
    ports = local_cluster.free_ports(2)
    results = _run_workers(lambda i: ["-c", _WORKER_SCRIPT], ports)
    for index, (code, out, err) in enumerate(results):
        line = [l for l in out.splitlines() if l.startswith("RESULT")]
        assert code == 0 and line, err[-3000:]
        r = json.loads(line[0][len("RESULT"):])
        assert r["replicas"] == 2
        for key in ("loss", "accuracy"):  # every epoch, the global batch's values
            np.testing.assert_allclose(r["history"][key], r["expected"][key], rtol=1e-5)
        assert r["diff"] < 1e-5
        # Stage 1 on this worker's second device, one copy per worker process.
        assert all(d == [f"/job:worker/replica:0/task:{index}/device:CPU:1"]
                   for d in r["devices"])


_TRAIN = ["-m", "launch.train", "--stages=2", "--microbatches=2", "--batch_size=32",
          "--epochs=1", "--steps_per_epoch=6", "--max_examples=400", "--notimeline",
          "--logical_cpus=2"]


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """The `launch.train` runs the trainer rows compare with, on 4 logical CPUs:
    "full", 2 epochs of one pipeline; "part", the first epoch of the same run
    with --replicas=2 (2 x 2 in one process), checkpointed at its end. Made
    once per pytest run (`helpers.shared_directory`); the rows copy what they
    change."""
    def make(root):
        for name, more in (("full", ["--epochs=2"]), ("part", ["--epochs=1", "--replicas=2"])):
            done = helpers.run_child([*_TRAIN, "--logical_cpus=4", *more,
                                      f"--model_dir={root}/{name}"], CHILD_TIMEOUT)
            assert done.returncode == 0, done.stderr[-3000:]
    return helpers.shared_directory(tmp_path_factory, "data_parallel_trainer_runs", make)


def _steps(model_dir):
    return json.loads((model_dir / "history.json").read_text())["steps"]


def _assert_same_steps(got, expected):
    for a, b in zip(got, expected, strict=True):
        assert a["rows"] == b["rows"] == 32
        np.testing.assert_allclose([a["loss"], a["accuracy"]], [b["loss"], b["accuracy"]],
                                   rtol=1e-5)


@pytest.mark.slow
def test_trainer_with_two_replicas_in_one_process_matches_one_pipeline(trainer_runs):
    # --replicas=2 on 4 logical CPUs: every step of the first epoch equals the
    # single pipeline's.
    part = _steps(trainer_runs / "part")
    assert len(part) == 6
    _assert_same_steps(part, _steps(trainer_runs / "full")[:6])


@pytest.mark.slow
def test_trainer_with_one_replica_per_worker_matches_one_process(tmp_path, trainer_runs):
    """Each worker runs the same `launch.train --replicas=tf_config` with one
    shared --model_dir, which the chief (task 0) alone writes; every step's
    loss and accuracy equal the single-process run's."""
    from launch import local_cluster
    ports = local_cluster.free_ports(2)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    results = _run_workers(
        lambda i: [*_TRAIN, "--replicas=tf_config", f"--model_dir={tmp_path}/run"], ports,
        {"TMPDIR": str(scratch)})
    full = json.loads((trainer_runs / "full" / "history.json").read_text())
    for index, (code, out, err) in enumerate(results):
        assert code == 0, err[-3000:]
        assert (f"--replicas=tf_config: /job:worker/task:{index} is replica {index} of 2; "
                f"its pipeline runs on ['/job:worker/replica:0/task:{index}/device:CPU:0', "
                f"'/job:worker/replica:0/task:{index}/device:CPU:1']") in out
        assert f"latest checkpoint     {tmp_path}/run/checkpoints/ckpt-6" in out
    got = json.loads((tmp_path / "run" / "history.json").read_text())
    assert len(got["steps"]) == 6
    _assert_same_steps(got["steps"], full["steps"][:6])
    assert got["epochs"] == full["epochs"][:1] or np.allclose(
        [e["loss"] for e in got["epochs"]], [e["loss"] for e in full["epochs"][:1]])
    # One writer: one set of event files; the other worker's scratch folder is gone.
    assert len(list((tmp_path / "run" / "tensorboard" / "steps").iterdir())) == 1
    assert not list(scratch.glob("launch-train-*"))


@pytest.mark.slow
@pytest.mark.parametrize("resumed_with", ["--replicas=2", "--replicas=1"])
def test_trainer_resumes_a_data_parallel_run_exactly(tmp_path, trainer_runs, resumed_with):
    """A --replicas=2 run checkpointed after one epoch and resumed (with 2
    replicas again, or with one pipeline) equals the uninterrupted run: the
    mirrored variables and slots restore, and R does not change the math."""
    shutil.copytree(trainer_runs / "part", tmp_path / "part")
    done = helpers.run_child([*_TRAIN, "--logical_cpus=4", "--epochs=2", "--resume",
                              resumed_with, f"--model_dir={tmp_path}/part"], CHILD_TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Resuming from" in done.stdout
    part = _steps(tmp_path / "part")
    assert len(part) == 12
    _assert_same_steps(part, _steps(trainer_runs / "full"))


def test_a_data_parallel_model_saves_and_loads_at_another_layout(tmp_path):
    x, y, _ = _data()
    strategy = tfpipe.PipelineStrategy(num_replicas=2, num_microbatches=2)
    with strategy.scope():
        model = tfpipe.PipelinedModel.from_model(_classifier())
        _compile(model)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.save(tmp_path / "grid.keras")
    expected = model.predict(x, batch_size=16, verbose=0)
    with tfpipe.PipelineStrategy(num_microbatches=2).scope():  # one pipeline
        flat = tfpipe.load_model(tmp_path / "grid.keras")
    helpers.assert_same_predictions(flat.predict(x, batch_size=16, verbose=0), expected)
    helpers.assert_same_predictions(model.to_keras().predict(x, batch_size=16, verbose=0),
                                    expected)
    # The optimizer state came along: the next epoch is the same on both.
    kwargs = dict(batch_size=16, epochs=1, verbose=0, shuffle=False)
    np.testing.assert_allclose(flat.fit(x, y, **kwargs).history["loss"],
                               model.fit(x, y, **kwargs).history["loss"], rtol=1e-6)


@pytest.mark.parametrize("make_x, kind", [
    (lambda: np.array([["a b"]] * 8), "strings"),
    (lambda: tf.data.Dataset.from_tensor_slices(
        tf.sparse.from_dense(np.ones((8, 8), "float32"))).batch(4), "a tf.SparseTensor"),
    (lambda: tf.ragged.constant([[1.0], [2.0, 3.0]] * 4), "a tf.RaggedTensor"),
])
def test_inputs_keras_cannot_split_over_replicas_are_refused(make_x, kind):
    strategy = tfpipe.PipelineStrategy(num_replicas=2)
    with strategy.scope():
        model = tfpipe.PipelinedModel.from_model(_classifier())
        _compile(model)
    with pytest.raises(ValueError) as err:
        model.predict(make_x(), batch_size=4, verbose=0)
    assert str(err.value).startswith(
        f"predict: an input is {kind}, which Keras cannot split over the strategy's "
        f"num_replicas=2 data-parallel replicas. Use one replica (num_replicas=1)")


@pytest.mark.slow
def test_a_signal_to_one_worker_stops_every_worker_after_the_same_step(tmp_path, trainer_runs):
    """SIGTERM reaches worker 0 only (after its step 3); by one all-reduce per
    step both workers agree, each saves ckpt-3 and exits 143; resumed
    together, they finish as the uninterrupted single-process run."""
    from launch import local_cluster
    from tfpipe_tests.test_trainer_stops import _MAIN_SIGNALLED_AT
    ports = local_cluster.free_ports(2)
    shared = ["--replicas=tf_config", f"--model_dir={tmp_path}/run"]  # one folder, the chief's
    stopped = _run_workers(
        lambda i: [*(["-c", _MAIN_SIGNALLED_AT] if i == 0 else _TRAIN[:2]), *_TRAIN[2:],
                   *shared], ports, {"SIGNAL_AT": "step:3:SIGTERM"})
    for index, (code, _, err) in enumerate(stopped):
        assert code == 143, err[-3000:]
        sig = "SIGTERM" if index == 0 else "SIGTERM (to another worker)"
        assert err.splitlines()[-1] == (
            f"launch.train: stopped: {sig} after step 3: saved {tmp_path}/run/checkpoints/"
            f"ckpt-3; --resume continues the run from there.")
    ports = local_cluster.free_ports(2)
    resumed = _run_workers(lambda i: [*_TRAIN, *shared, "--resume"], ports)
    full = json.loads((trainer_runs / "full" / "history.json").read_text())
    for code, out, err in resumed:
        assert code == 0, err[-3000:]
        assert f"Resuming from {tmp_path}/run/checkpoints/ckpt-3 (step 3)." in out
    _assert_same_steps(_steps(tmp_path / "run"), full["steps"][:6])
