"""Stages on other processes: tfpipe.cluster, placement by task, StepWatchdog.

A process connected to a cluster stays connected, so everything that
connects runs in a child process (`python -m tfpipe_tests.test_cluster
SCENARIO`, the functions of CHILDREN below) with a time limit, in its own
session, killed as a group if it overruns; the child prints one JSON line
that the test reads. Workers are `launch.local_cluster.LocalCluster` processes on
127.0.0.1. After each child the test checks that none of its workers is left.

The in-process tests (the probe table against tiny sockets, device-name
checks on local devices, cluster specs from TF_CONFIG) bind only 127.0.0.1
and start no TensorFlow server.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from launch import local_cluster
import tfpipe
from tfpipe import cluster as cluster_lib
from tfpipe import probe
from tfpipe import placement
from tfpipe import watchdog
from tfpipe_tests import helpers

REPO = pathlib.Path(__file__).resolve().parents[1]
CHILD_TIMEOUT = 240  # seconds; a child with 2 workers takes 20-60 s on 2 busy cores


# -- the probe: what a task's port says -------------------------------------------------


class _Listener:
    """A socket on 127.0.0.1 that does `behaviour` with each connection:
    "settings" answers an HTTP/2 SETTINGS frame, "mute" accepts and says
    nothing, "close" accepts and hangs up, "backlog" never accepts at all."""

    def __init__(self, behaviour):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.behaviour, self.held = behaviour, []
        if behaviour != "backlog":
            threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        self.held.append(conn)
        if self.behaviour == "settings":
            conn.recv(64)
            conn.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        elif self.behaviour == "close":
            conn.close()

    def close(self):
        for c in self.held:
            c.close()
        self.sock.close()


def _closed_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


@pytest.mark.parametrize("behaviour, expected", [
    ("settings", "ok"),      # a live gRPC server's first frame
    ("mute", "silent"),      # a SIGSTOPped server: accepted, never answered
    ("backlog", "silent"),   # stopped before accepting: the kernel's backlog accepts
    ("close", "dead"),       # hangs up without a frame
    (None, "dead"),          # nothing listens: refused
])
def test_probe_task(behaviour, expected):
    listener = _Listener(behaviour) if behaviour else None
    address = listener.address if listener else _closed_port()
    start = time.monotonic()
    try:
        assert probe.probe_task(address, timeout_s=1.0) == expected
    finally:
        if listener:
            listener.close()
    assert time.monotonic() - start < 3.0  # bounded by the probe's timeout


# -- device names: job, replica and task count ---------------------------------------


@pytest.mark.parametrize("a, b, same", [
    ("/device:CPU:1", "/job:localhost/replica:0/task:0/device:CPU:1", True),
    ("/CPU:1", "/device:CPU:1", True),
    ("/job:worker/task:1/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0", True),
    ("/job:worker/task:1/device:CPU:0", "/job:worker/replica:0/task:0/device:CPU:0", False),
    ("/job:worker/task:0/device:CPU:0", "/device:CPU:0", False),  # a worker, not this process
    ("/job:worker/task:0/device:CPU:0", "/job:ps/task:0/device:CPU:0", False),
    ("/device:CPU:0", "/device:CPU:1", False),
])
def test_same_device(a, b, same):
    assert placement.same_device(a, b) is same
    assert placement.same_device(b, a) is same


def test_a_variable_on_another_task_is_misplaced():
    # Same type and index (CPU:1), another task: reported (type and index alone pass it).
    with tf.device("/CPU:1"):
        v = keras.Variable(1.0, name="stage1_kernel")
    assert placement.misplaced_variables([v], "/device:CPU:1") == []
    assert placement.misplaced_variables([v], "/job:worker/task:1/device:CPU:1") == [
        "stage1_kernel on /job:localhost/replica:0/task:0/device:CPU:1"]


# -- cluster specs --------------------------------------------------------------------


def test_cluster_spec_from_tf_config(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}}))
    spec = cluster_lib.cluster_spec("tf_config")
    assert spec.as_dict() == {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}
    assert cluster_lib.worker_devices(spec) == ["/job:worker/task:0/device:CPU:0",
                                                "/job:worker/task:1/device:CPU:0"]
    assert cluster_lib.task_addresses(spec) == {
        "/job:worker/task:0": "10.0.0.1:2222", "/job:worker/task:1": "10.0.0.2:2222"}


@pytest.mark.parametrize("cluster, env, message", [
    (None, None, "TF_CONFIG environment variable, which is not set"),
    ({"ps": ["127.0.0.1:1"]}, None, "has no 'worker' job"),
    (["127.0.0.1:1"], None, "cluster must be a tf.train.ClusterSpec"),
    (None, {"cluster": {"chief": ["127.0.0.1:1"]}}, "has no 'worker' job"),
])
def test_cluster_spec_errors(monkeypatch, cluster, env, message):
    if env is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", json.dumps(env))
    with pytest.raises(ValueError, match=message):
        cluster_lib.cluster_spec(cluster)


@pytest.mark.parametrize("kwargs, message", [
    (dict(timeout_s=0), r"timeout_s=...\) must be a number of seconds > 0, got 0"),
    (dict(timeout_s=5, probe_timeout_s=-1), r"probe_timeout_s=...\) must be"),
    (dict(timeout_s=5), "has not connected. Connect first, or pass cluster="),
])
def test_watchdog_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tfpipe.StepWatchdog(**kwargs)


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_local_cluster_needs_a_count(n):
    with pytest.raises(ValueError, match=r"LocalCluster\(num_workers\) needs an integer >= 1"):
        local_cluster.LocalCluster(n)


# -- connected children -------------------------------------------------------------


def _run_child(scenario, timeout=CHILD_TIMEOUT):
    """Runs CHILDREN[scenario] in a child process; returns (exit code, its JSON
    result or None, stderr, seconds). Kills the child's group and any worker
    it reported if it overruns or leaves them."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfpipe_tests.test_cluster", scenario], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"child {scenario} overran {timeout} s; stderr:\n{err[-3000:]}")
    finally:
        elapsed = time.monotonic() - start
    result = None
    pids = []
    for line in out.splitlines():
        if line.startswith("WORKERS "):
            pids = json.loads(line[len("WORKERS "):])
        elif line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    time.sleep(1.0)  # a worker whose parent went away exits within 0.5 s
    left = [p for p in pids if helpers.process_alive(p)]
    for p in left:  # never leave one behind, even when the assertion below fails
        os.kill(p, signal.SIGKILL)
    assert pids and not left, f"workers left behind: {left} of {pids}"
    return proc.returncode, result, err, elapsed


