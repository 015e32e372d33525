"""Helpers for tests and development on one machine: logical CPU devices, an
observer that counts stage calls while a step is traced, and a TPUStrategy
that traces TPU programs on a CPU-only machine."""

import numpy as np
import tensorflow as tf

from tfpipe import _internal_tpu
from tfpipe import tpu

# name -> (mesh shape [x, y, z, cores per chip]); each one host's worth of chips.
TPU_TOPOLOGIES = {
    "v3-8": [2, 2, 1, 2],    # 4 chips x 2 cores
    "v5e-8": [2, 4, 1, 1],   # 8 chips x 1 core
}


def use_logical_cpus(n):
    """Splits the physical CPU into `n` logical devices (`/device:CPU:0..n-1`)
    before TensorFlow initialises its devices; again with the same `n`, a no-op.

    >>> tfpipe.testing.use_logical_cpus(4)  # doctest: +SKIP

    Raises:
      ValueError: `n` is not a positive integer.
      RuntimeError: TensorFlow already initialised with a different count.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"use_logical_cpus(n) needs a positive integer n, got {n!r}.")
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu)
    if configured is not None and len(configured) == n:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have == n:
            return
        raise RuntimeError(
            f"use_logical_cpus({n}): TensorFlow is already initialised with {have} "
            f"logical CPU device(s), and the count cannot change in a running "
            f"process. Call tfpipe.testing.use_logical_cpus({n}) before any "
            f"TensorFlow op runs (e.g. at the top of the script or in conftest.py)."
        ) from None


class StageCalls:
    """A trace observer (`PipelinedModel.set_trace_options(observer=...)`):
    counts the calls of each stage's layer while steps are traced, replays
    included (`per_stage[k]`), and those traced inside an XLA program
    (`in_xla[k]`).

    >>> calls = tfpipe.testing.StageCalls()      # doctest: +SKIP
    >>> model.set_trace_options(observer=calls)  # doctest: +SKIP
    >>> model.fit(x, y); calls.per_stage          # doctest: +SKIP
    [7, 7, 7, 7]
    """

    def __init__(self):
        self.counts = {}
        self.in_xla = {}  # k -> calls traced inside an XLA program

    def on_stage_call(self, k, in_xla=False):
        self.counts[k] = self.counts.get(k, 0) + 1
        self.in_xla[k] = self.in_xla.get(k, 0) + int(bool(in_xla))

    @property
    def per_stage(self):
        """Calls per stage, stages 0..K-1 (K: the highest stage called + 1)."""
        return [self.counts.get(k, 0) for k in range(1 + max(self.counts, default=-1))]


def _topology(mesh):
    """A one-host `Topology` of `mesh`: every chip's cores, core fastest."""
    x_size, y_size, z_size, cores = mesh
    coordinates = [(x, y, z, c) for x in range(x_size) for y in range(y_size)
                   for z in range(z_size) for c in range(cores)]
    return tf.tpu.experimental.Topology(mesh_shape=list(mesh),
                                        device_coordinates=np.array([coordinates], np.int32))


class _TracingOnlyResolver(tf.distribute.cluster_resolver.ClusterResolver):
    """A cluster resolver reporting one host's TPU cores that do not exist."""

    def __init__(self, topology):
        self.task_type, self.task_id, self.rpc_layer = "worker", 0, None
        self.topology = topology
        cores = topology.num_tasks * topology.num_tpus_per_task
        host = "/job:localhost/replica:0/task:0/device"
        self.device_names = [f"{host}:TPU:{i}" for i in range(cores)] + [f"{host}:CPU:0"]

    def cluster_spec(self):
        return tf.train.ClusterSpec({})

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        return ""

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        return {"TPU": len(self.device_names) - 1}

    @property
    def environment(self):
        return ""

    def get_tpu_system_metadata(self):
        return _internal_tpu.tpu_metadata(self.topology, self.device_names)


def tpu_strategy(topology="v3-8", cores_per_replica=2, num_replicas=1,
                 spmd_xla_partitioning=False):
    """A real `tf.distribute.TPUStrategy` over TPU cores that do not exist:
    it *traces* TPU programs on a CPU-only machine (`tpu.replicate`,
    `TPUReplicateMetadata`, ops on `/device:TPU_REPLICATED_CORE:k`) but
    cannot run them (executing fails: there is no TPU kernel).

    `topology`: a name of `TPU_TOPOLOGIES`; `cores_per_replica` K (1, 2, 4
    or 8, within the host) and `num_replicas` R, K x R at most its cores;
    `spmd_xla_partitioning`: TPUStrategy's `experimental_spmd_xla_partitioning`.
    A `PipelinedModel` made in its scope puts stage k on logical core k.

    >>> strategy = tfpipe.testing.tpu_strategy("v3-8", cores_per_replica=2)  # doctest: +SKIP
    >>> strategy.extended.experimental_logical_device(1)  # stage 1's core  # doctest: +SKIP
    """
    if topology not in TPU_TOPOLOGIES:
        raise ValueError(f"topology={topology!r} is not one of {sorted(TPU_TOPOLOGIES)}.")
    assignment = tpu.device_assignment(_topology(TPU_TOPOLOGIES[topology]),
                                       cores_per_replica, num_replicas)
    return tf.distribute.TPUStrategy(_TracingOnlyResolver(assignment.topology),
                                     experimental_device_assignment=assignment,
                                     experimental_spmd_xla_partitioning=spmd_xla_partitioning)
