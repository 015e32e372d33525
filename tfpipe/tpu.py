"""Pipeline stages on the cores of a TPU replica.

Under a user's `tf.distribute.TPUStrategy` whose device assignment gives each
replica K cores, tfpipe puts stage k on logical core k of every replica
(`tfpipe.devices.LogicalCore`): its variables, optimizer slots, forward and
backward ops, micro-batch gradient sums, cross-replica all-reduce and
updates. `TPUPipelineHost` is what a `PipelinedModel` asks of such a
strategy (the counterpart of `tfpipe.PipelineStrategy`). The replica step is
one XLA program, so every batch has one static size. Logical core k is not
TPU device k: `stage_cores` says which host task and core ordinal it is.

Traced on CPU (`tfpipe.testing.tpu_strategy`); not yet run on TPU hardware
(`benchmarks/tpu_check.py` is the script that would).
"""

import typing
import weakref

import numpy as np
import tensorflow as tf

from tfpipe import _internal_tpu
from tfpipe import config as config_lib
from tfpipe import devices as devices_lib
from tfpipe import host


class StageCore(typing.NamedTuple):
    """Where stage `stage` of replica `replica` runs: its `logical_core`
    (== stage), the host `task` whose TPU device it is, the core `ordinal`
    in that task (`/device:TPU:<ordinal>`) and the physical (x, y, z, core)
    `coordinates`."""

    replica: int
    stage: int
    logical_core: int
    task: int
    ordinal: int
    coordinates: tuple


def stage_cores(device_assignment, num_stages):
    """The host task and TPU core ordinal of each stage of each replica.

    Returns R tuples of K `StageCore`s (`result[r][k]`) for a
    `tf.tpu.experimental.DeviceAssignment` with K = `num_stages` cores per
    replica; raises ValueError for anything else.

    >>> topology = tf.tpu.experimental.Topology(                 # doctest: +SKIP
    ...     mesh_shape=[2, 2, 1, 2], device_coordinates=coords)  # one v3-8 host
    >>> da = tf.tpu.experimental.DeviceAssignment.build(topology, [2, 2, 1, 2])
    >>> [c.ordinal for c in stage_cores(da, 8)[0]]               # doctest: +SKIP
    [0, 1, 4, 5, 6, 7, 2, 3]
    """
    if not isinstance(device_assignment, tf.tpu.experimental.DeviceAssignment):
        raise ValueError(
            f"device_assignment must be a tf.tpu.experimental.DeviceAssignment, got "
            f"{type(device_assignment).__name__}; build one with "
            f"tf.tpu.experimental.DeviceAssignment.build(topology, computation_shape=..., "
            f"num_replicas=...).")
    if isinstance(num_stages, bool) or not isinstance(num_stages, (int, np.integer)) \
            or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}.")
    per_replica = device_assignment.num_cores_per_replica
    if num_stages != per_replica:
        raise ValueError(
            f"num_stages={num_stages} but the device assignment has {per_replica} cores "
            f"per replica; tfpipe puts stage k on logical core k, so build the "
            f"DeviceAssignment with a computation_shape of {num_stages} cores (its "
            f"product), or cut the model into {per_replica} stages.")
    topology = device_assignment.topology
    result = []
    for r in range(device_assignment.num_replicas):
        row = []
        for k in range(per_replica):
            coordinates = tuple(int(c) for c in device_assignment.coordinates(r, k))
            row.append(StageCore(
                replica=r, stage=k, logical_core=k,
                task=int(topology.task_ordinal_at_coordinates(coordinates)),
                ordinal=int(device_assignment.tpu_ordinal(r, k)),
                coordinates=coordinates))
        result.append(tuple(row))
    return tuple(result)