def _child_model(devices):
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])
    with tfpipe.PipelineStrategy(devices=devices, num_microbatches=2).scope():
        model = tfpipe.PipelinedModel.from_model(plain, balance=[2, 1])
        model.compile(optimizer="adam", loss="mse")
    return model


def _child_data(n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    return x, (x[:, :3] * 2.0).astype("float32")


def _error(fn):
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def child_placement():
    """Connected to 2 workers: the device errors, the stage placement by task,
    and the weights against the same pipeline on 2 local logical CPUs."""
    tfpipe.testing.use_logical_cpus(2)
    with local_cluster.LocalCluster(2, time_limit_s=CHILD_TIMEOUT) as local:
        print("WORKERS " + json.dumps(local.pids), flush=True)
        cluster_lib.connect(local)
        workers = local.worker_devices()
        x, y = _child_data()
        remote = _child_model(workers)
        remote.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        on_local = _child_model(["/CPU:0", "/CPU:1"])
        on_local.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        slots = {k: [s for s in remote.optimizer.variables for v in st.trainable_variables
                     if s.path.endswith(v.path.replace("/", "_") + "_momentum")
                     or s.path.endswith(v.path.replace("/", "_") + "_velocity")]
                 for k, st in enumerate(remote.stages)}
        result = {
            "devices": [str(d) for d in remote.stage_devices],
            "misplaced": [placement.misplaced_variables(st.weights + slots[k], d)
                          for k, (st, d) in enumerate(zip(remote.stages, workers))],
            # Stage 1's variables checked against task 0's CPU:0: same type and index.
            "stage1_on_task0": placement.misplaced_variables(
                remote.stages[1].weights, workers[0]),
            "slots": [len(slots[k]) for k in range(2)],
            "max_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(
                remote.get_weights(), on_local.get_weights())),
            "default_error": _error(lambda: tfpipe.PipelineStrategy()),
            "ambiguous_error": _error(lambda: tfpipe.PipelineStrategy(
                devices=["/job:worker/device:CPU:0", "/job:worker/task:1/device:CPU:0"])),
            "local_ok": list(tfpipe.PipelineStrategy(devices=["/CPU:1"]).devices),
        }
    print("RESULT " + json.dumps(result), flush=True)


