"""Stages on other hosts: TensorFlow's own cluster runtime, one client.

A pipeline whose stage k lives on `/job:worker/task:k` is trained by one
client process (the one that calls `fit`, itself `/job:localhost`, holding no
stage). Each worker runs a `tf.distribute.Server` and nothing else; `connect`
joins the client to them, after which their devices take variables and ops
like local ones. `worker_devices` names the stage devices
(`launch.local_cluster.LocalCluster(n)` starts n workers on 127.0.0.1 for
development and tests). A dead worker
raises `UnavailableError` (`describe_unavailable` names it); a frozen one
hangs the client (`tfpipe.StepWatchdog` ends it, using `tfpipe.probe`).

Run as a program this file is one worker (`TF_CONFIG=... python -m
tfpipe.cluster --worker` on each host). `LocalCluster` runs it with `python
-P`, which keeps `tfpipe/` off `sys.path` and skips importing the rest of tfpipe.
WORKER_MAIN is its path.
"""

import argparse
import json
import os
import sys
import time

import tensorflow as tf

from tfpipe import probe

JOB = "worker"  # the job whose tasks hold the stages
WORKER_MAIN = os.path.abspath(__file__)  # run as a program: one worker
_connected = None  # the ClusterSpec of the last connect(), for StepWatchdog's default


def cluster_spec(cluster=None):
    """The `tf.train.ClusterSpec` of `cluster`: a ClusterSpec, a dict {job:
    [address, ...]}, a `ClusterResolver`, an object whose `cluster_spec` is a
    ClusterSpec (a `launch.local_cluster.LocalCluster`), or "tf_config" or
    None (the TF_CONFIG environment variable). Raises ValueError for anything
    else, or a cluster without a `worker` job."""
    if cluster is None or cluster == "tf_config":
        if not os.environ.get("TF_CONFIG"):
            raise ValueError(
                "cluster=None reads the cluster from the TF_CONFIG environment variable, "
                "which is not set. Set TF_CONFIG='{\"cluster\": {\"worker\": "
                "[\"host0:port\", \"host1:port\"]}}', or pass a tf.train.ClusterSpec, a "
                "ClusterResolver or a launch.local_cluster.LocalCluster.")
        spec = tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec()
    elif isinstance(cluster, tf.train.ClusterSpec):
        spec = cluster
    elif isinstance(cluster, tf.distribute.cluster_resolver.ClusterResolver):
        spec = cluster.cluster_spec()
    elif isinstance(cluster, dict):
        spec = tf.train.ClusterSpec(cluster)
    elif isinstance(getattr(cluster, "cluster_spec", None), tf.train.ClusterSpec):
        spec = cluster.cluster_spec  # a LocalCluster
    else:
        raise ValueError(
            f"cluster must be a tf.train.ClusterSpec, a dict {{job: [address, ...]}}, a "
            f"ClusterResolver, a launch.local_cluster.LocalCluster, 'tf_config' or None "
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
