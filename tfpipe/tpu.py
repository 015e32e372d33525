"""Pipeline stages on the cores of a TPU replica.

A `tf.distribute.TPUStrategy` built with a `tf.tpu.experimental.DeviceAssignment`
of K cores per replica runs R replicas data-parallel; inside each replica its
logical cores 0..K-1 are the pipeline's devices, and tfpipe puts stage k on
logical core k (`tfpipe.devices.LogicalCore`, which enters
`strategy.extended.experimental_logical_device(k)`). The whole replica step is
one XLA program: cross-core edges become XLA transfers, inputs arrive on core
0, shapes must be static (`tfpipe.xla.check_static_batch`), and Keras reduces
the replicas' outputs with "first".

Logical core k is not TPU device k: the device assignment packs a replica's
cores as a ring or mesh of the physical topology. `stage_cores` says, per
replica and stage, which host task and which TPU core ordinal that is (for
placing input pipelines, reading profiles, or checking a layout by hand).

Nothing here has run on TPU hardware; `stage_cores` is pure Python over
`Topology`/`DeviceAssignment` objects and is tested on CPU (BUILD.md, "TPU and
XLA").
"""

import typing

import numpy as np
import tensorflow as tf

from tfpipe import _internal


class StageCore(typing.NamedTuple):
    """Where stage `stage` of replica `replica` runs.

    Attributes:
      replica: the replica index r (0..R-1).
      stage: the stage index k (0..K-1).
      logical_core: the device assignment's logical core (== stage).
      task: the host task (TPU worker) whose TPU device it is.
      ordinal: the TPU core ordinal within that task (`/device:TPU:<ordinal>`).
      coordinates: the physical (x, y, z, core) coordinates.
    """

    replica: int
    stage: int
    logical_core: int
    task: int
    ordinal: int
    coordinates: tuple


def stage_cores(device_assignment, num_stages):
    """The host task and TPU core ordinal of each stage of each replica.

    Args:
      device_assignment: a `tf.tpu.experimental.DeviceAssignment` with K
        cores per replica, e.g. `DeviceAssignment.build(topology,
        computation_shape=[2, 2, 1, 2], num_replicas=1)` for K = 8.
      num_stages: K, the pipeline's stage count (stage k on logical core k).
    Returns:
      A tuple of R tuples of K `StageCore`s: `result[r][k]`.
    Raises:
      ValueError: `device_assignment` is not a DeviceAssignment, or
        `num_stages` is not a positive int equal to its cores per replica.

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


def is_tpu_strategy(strategy):
    """Whether `strategy` is a `tf.distribute.TPUStrategy` (any version)."""
    kinds = tuple(k for k in (getattr(tf.distribute, "TPUStrategy", None),
                              getattr(tf.distribute.experimental, "TPUStrategy", None),
                              getattr(tf.compat.v1.distribute.experimental, "TPUStrategy",
                                      None)) if k is not None)
    return isinstance(strategy, kinds)


def cores_per_replica(strategy):
    """K, the logical cores in each replica of a TPUStrategy."""
    return _internal.tpu_cores_per_replica(strategy)