def child_kill():
    """A pipeline on 2 workers; at training step 4, worker 1 is killed. Prints
    the kill's time, then whatever ends the run."""
    with local_cluster.LocalCluster(2, time_limit_s=CHILD_TIMEOUT) as local:
        print("WORKERS " + json.dumps(local.pids), flush=True)
        cluster_lib.connect(local)
        model = _child_model(local.worker_devices())
        x, y = _child_data(256)

        class Fault(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 3:
                    os.kill(local.pids[1], signal.SIGKILL)
                    fault_at.append(time.monotonic())
                    print(f"FAULT {fault_at[0]}", file=sys.stderr, flush=True)

        fault_at = []
        try:
            model.fit(x, y, batch_size=16, epochs=50, verbose=0, callbacks=[Fault()])
        except tf.errors.OpError as err:
            result = {"error": type(err).__name__, "after_fault_s": time.monotonic() - fault_at[0],
                      "message": cluster_lib.describe_unavailable(err, local, 1.0)}
        else:
            result = {"error": None}
    print("RESULT " + json.dumps(result), flush=True)


# A worker frozen (SIGSTOP) under the StepWatchdog: test_trainer_watchdog_then_resume
# below, through launch.train --step_timeout (which passes the cluster to
# tfpipe.StepWatchdog as a user would).
CHILDREN = {
    "placement": child_placement,
    "kill": child_kill,
}


@pytest.mark.slow
def test_stages_on_two_workers():
    code, result, err, seconds = _run_child("placement")
    print(f"placement child: {seconds:.1f} s")
    assert code == 0, err[-3000:]
    assert result["devices"] == ["/job:worker/replica:0/task:0/device:CPU:0",
                                 "/job:worker/replica:0/task:1/device:CPU:0"]
    assert result["misplaced"] == [[], []]
    assert result["slots"] == [8, 4]  # Adam's 2 slots for each kernel and bias
    assert result["stage1_on_task0"] and all(
        "task:1" in line for line in result["stage1_on_task0"])
    assert result["max_diff"] == 0.0  # bit-identical to the local pipeline
    assert "PipelineStrategy() on a connected client" in result["default_error"]
    assert "devices=tfpipe.cluster.worker_devices()" in result["default_error"]
    assert "'/job:worker/device:CPU:0' is ambiguous" in result["ambiguous_error"]
    assert "'/job:worker/replica:0/task:0/device:CPU:0'" in result["ambiguous_error"]
    assert result["local_ok"] == ["/device:CPU:1"]


@pytest.mark.slow
def test_a_dead_worker_is_named_at_once():
    code, result, err, seconds = _run_child("kill")
    print(f"kill child: {seconds:.1f} s; result {result}")
    assert code == 0, err[-3000:]
    assert result["error"] == "UnavailableError"
    assert "/job:worker/task:1 (127.0.0.1:" in result["message"]
    assert "refuses connections: the process is gone" in result["message"]
    assert "TensorFlow said: " in result["message"] and (
        "Connection" in result["message"] or "Socket" in result["message"])
    assert "task:0" not in result["message"].split("TensorFlow said")[0]
    assert result["after_fault_s"] < 3.0  # at once: the next step fails


# -- launch.train --cluster -------------------------------------------------------------

RUN = ["--stages=2", "--microbatches=2", "--batch_size=32", "--epochs=2",
       "--steps_per_epoch=40", "--checkpoint_every=5", "--notimeline"]


class _Trainer:
    """`python -m launch.train *flags` in its own session; stdout read line by line."""

    def __init__(self, *flags):
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launch.train", *RUN, *flags], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
        self.lines, self.pids, self.err = [], [], []
        self._readers = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=lambda: self.err.append(self.proc.stderr.read()),
                                          daemon=True)]
        for t in self._readers:
            t.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if ", pid " in line:
                self.pids.append(int(line.rsplit(", pid ", 1)[1].rstrip(")\n")))

    def finish(self, timeout=CHILD_TIMEOUT):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            pytest.fail(f"launch.train overran {timeout} s")
        finally:
            for t in self._readers:
                t.join(10)
            time.sleep(1.0)
            left = [p for p in self.pids if helpers.process_alive(p)]
            for p in left:
                os.kill(p, signal.SIGKILL)
            assert not left, f"workers left behind: {left} of {self.pids}"
        return (self.proc.returncode, "".join(self.lines), "".join(self.err),
                time.monotonic() - self.start)


