"""Stages on other hosts: TensorFlow's own cluster runtime, one client.

A pipeline whose stage k lives on `/job:worker/task:k` is trained by one
client process (the one that calls `fit`, itself `/job:localhost`, holding no
stage). Each worker runs a `tf.distribute.Server` and nothing else; `connect`
joins the client to them, after which their devices take variables and ops
like local ones. `worker_devices` names the stage devices; `LocalCluster(n)`
starts n workers on 127.0.0.1 for development and tests. A dead worker
raises `UnavailableError` (`describe_unavailable` names it); a frozen one
hangs the client (`tfpipe.StepWatchdog` ends it, using `tfpipe.probe`).

Run as a program this file is one worker (`TF_CONFIG=... python -m
tfpipe.cluster --worker` on each host). `LocalCluster` runs it with `python
-P`, which keeps `tfpipe/` off `sys.path` and skips importing the rest of tfpipe.
"""

import argparse
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

from tfpipe import probe

JOB = "worker"  # the job whose tasks hold the stages
_HOST = "127.0.0.1"  # LocalCluster binds nothing else
_connected = None  # the ClusterSpec of the last connect(), for StepWatchdog's default
_running = set()  # the started LocalClusters of this process, for kill_local_workers


def cluster_spec(cluster=None):
    """The `tf.train.ClusterSpec` of `cluster`: a ClusterSpec, a dict {job:
    [address, ...]}, a `ClusterResolver`, a `LocalCluster`, or "tf_config" or
    None (the TF_CONFIG environment variable). Raises ValueError for anything
    else, or a cluster without a `worker` job."""
    if cluster is None or cluster == "tf_config":
        if not os.environ.get("TF_CONFIG"):
            raise ValueError(
                "cluster=None reads the cluster from the TF_CONFIG environment variable, "
                "which is not set. Set TF_CONFIG='{\"cluster\": {\"worker\": "
                "[\"host0:port\", \"host1:port\"]}}', or pass a tf.train.ClusterSpec, a "
                "ClusterResolver or a tfpipe.cluster.LocalCluster.")
        spec = tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec()
    elif isinstance(cluster, LocalCluster):
        spec = cluster.cluster_spec
    elif isinstance(cluster, tf.train.ClusterSpec):
        spec = cluster
    elif isinstance(cluster, tf.distribute.cluster_resolver.ClusterResolver):
        spec = cluster.cluster_spec()
    elif isinstance(cluster, dict):
        spec = tf.train.ClusterSpec(cluster)
    else:
        raise ValueError(
            f"cluster must be a tf.train.ClusterSpec, a dict {{job: [address, ...]}}, a "
            f"ClusterResolver, a tfpipe.cluster.LocalCluster, 'tf_config' or None "
            f"(TF_CONFIG); got {type(cluster).__name__}: {cluster!r}.")
    if JOB not in spec.jobs:
        raise ValueError(
            f"The cluster {spec.as_dict()} has no {JOB!r} job; tfpipe puts stage k on "
            f"/job:{JOB}/task:k. Name the stage hosts' job {JOB!r}.")
    return spec


def connect(cluster=None):
    """Connects this process, as the single client, to `cluster`'s workers
    (`cluster_spec` says what it may be); returns the `tf.train.ClusterSpec`.
    Must run before the first TensorFlow op that should see them."""
    global _connected
    spec = cluster_spec(cluster)
    tf.config.experimental_connect_to_cluster(spec)
    _connected = spec
    return spec


def connected_spec():
    """The ClusterSpec of the last `connect()` in this process, or None."""
    return _connected


def worker_devices(cluster=None, device_type="CPU", index=0):
    """["/job:worker/task:k/device:<device_type>:<index>" for each task k]."""
    spec = cluster_spec(cluster if cluster is not None else _connected)
    return [f"/job:{JOB}/task:{k}/device:{device_type}:{index}"
            for k in sorted(spec.task_indices(JOB))]


