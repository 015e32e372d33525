"""A `--replicas=tf_config` worker runs under a supervisor that bounds what
TensorFlow cannot.

TensorFlow's start-up rendezvous holds the GIL while it waits for every
worker of the cluster: while one peer is missing, no Python thread of the
process runs, nor its signal handler, so neither a watchdog thread nor a
SIGTERM can end it. So the worker's run goes to a forked child (before
TensorFlow loads); this process, which never loads TensorFlow, supervises
it:

- the child reports the rendezvous's start and end (`report`); if it has
  not ended within `bound_s`, the peers' ports are probed, one line names
  the one that does not answer, the child is killed and the exit code is 4;
- a signal is forwarded to the child, which stops as a run stops (after the
  step, with a save); if it has not ended `bound_s` later (blocked inside
  TensorFlow, e.g. a collective waiting for a frozen peer), it is killed,
  with one line, and the exit code is 128 + the signal's number;
- otherwise the exit code is the child's.

After a kill the run's lock file is emptied (the kernel dropped its flock
with the child) and `cleanup` runs (a worker's scratch folder). Pure Python.
"""

import ctypes
import fcntl
import json
import os
import select
import signal
import sys
import time

from tfpipe import probe

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
REPORT_FD = "LAUNCH_TRAIN_SUPERVISOR_FD"  # the child's end of the report pipe
RENDEZVOUS_BEGINS, RENDEZVOUS_ENDS = b"R", b"D"
EXIT_LOST = 4  # launch.train's exit code for a lost worker


def report(what):
    """In a supervised child: tells the supervisor `what` (a byte string);
    elsewhere nothing."""
    fd = os.environ.get(REPORT_FD)
    if fd is not None:
        os.write(int(fd), what)


def peer_addresses():
    """{"/job:J/task:k": "host:port"} of the TF_CONFIG cluster, this task's own
    left out (read without TensorFlow)."""
    spec = json.loads(os.environ.get("TF_CONFIG") or "{}")
    task = spec.get("task", {})
    mine = (task.get("type"), task.get("index"))
    return {f"/job:{job}/task:{k}": address
            for job, addresses in spec.get("cluster", {}).items()
            for k, address in enumerate(addresses) if (job, k) != mine}


def run(child, bound_s, lock_path, cleanup=lambda: None):
    """Runs `child()` (-> an exit code) in a forked process, supervised as the
    module docstring says; returns the exit code for this process."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the worker: its own process group, so a group's signal comes once
        os.close(read)
        os.setpgid(0, 0)
        _die_with_parent()
        os.environ[REPORT_FD] = str(write)
        code = 1
        try:
            code = child()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # pylint: disable=protected-access
    os.close(write)
    try:
        return _supervise(pid, read, float(bound_s), lock_path)
    finally:
        cleanup()


def _supervise(pid, read, bound_s, lock_path):
    signalled = []  # (signum, when) of each signal forwarded

    def forward(signum, frame):  # pylint: disable=unused-argument
        signalled.append((signum, time.monotonic()))
        _kill(pid, signum)

    previous = {s: signal.signal(s, forward) for s in SIGNALS}
    try:
        rendezvous = None  # when the child began its rendezvous, until it ended
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else \
                    128 + os.WTERMSIG(status)
            try:
                ready, _, _ = select.select([read], [], [], 0.2)
            except InterruptedError:
                ready = []
            if ready:
                data = os.read(read, 64)
                if RENDEZVOUS_BEGINS in data:
                    rendezvous = time.monotonic()
                if RENDEZVOUS_ENDS in data:
                    rendezvous = None
            now = time.monotonic()
            if rendezvous is not None and now - rendezvous > bound_s:
                states = probe.probe_tasks(peer_addresses())
                lost = "; ".join(f"{task} {probe.MEANING[state]}"
                                 for task, state in states.items() if state != "ok")
                return _end(pid, lock_path, EXIT_LOST, (
                    f"launch.train: error: lost a worker: the start-up rendezvous with the "
                    f"other workers has not finished after {bound_s:g} s (--step_timeout): "
                    f"{lost or 'every other task answers its port, but not all joined'}. "
                    f"Nothing was trained. Start every worker (the same command, each with "
                    f"its TF_CONFIG); with --resume they continue from the last checkpoint."))
            if signalled and now - signalled[0][1] > bound_s:
                name = signal.Signals(signalled[0][0]).name
                return _end(pid, lock_path, 128 + int(signalled[0][0]), (
                    f"launch.train: {name}: the worker did not stop within {bound_s:g} s "
                    f"(--step_timeout; it is blocked inside TensorFlow, e.g. a collective "
                    f"waiting for a frozen peer): stopped without saving; the newest "
                    f"committed checkpoint is intact (--resume continues from it)."))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _die_with_parent():
    """Linux: the kernel kills this process when its parent (the supervisor)
    dies, even by SIGKILL: a worker never trains on orphaned."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the supervisor is then killed only with its group


def _kill(pid, signum):
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _end(pid, lock_path, code, line):
    """Kills the child's process group, empties the lock it held, says `line`."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    if lock_path is not None and os.path.isfile(lock_path):
        with open(lock_path, "r+b") as f:
            try:  # the child's flock went with it; empty it as a clean release does
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                f.truncate(0)
            except OSError:
                pass  # another run holds it already: its line stays
    print(line, file=sys.stderr, flush=True)
    return code