def _history(model_dir):
    return json.loads((model_dir / "history.json").read_text())


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The same run on 2 logical CPUs: its history (once per pytest run)."""
    def make(model_dir):
        code, out, err, _ = _Trainer("--logical_cpus=2", f"--model_dir={model_dir}").finish()
        assert code == 0, err[-3000:]
    return _history(helpers.shared_directory(tmp_path_factory, "cluster_reference_run", make))


@pytest.mark.slow
def test_trainer_on_a_local_cluster_matches_logical_cpus(tmp_path, reference_run):
    code, out, err, seconds = _Trainer("--cluster=local:2", "--step_timeout=30",
                                       f"--model_dir={tmp_path}").finish()
    print(f"--cluster=local:2 run: {seconds:.1f} s")
    assert code == 0, err[-3000:]
    assert "--cluster=local:2: this process is the client; stage devices:" in out
    for k in range(2):
        assert f"  stage {k} on /job:worker/replica:0/task:{k}/device:CPU:0 (127.0.0.1:" in out
    assert _history(tmp_path) == reference_run  # every step's loss and metrics, exactly


@pytest.mark.slow
def test_trainer_watchdog_then_resume(tmp_path, reference_run):
    timeout = 8.0
    run = _Trainer("--cluster=local:2", f"--step_timeout={timeout:g}", f"--model_dir={tmp_path}")
    manifest = tmp_path / "checkpoints" / "ckpt-10.manifest.json"
    deadline = time.monotonic() + CHILD_TIMEOUT
    while not manifest.exists() and run.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(run.pids) == 2 and run.proc.poll() is None, "".join(run.lines)
    os.kill(run.pids[1], signal.SIGSTOP)
    frozen = time.monotonic()
    code, out, err, _ = run.finish()
    ended = time.monotonic() - frozen
    print(f"watchdog: exit {ended:.1f} s after SIGSTOP (timeout {timeout:g} s)")
    assert code == 4 == watchdog.EXIT_CODE, err[-3000:]
    line = [l for l in err.splitlines() if "tfpipe.StepWatchdog: " in l][-1]
    assert line.startswith("launch.train: lost a worker: tfpipe.StepWatchdog: ")
    assert line.endswith(f"The newest committed checkpoint is {tmp_path}/checkpoints/ckpt-10; "
                         f"--resume on every worker continues from it.")
    assert "/job:worker/task:1 (127.0.0.1:" in line and "process is stopped" in line
    assert "/job:worker/task:0" not in line
    assert "has not finished after" in line and "exit code 4" in line
    stalled = float(line.split("has not finished after ")[1].split(" s")[0])
    assert timeout <= stalled <= timeout + 5.0
    assert timeout <= ended <= timeout + 8.0
    # The last checkpoint is intact: the run continues, on 2 logical CPUs, exactly.
    code, out, err, _ = _Trainer("--logical_cpus=2", "--resume",
                                 f"--model_dir={tmp_path}").finish()
    assert code == 0, err[-3000:]
    assert "Resuming from" in out
    assert _history(tmp_path) == reference_run


@pytest.mark.slow
def test_sigterm_to_the_client_of_a_cluster_saves_stops_its_workers_and_resumes(
        tmp_path, reference_run):
    """The client writes the checkpoints: it stops as a single process does
    (the step, a save, exit 143), and no worker outlives it."""
    run = _Trainer("--cluster=local:2", "--step_timeout=30", f"--model_dir={tmp_path}")
    manifest = tmp_path / "checkpoints" / "ckpt-10.manifest.json"
    deadline = time.monotonic() + CHILD_TIMEOUT
    while not manifest.exists() and run.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(run.pids) == 2 and run.proc.poll() is None, "".join(run.lines)
    os.kill(run.proc.pid, signal.SIGTERM)
    code, out, err, _ = run.finish()  # also: no worker left behind
    assert code == 143, err[-3000:]
    # (TensorFlow's teardown may add "Failed to remove function remotely" lines
    # after it: the workers are gone by then.)
    last = [l for l in err.splitlines() if l.startswith("launch.train: stopped:")][-1]
    assert last.startswith("launch.train: stopped: SIGTERM after step ") and \
        "--resume continues the run from there." in last
    step = int(last.split("after step ")[1].split(":")[0])
    assert (tmp_path / "checkpoints" / f"ckpt-{step}.manifest.json").exists()
    code, out, err, _ = _Trainer("--logical_cpus=2", "--resume",
                                 f"--model_dir={tmp_path}").finish()
    assert code == 0, err[-3000:]
    assert f"(step {step})." in out
    assert _history(tmp_path) == reference_run


if __name__ == "__main__":
    CHILDREN[sys.argv[1]]()
