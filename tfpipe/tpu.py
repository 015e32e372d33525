"""Pipeline stages on the cores of a TPU replica.

tfpipe puts stage k on logical core k of every replica of a TPUStrategy
(`tfpipe.devices.LogicalCore`); the replica step is one XLA program, so
shapes must be static. Logical core k is not TPU device k: `stage_cores` says
which host task and core ordinal it is. Untested on TPU hardware.
"""

import typing

import numpy as np
import tensorflow as tf


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


def is_tpu_strategy(strategy):
    """Whether `strategy` is a `tf.distribute.TPUStrategy` (any version)."""
    kinds = tuple(k for k in (getattr(tf.distribute, "TPUStrategy", None),
                              getattr(tf.distribute.experimental, "TPUStrategy", None),
                              getattr(tf.compat.v1.distribute.experimental, "TPUStrategy",
                                      None)) if k is not None)
    return isinstance(strategy, kinds)
