"""Small models and data shared by the tests; plain Keras references; child processes."""

import fcntl
import itertools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

import tfpipe


def mlp_layers():
    return [
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(3),
    ]


def cnn_layers():
    return [
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(6, 2, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(5),
    ]


def reference(layers, input_shape, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input(input_shape)] + layers)


def regression_data(n=80, features=8, outputs=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = (x[:, :outputs] * 2.0 + rng.normal(size=(n, outputs)) * 0.1).astype("float32")
    return x, y


def image_data(n=80, classes=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    return x, y


def twin(model):
    """An independent copy of `model` with the same weights (the test's
    plain reference keeps `model`; from_model shares the layers it is given)."""
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    return copy


def pipelined_copy(model, num_microbatches, recompute="except_last", balance=None,
                   devices=None, schedule="gpipe", **compile_kwargs):
    """A PipelinedModel cut from a twin of `model` (same weights), compiled."""
    strategy = tfpipe.PipelineStrategy(devices=devices, num_microbatches=num_microbatches,
                                       recompute=recompute, schedule=schedule)
    with strategy.scope():
        pipelined = tfpipe.PipelinedModel.from_model(twin(model), balance=balance)
        pipelined.compile(**compile_kwargs)
    return pipelined


# (schedule, balance of the 4-layer MLP, devices): GPipe, 1F1B and ZB-H1 put one
# stage on each of 4 devices; Interleaved(2) and ZB-V 2 stages on each of 2.
SCHEDULES = {
    "gpipe": (tfpipe.schedules.GPipe(), [1, 1, 1, 1], None),
    "1f1b": (tfpipe.schedules.OneFOneB(), [1, 1, 1, 1], None),
    "interleaved": (tfpipe.schedules.Interleaved(2), [1, 1, 1, 1], ["/CPU:0", "/CPU:1"]),
    # Zero-bubble: backward split into I and W; ZB-V runs 2 stages per device
    # in a V, so the last stage shares device 0 with the first.
    "zbh1": (tfpipe.schedules.ZeroBubbleH1(), [1, 1, 1, 1], None),
    "zbv": (tfpipe.schedules.ZeroBubbleV(), [1, 1, 1, 1], ["/CPU:0", "/CPU:1"]),
    # Recompute granularity: each of 1F1B's 2 stages re-materialised in 2 segments.
    "1f1b_segmented": (tfpipe.schedules.Segmented(tfpipe.schedules.OneFOneB(), 2),
                       [1, 1, 1, 1], ["/CPU:0", "/CPU:1"]),
}


def scheduled_copy(ref, name, m, execution, recompute, compile_kwargs, balance=None):
    """A PipelinedModel of `SCHEDULES[name]` cut from a twin of `ref`, compiled."""
    schedule, default_balance, devices = SCHEDULES[name]
    strategy = tfpipe.PipelineStrategy(devices=devices, num_microbatches=m,
                                       schedule=schedule, recompute=recompute,
                                       execution=execution)
    with strategy.scope():
        model = tfpipe.PipelinedModel.from_model(twin(ref), balance=balance or default_balance)
        model.compile(**compile_kwargs)
    return model


def stage_weights(pipelined):
    """The pipeline's weights in the order of its source model (from_model),
    else stage by stage."""
    if pipelined.source_model is not None:
        return pipelined.source_model.get_weights()
    return [w for stage in pipelined.stages for w in stage.get_weights()]


def max_abs_diff(weights_a, weights_b):
    assert len(weights_a) == len(weights_b)
    return max(float(np.max(np.abs(a - b))) for a, b in zip(weights_a, weights_b))


def assert_same_predictions(ours, theirs):
    """Two models' predictions of the same rows agree to float32 rounding.

    Not bit for bit: a matmul's rounding can depend on how many rows it
    multiplies at once, so the same weights give last-bit differences when
    the rows are cut differently (micro-batches, replicas). Measured on a
    2-core AMD EPYC: plain Keras' predictions of 16 rows against the same 16
    in two calls of 8 differ by 3e-8 on values near 0.3; on the Intel Xeon of
    earlier runs they were equal.
    """
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


# -- plain references, trained once per test process ---------------------------------

_REFERENCES = {}


def plain_reference(key, train):
    """`train()`'s result, computed the first time `key` is asked for in this
    process and returned from then on.

    For a plain-Keras reference that does not depend on the row asking for it
    (the setup, the cut, M): key it by what it does depend on (the model, its
    data and steps) and return plain values (weights, history, evaluate
    results), which no row can change. Each pytest-xdist worker is its own
    process with its own cache, so a reference is trained at most once per
    worker.
    """
    if key not in _REFERENCES:
        _REFERENCES[key] = train()
    return _REFERENCES[key]


def fit_and_record(model, x, y, sample_weight=None, epochs=1, batch_size=16):
    """A compiled model's weights before, then after `fit`, its history, and
    `evaluate` and `predict` on the same data: what an exactness row compares."""
    initial = model.get_weights()
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=batch_size,
                        epochs=epochs, shuffle=False, verbose=0).history
    return dict(initial=initial, weights=model.get_weights(), history=history,
                evaluate=model.evaluate(x, y, batch_size=batch_size, verbose=0),
                predict=model.predict(x, batch_size=batch_size, verbose=0))


def shared_directory(tmp_path_factory, name, make):
    """A directory that `make(directory)` fills once per pytest run, whichever
    process asks first: a module fixture's expensive result (a training run)
    that pytest-xdist's workers would otherwise each make (a module's tests
    are dealt to both). The others wait on a lock, then get the same
    directory; they must only read it (copy it to change it)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers of this run
    directory = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / f"{name}.done"
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            make(directory)
            done.touch()
    return directory


# -- which rows of a table the default suite runs -----------------------------------


def _values(value):
    return value if isinstance(value, tuple) else (value,)


def taking_turns(first, second, first_ids=None, second_ids=None):
    """The rows of `first` x `second` for `pytest.mark.parametrize`, with the default
    suite running max(len(first), len(second)) of them: row i pairs first[i % len]
    with second[i % len], so each value of both axes runs at least once. The other
    pairs are marked slow: CI's slow step runs the whole product. A value that is a
    tuple fills several arguments (e.g. "execution, recompute").

    Ids are "<first id>-<second id>" where `first_ids` or `second_ids` is given (a
    value without one is named by its str), otherwise pytest's own ids of the
    values (what stacked parametrize gave).
    """
    default = {(i % len(first), i % len(second))
               for i in range(max(len(first), len(second)))}
    named = first_ids is not None or second_ids is not None
    first_ids = first_ids or [None] * len(first)
    second_ids = second_ids or [None] * len(second)
    rows = []
    for a, (value_a, id_a) in enumerate(zip(first, first_ids)):
        for b, (value_b, id_b) in enumerate(zip(second, second_ids)):
            rows.append(pytest.param(
                *_values(value_a), *_values(value_b),
                id=f"{_id(value_a, id_a)}-{_id(value_b, id_b)}" if named else None,
                marks=() if (a, b) in default else pytest.mark.slow))
    return rows


def _id(value, given):
    return given if given is not None else "-".join(map(str, _values(value)))


def in_default_suite(values, default):
    """The rows `values` for `pytest.mark.parametrize`, those not in `default` marked
    slow (CI's slow step runs them)."""
    missing = [v for v in default if v not in values]
    if missing:
        raise ValueError(f"default rows {missing} are not in the table {values}")
    return [pytest.param(*_values(v), marks=() if v in default else pytest.mark.slow)
            for v in values]


def _pairs(row):
    return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}


def missing_pairs(rows, runnable_rows):
    """Pairs of values of two columns that some row of `runnable_rows` holds
    and no row of `rows` does: [] when `rows` is a pairwise table (every
    value of each column met with every value of every other column, where
    some runnable row has them together)."""
    have = set().union(*map(_pairs, rows))
    need = set().union(*map(_pairs, runnable_rows))
    return sorted(need - have, key=str)


def missing_values(rows, columns):
    """The (column, value) of `columns` (a list of each column's values) that
    no row of `rows` holds: [] when every value runs at least once."""
    return [(i, v) for i, values in enumerate(columns) for v in values
            if all(row[i] != v for row in rows)]


REPO = pathlib.Path(__file__).resolve().parents[1]


def run_child(args, timeout, env=None):
    """Runs `python ARGS` in the repository, in its own session, and returns
    its `subprocess.CompletedProcess` (with `.pid`). On overrun the whole
    process group is killed (nothing is left behind) and
    `subprocess.TimeoutExpired` is raised."""
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.pid = proc.pid
    return done


def run_device_check(module, tmp_path, *flags, env=None, timeout=900):
    """Runs a prepared device check (`benchmarks.gpu_check`, `benchmarks.tpu_check`)
    with `flags` in a child process: (the process, the JSON it wrote)."""
    out = tmp_path / "result.json"
    done = run_child(["-m", module, f"--output={out}", *flags], timeout, env=env)
    return done, json.loads(out.read_text())


def process_alive(pid):
    """Whether `pid` exists and is not a zombie (an exited child not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
