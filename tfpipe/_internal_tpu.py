"""The private TensorFlow APIs tfpipe uses for a TPUStrategy: the
metadata a cluster resolver hands it, its SPMD setting and core names. Part
of `_internal`'s boundary (pinned by
`tfpipe_tests/test_testing_and_internal.py`)."""
# pylint: disable=protected-access

import tensorflow as tf
from tensorflow.python.tpu import tpu_system_metadata


def tpu_metadata(topology, device_names):
    """TF's `TPUSystemMetadata` of one host with the TPU cores of `topology`
    and `device_names` (what `TPUStrategy` asks a cluster resolver for)."""
    devices = [tf.config.LogicalDevice(name, tf.DeviceSpec.from_string(name).device_type)
               for name in device_names]  # what TPUSystemMetadata.devices holds
    cores = int(topology.num_tasks * topology.num_tpus_per_task)
    return tpu_system_metadata.TPUSystemMetadata(
        num_cores=cores, num_hosts=int(topology.num_tasks),
        num_of_cores_per_host=int(topology.num_tpus_per_task), topology=topology,
        devices=devices)


def tpu_uses_spmd(strategy):
    """Whether a TPUStrategy partitions with XLA SPMD
    (`experimental_spmd_xla_partitioning=True`)."""
    return bool(getattr(strategy.extended, "_use_spmd_for_xla_partitioning", False))


def tpu_core_devices(strategy):
    """A TPUStrategy's physical core names, an R x K nest: [r][k] is logical
    core k of replica r."""
    return [list(row) for row in strategy.extended._tpu_devices]