def device_assignment(topology, cores_per_replica, num_replicas=1):
    """A `tf.tpu.experimental.DeviceAssignment` that gives each of
    `num_replicas` replicas `cores_per_replica` (K) cores of `topology` (a
    `tf.tpu.experimental.Topology`, e.g. `initialize_tpu_system`'s), for a
    pipeline of one stage per core: the cores of one chip first, then
    neighbouring chips along y, then along x, so that stage k + 1 sits next
    to stage k. Raises ValueError when K x R does not fit."""
    mesh = [int(n) for n in topology.mesh_shape]  # [x, y, z, cores per chip]
    x_size, y_size, _, per_chip = mesh
    cores = int(np.prod(mesh))
    shapes = {}
    for k in (2**n for n in range(cores.bit_length())):
        chips = max(1, k // per_chip)
        shape = ([1, 1, 1, k] if k <= per_chip else [1, chips, 1, per_chip]
                 if chips <= y_size else [chips // y_size, y_size, 1, per_chip])
        if int(np.prod(shape)) == k and shape[0] <= x_size and not x_size % shape[0]:
            shapes[k] = shape
    if cores_per_replica not in shapes or isinstance(num_replicas, bool) or \
            not isinstance(num_replicas, int) or num_replicas < 1 or \
            cores_per_replica * num_replicas > cores:
        raise ValueError(
            f"cores_per_replica={cores_per_replica!r} x num_replicas={num_replicas!r} does "
            f"not fit a {'x'.join(map(str, mesh))} TPU topology's {cores} cores; "
            f"cores_per_replica takes {sorted(shapes)}, and their product at most {cores}.")
    return tf.tpu.experimental.DeviceAssignment.build(
        topology, computation_shape=shapes[cores_per_replica], num_replicas=num_replicas)


def is_tpu_strategy(strategy):
    """Whether `strategy` is a `tf.distribute.TPUStrategy` (any version)."""
    kinds = tuple(k for k in (getattr(tf.distribute, "TPUStrategy", None),
                              getattr(tf.distribute.experimental, "TPUStrategy", None),
                              getattr(tf.compat.v1.distribute.experimental, "TPUStrategy",
                                      None)) if k is not None)
    return isinstance(strategy, kinds)


class TPUPipelineHost(host.PipelineHost):
    """What a `PipelinedModel` asks of its strategy, for a `TPUStrategy`:
    the stage slots (K logical cores per replica), the stage devices
    (`LogicalCore`s), the replicas R, and the default settings (tfpipe's:
    a TPUStrategy takes no pipeline settings; give them to the model).
    Its policies: the TPU compiles each replica's step as one XLA program, so
    batches have one static size and `jit_compile=True` is refused; optimizer
    updates and metrics are placed on cores explicitly, since Keras runs them
    in no device scope inside a replica. Get it with `host_of(strategy)`; one
    per strategy."""

    static_batch_reason = "a TPUStrategy (one XLA program per replica)"
    timing_refusal = (
        "a TPUStrategy's logical cores run only inside its replica program, so tfpipe "
        "cannot time layers or steps on them from outside it (tfpipe.plan, "
        "tfpipe.timeline.record_step). Plan on this process's devices instead "
        "(tfpipe.plan(model, ..., devices=[...]): the schedule and memory figures carry "
        "over, the times are those devices'); profile the TPU's steps with tf.profiler "
        "(benchmarks/tpu_check.py does).")

    def __init__(self, strategy):
        if _internal_tpu.tpu_uses_spmd(strategy):
            raise ValueError(
                "PipelinedModel under a TPUStrategy with experimental_spmd_xla_partitioning="
                "True: XLA's SPMD partitioner would split every op over the replica's cores, "
                "not run stage k on core k. Make the TPUStrategy without it (the default).")
        self.distribute_strategy = strategy
        self.cores_per_replica = len(_internal_tpu.tpu_core_devices(strategy)[0])
        self._config = config_lib.PipelineConfig.make()
        self._given = {}  # a TPUStrategy takes no pipeline settings

    @property
    def num_replicas(self):
        """R, the data-parallel replicas (`num_replicas_in_sync`)."""
        return self.distribute_strategy.num_replicas_in_sync

    @property
    def device_grid(self):
        """One row, the K logical cores: every replica runs the same program."""
        return (tuple(devices_lib.LogicalCore(self.distribute_strategy, k)
                      for k in range(self.cores_per_replica)),)

    def _stage_slots(self, replica):
        del replica  # every replica runs on its own cores 0..K-1
        return self.device_grid[0]

    def _too_many_stages(self, num_stages, most, count):
        return (f"{num_stages} stages but the TPUStrategy gives each replica "
                f"{self.cores_per_replica} core(s), so at most {most} stages fit; cut the "
                f"model into at most {most} stages (balance=...), or make the TPUStrategy "
                f"with a DeviceAssignment of {count} cores per replica "
                f"(computation_shape whose product is {count}).")

    def scope(self):
        return self.distribute_strategy.scope()

    def xla_modes(self, jit_compile, pipeline_devices, stage_functions):
        """The TPU compiles each replica's whole step itself: `True` is
        refused, the rest mean no XLA of tfpipe's own."""
        if jit_compile is True:
            raise ValueError(
                "PipelinedModel.compile(jit_compile=True) under a TPUStrategy: the TPU already "
                "compiles each replica's whole step as one XLA program. Leave jit_compile "
                "unset (\"auto\") or pass False.")
        return False, False

    def prefers_stage_functions(self, jit_compile, pipeline_devices):
        return False

    def update_device(self, variable, stage_device):
        """The variable's logical core: Keras' optimizer runs in no device
        scope inside a replica, and a physical core's name would pin every
        replica's update to replica 0's core."""
        del variable
        return stage_device

    def metrics_scope(self, pipeline):
        """Next to y_pred, on the last stage's core (else Keras would update
        them on core 0)."""
        return pipeline.stage_scope(pipeline.num_stages - 1)

    def __repr__(self):
        return (f"TPUPipelineHost({self.num_replicas} replica(s) x {self.cores_per_replica} "
                f"core(s))")


_HOSTS = weakref.WeakKeyDictionary()


def host_of(strategy):
    """The one `TPUPipelineHost` of a `TPUStrategy`."""
    if strategy not in _HOSTS:
        _HOSTS[strategy] = TPUPipelineHost(strategy)
    return _HOSTS[strategy]
