"""`launch.train --replicas=tf_config` workers never hang on a gone peer, and
keep one --model_dir for the cluster.

Real worker processes on 127.0.0.1 (`test_data_parallel._run_workers`: each
with its TF_CONFIG, all killed at the deadline). A worker whose peer never
comes, dies or freezes ends within --step_timeout with one line naming the
peer (and the last committed checkpoint), exit 4, its lock released; a
signal reaches a worker blocked inside TensorFlow (the supervisor,
`launch.supervisor`); resumed, the workers finish bit for bit as the
uninterrupted run; only the chief writes the shared --model_dir.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from launch import local_cluster
from launch import run_lock
from tfpipe_tests import trainer_runs as runs
from tfpipe_tests.test_data_parallel import REPO, _TRAIN, _run_workers, _tf_config
from tfpipe_tests.test_trainer_stops import _MAIN_SIGNALLED_AT

_FLAGS = [*_TRAIN[2:], "--replicas=tf_config", "--checkpoint_every=2"]
_LOST = "launch.train: error: lost a worker: "


def _children(pid):
    """The pids of `pid`'s children (Linux /proc)."""
    path = pathlib.Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@pytest.mark.parametrize("index", [0, pytest.param(1, marks=pytest.mark.slow)],
                         ids=["the_chief_alone", "a_worker_alone"])
def test_a_worker_whose_peer_never_comes_ends_with_one_line(tmp_path, index):
    """The start-up rendezvous (TensorFlow waits there holding the GIL) is
    bounded by --step_timeout: one line naming the peer, exit 4, nothing
    left running, the lock file empty."""
    ports = local_cluster.free_ports(2)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, *_TRAIN[:2], *_FLAGS, "--step_timeout=5", f"--model_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=_tf_config(ports, index)))
    elapsed = time.monotonic() - start
    assert proc.returncode == 4, proc.stderr[-3000:]
    other = 1 - index
    assert proc.stderr.splitlines()[-1] == (
        f"{_LOST}the start-up rendezvous with the other workers has not finished after 5 s "
        f"(--step_timeout): /job:worker/task:{other} refuses connections: the process is "
        f"gone. Nothing was trained. Start every worker (the same command, each with its "
        f"TF_CONFIG); with --resume they continue from the last checkpoint.")
    assert elapsed < 5 + 40  # the bound, after TensorFlow's start-up
    if index == 0:
        assert (tmp_path / run_lock.LOCK_FILE).read_text() == ""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Two workers, one shared --model_dir, 6 steps, nothing in the way."""
    root = tmp_path_factory.mktemp("cluster_reference")
    done = _run_workers(lambda i: [*_TRAIN[:2], *_FLAGS, f"--model_dir={root}"],
                        local_cluster.free_ports(2))
    assert [code for code, _, _ in done] == [0, 0], done[0][2][-3000:]
    return root


@pytest.mark.slow
def test_a_killed_worker_ends_the_other_and_both_resume_exactly(tmp_path, uninterrupted):
    """Worker 1 is killed (SIGKILL) after step 3: worker 0 ends with one line
    naming it and the newest committed checkpoint, exit 4. Both resumed, the
    shared --model_dir ends as the uninterrupted run's, bit for bit, and
    holds only the chief's files."""
    run = tmp_path / "run"
    killed = _run_workers(
        lambda i: [*(["-c", _MAIN_SIGNALLED_AT] if i == 1 else _TRAIN[:2]), *_FLAGS,
                   f"--model_dir={run}"],
        local_cluster.free_ports(2), {"SIGNAL_AT": "step:3:SIGKILL"})
    code, _, err = killed[0]
    assert code == 4, err[-3000:]
    line = err.splitlines()[-1]
    assert line.startswith(f"{_LOST}/job:worker/task:1 (127.0.0.1:") and line.endswith(
        f"The newest committed checkpoint is {run}/checkpoints/ckpt-2; --resume continues "
        f"from it."), line
    assert killed[1][0] == 128 + signal.SIGKILL
    assert (run / run_lock.LOCK_FILE).read_text() == ""
    resumed = _run_workers(lambda i: [*_TRAIN[:2], *_FLAGS, "--resume", f"--model_dir={run}"],
                           local_cluster.free_ports(2))
    for code, out, err in resumed:
        assert code == 0, err[-3000:]
        assert f"Resuming from {run}/checkpoints/ckpt-2 (step 2)." in out
    ours = runs.checkpoint_tensors(str(run / "checkpoints" / "ckpt-6"))
    theirs = runs.checkpoint_tensors(str(uninterrupted / "checkpoints" / "ckpt-6"))
    assert ours.keys() == theirs.keys()
    assert all((ours[k] == theirs[k]).all() for k in ours)
    assert len(list((run / "tensorboard" / "steps").iterdir())) == 2  # the chief's: 2 runs


@pytest.mark.slow
def test_a_signal_reaches_a_worker_blocked_on_a_frozen_peer(tmp_path):
    """Worker 1 frozen (SIGSTOP) after a checkpoint, then SIGTERM to worker 0,
    blocked in its collective: it ends within --step_timeout, with one line,
    the lock released."""
    ports = local_cluster.free_ports(2)
    run = tmp_path / "run"
    procs = [subprocess.Popen(
        [sys.executable, *_TRAIN[:2], *_FLAGS, "--epochs=20", "--step_timeout=10",
         f"--model_dir={run}"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=_tf_config(ports, i)))
        for i in range(2)]
    try:
        deadline = time.monotonic() + 180
        while not list((run / "checkpoints").glob("*.manifest.json")):
            assert time.monotonic() < deadline and procs[0].poll() is None
            time.sleep(0.05)
        for pid in _children(procs[1].pid):  # the worker under worker 1's supervisor
            os.kill(pid, signal.SIGSTOP)
        procs[0].send_signal(signal.SIGTERM)
        start = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        elapsed = time.monotonic() - start
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            for pid in _children(proc.pid):
                os.kill(pid, signal.SIGKILL)
    assert procs[0].returncode in (4, 143), err[-3000:]
    assert elapsed < 10 + 15, elapsed  # the bound, and a probe's time
    lines = [l for l in err.splitlines() if l.startswith("launch.train:")]
    assert lines[0] == ("launch.train: SIGTERM: finishing this step, then saving a checkpoint "
                        "(send it again to stop at once).")
    assert "/job:worker/task:1" in lines[-1] or "did not stop within 10 s" in lines[-1], lines
    assert (run / run_lock.LOCK_FILE).read_text() == ""


def test_a_worker_is_refused_a_previous_run_as_its_chief_is(tmp_path, tmp_path_factory):
    """Worker 1 (not the chief) of a fresh run into a --model_dir holding a
    previous run stops at once, with the chief's line, touching nothing:
    it does not wait in the rendezvous for a chief that was refused."""
    model_dir = runs.make_reference(tmp_path_factory)["dir"]
    before = runs.tree(model_dir)
    proc = subprocess.run(
        [sys.executable, *_TRAIN[:2], *_FLAGS, f"--model_dir={model_dir}"], cwd=REPO,
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                 TF_CONFIG=_tf_config(local_cluster.free_ports(2), 1)))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1].startswith(
        f"launch.train: error: --model_dir={model_dir} holds a previous run (")
    assert runs.tree(model_dir) == before
