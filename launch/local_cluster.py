"""`LocalCluster(n)`: n TensorFlow worker processes on 127.0.0.1, for
development and tests (`launch.train --cluster=local:N`, tfpipe's cluster
tests).

Each worker is `tfpipe.cluster` run as a program (`tfpipe.cluster.WORKER_MAIN`,
the same worker a real cluster runs on each host); this module starts them on
ports the kernel picked, waits until each serves, and kills their process
groups at exit. It binds nothing but 127.0.0.1.
"""

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import tensorflow as tf

from tfpipe import cluster as cluster_lib

_HOST = "127.0.0.1"
_running = set()  # the started LocalClusters of this process, for kill_local_workers


def free_ports(n):
    """n distinct free TCP ports on 127.0.0.1 (all bound at once to port 0, then
    released): the kernel's pick, no portpicker."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((_HOST, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalCluster:
    """`num_workers` TensorFlow worker processes on 127.0.0.1, one job "worker".

    Each worker runs in its own process group on a port the kernel picked,
    and ends by itself when `time_limit_s` passes or this process goes away.
    Leaving the `with` block kills every worker's group (SIGKILL, which also
    ends a SIGSTOPped one) and reaps it, each wait bounded.

    >>> with LocalCluster(2) as cluster:   # doctest: +SKIP
    ...     tfpipe.cluster.connect(cluster)
    ...     strategy = tfpipe.PipelineStrategy(devices=cluster.worker_devices())

    `start_timeout_s`: seconds to wait for all workers to serve; past it, a
    RuntimeError with each worker's output.
    """

    def __init__(self, num_workers, time_limit_s=900.0, start_timeout_s=120.0):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"LocalCluster(num_workers) needs an integer >= 1, got "
                             f"{num_workers!r}.")
        self.num_workers = num_workers
        self.time_limit_s = float(time_limit_s)
        self.start_timeout_s = float(start_timeout_s)
        self._procs = []
        self._spec = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def start(self):
        """Starts the workers and waits until each serves (bounded)."""
        if self._procs:
            raise RuntimeError("This LocalCluster is already started.")
        atexit.register(self.stop)  # also when the with block is never left normally
        _running.add(self)
        for attempt in range(3):  # a picked port taken by another process: pick again
            ports = free_ports(self.num_workers)
            self._spec = tf.train.ClusterSpec(
                {cluster_lib.JOB: [f"{_HOST}:{p}" for p in ports]})
            try:
                self._launch()
                return self
            except _PortTaken:
                self.stop()
        raise RuntimeError("LocalCluster: the picked ports were taken three times over.")

    def _launch(self):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
        spec = json.dumps(self._spec.as_dict())
        for k in range(self.num_workers):
            self._procs.append(subprocess.Popen(
                [sys.executable, "-P", cluster_lib.WORKER_MAIN, "--worker",
                 f"--cluster={spec}", f"--task={k}", f"--time_limit_s={self.time_limit_s}",
                 f"--parent={os.getpid()}"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=env, start_new_session=True, text=True))
        self._readers = [_OutputReader(proc) for proc in self._procs]
        deadline = time.monotonic() + self.start_timeout_s
        for k, reader in enumerate(self._readers):
            if reader.ready.wait(max(0.0, deadline - time.monotonic())) and reader.port:
                continue
            self.stop()
            text = reader.text()
            if "Address already in use" in text or "Could not start gRPC server" in text:
                raise _PortTaken(text)
            raise RuntimeError(
                f"LocalCluster: worker {k} did not start within {self.start_timeout_s:g} s. "
                f"Its output:\n{text}")

    def stop(self):
        """Kills every worker's process group and reaps it (idempotent, bounded)."""
        procs, self._procs = self._procs, []
        _running.discard(self)
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its group: the worker and any child
            except (ProcessLookupError, PermissionError):
                pass
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass  # reported by .pids of the caller's own check; nothing more to do
        try:
            atexit.unregister(self.stop)
        except Exception:  # pylint: disable=broad-except
            pass

    @property
    def cluster_spec(self):
        """The `tf.train.ClusterSpec` {"worker": ["127.0.0.1:port", ...]}."""
        if self._spec is None:
            raise RuntimeError("Start the LocalCluster first (use it in a with block).")
        return self._spec

    @property
    def pids(self):
        """Process ids of the running workers, task order."""
        return [p.pid for p in self._procs]

    @property
    def addresses(self):
        return list(self.cluster_spec.job_tasks(cluster_lib.JOB))

    def worker_devices(self, device_type="CPU", index=0):
        """["/job:worker/task:k/device:CPU:0" for each worker k]."""
        return cluster_lib.worker_devices(self.cluster_spec, device_type, index)


def kill_local_workers():
    """Sends SIGKILL to the workers of every started `LocalCluster` of this
    process, waiting for nothing: call it right before `os._exit` (which runs
    no atexit handler; `launch.trainer` does in its `StepWatchdog`'s
    `on_end`), since a SIGSTOPped worker cannot notice its parent is gone."""
    for local in list(_running):
        for pid in local.pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class _PortTaken(Exception):
    pass


class _OutputReader:
    """Reads a worker's output on a thread (so a full pipe never blocks it);
    `ready` is set at its `READY <port>` line, or at EOF (then `port` is None)."""

    def __init__(self, proc):
        self.lines, self.port, self.ready = [], None, threading.Event()
        self._proc = proc
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        try:
            for line in self._proc.stdout:
                self.lines.append(line)
                if line.startswith("READY "):
                    self.port = int(line.split()[1])
                    self.ready.set()
        except (ValueError, OSError):
            pass
        self.ready.set()

    def text(self, wait_s=5.0):
        """Its output so far (after a kill: up to EOF, waiting at most `wait_s`)."""
        deadline = time.monotonic() + wait_s
        while not self._proc.stdout.closed and self._proc.poll() is None and (
                time.monotonic() < deadline):
            time.sleep(0.1)
        return "".join(self.lines)