def task_addresses(cluster=None):
    """{"/job:J/task:k": "host:port"} for every task of every job of `cluster`."""
    spec = cluster_spec(cluster if cluster is not None else _connected)
    return {f"/job:{job}/task:{k}": spec.task_address(job, k)
            for job in spec.jobs for k in sorted(spec.task_indices(job))}


def describe_unavailable(error, cluster=None, probe_timeout_s=2.0):
    """A one-paragraph message for an `UnavailableError` of a connected run:
    which tasks do not answer their port now (`tfpipe.probe`), and what to do."""
    addresses = task_addresses(cluster)
    # TensorFlow's text starts with "Graph execution error:" and node traces;
    # the gRPC reason ("Connection reset by peer", "Socket closed") says more.
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = next((line for line in lines if any(
        word in line for word in ("Connection", "Socket", "connect", "grpc_message"))),
        type(error).__name__)[:300]
    states = probe.probe_tasks(addresses, probe_timeout_s)
    lost = {t: s for t, s in states.items() if s != "ok"}
    if not lost:
        return (f"a worker was unreachable ({said}), but every "
                f"task answers now ({', '.join(addresses)}); run again.")
    named = "; ".join(f"{t} ({addresses[t]}) {probe.MEANING[s]}" for t, s in lost.items())
    return (f"lost a worker: {named}. TensorFlow said: {said} Restart that worker and continue "
            f"from the last checkpoint (launch.train: --resume).")


def _free_ports(n):
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

    >>> with tfpipe.cluster.LocalCluster(2) as cluster:   # doctest: +SKIP
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
            ports = _free_ports(self.num_workers)
            self._spec = tf.train.ClusterSpec({JOB: [f"{_HOST}:{p}" for p in ports]})
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
                [sys.executable, "-P", os.path.abspath(__file__), "--worker",
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
        return list(self.cluster_spec.job_tasks(JOB))

    def worker_devices(self, device_type="CPU", index=0):
        """["/job:worker/task:k/device:CPU:0" for each worker k]."""
        return worker_devices(self.cluster_spec, device_type, index)


def kill_local_workers():
    """Sends SIGKILL to the workers of every started `LocalCluster` of this
    process, waiting for nothing: `StepWatchdog` calls it right before
    `os._exit` (which runs no atexit handler), and a SIGSTOPped worker cannot
    notice its parent is gone."""
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


def _serve(cluster, task, time_limit_s, parent):
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=JOB,
                                  task_index=task, protocol="grpc", start=True)
    port = cluster[JOB][task].rsplit(":", 1)[1]
    print(f"READY {port}", flush=True)
    deadline = time.monotonic() + time_limit_s
    # Bounded: the time limit, or the parent gone (re-parented), whichever first.
    while time.monotonic() < deadline and (parent is None or os.getppid() == parent):
        time.sleep(0.5)
    del server
    os._exit(0)  # the server's threads would keep the interpreter alive


def _main(argv):
    parser = argparse.ArgumentParser(
        description="One tfpipe.cluster worker: a tf.distribute.Server of job 'worker'. On "
                    "each host of a cluster: python -m tfpipe.cluster --worker (the cluster "
                    "and this host's task from TF_CONFIG, or --cluster and --task).")
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--cluster", help="ClusterSpec as JSON (default: TF_CONFIG's cluster)")
    parser.add_argument("--task", type=int, help="this worker's index (default: TF_CONFIG's)")
    parser.add_argument("--time_limit_s", type=float, default=float("inf"),
                        help="exit after this many seconds (default: never)")
    parser.add_argument("--parent", type=int, help="exit when this process is gone")
    args = parser.parse_args(argv)
    tf_config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    cluster = json.loads(args.cluster) if args.cluster else tf_config.get("cluster")
    task = args.task if args.task is not None else tf_config.get("task", {}).get("index")
    if not cluster or JOB not in cluster or task is None:
        parser.error("give --cluster and --task, or set TF_CONFIG with the cluster's "
                     "'worker' job and this host's task index")
    _serve(cluster, task, args.time_limit_s, args.parent)


if __name__ == "__main__":
    _main(sys.argv[1:])
