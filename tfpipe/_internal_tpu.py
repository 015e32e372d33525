"""The private TensorFlow and Keras APIs tfpipe uses for a TPUStrategy: the
metadata a cluster resolver hands it, its SPMD setting and core names, and
the wrapper that puts a Keras optimizer's per-variable work on each
variable's core. Part of `_internal`'s boundary (pinned by
`tfpipe_tests/test_testing_and_internal.py`)."""
# pylint: disable=protected-access

import contextlib

import keras
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


def place_optimizer_updates(optimizer, device_of):
    """Makes a Keras TF optimizer do each variable's work in its device's
    scope: `device_of(variable)` is a hashable object with a `scope()` (a
    `tfpipe.devices.StageDevice`), or None for no scope, where `variable` is
    the TF variable Keras works on (`keras.Variable.value`). The work: the
    gradients' all-reduce over replicas (one per device, not one for all),
    the weight decay and `update_step` (slots included).

    Why: inside a TPU replica Keras' optimizer runs in no device scope, so
    every update would land on the replica's core 0 and read each stage's
    variables there. Wraps this instance's methods once; a second call
    replaces `device_of`."""
    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    if inner is not None:
        place_optimizer_updates(inner, device_of)
    wrapped = getattr(optimizer, "_tfpipe_device_of", None) is not None
    optimizer._tfpipe_device_of = device_of
    if wrapped:
        return
    update_step = optimizer.update_step
    reduce_gradients = optimizer._all_reduce_sum_gradients
    weight_decay = optimizer._apply_weight_decay

    def device(variable):
        value = variable.value if isinstance(variable, keras.Variable) else variable
        return optimizer._tfpipe_device_of(value)

    def scope(variable):
        found = device(variable)
        return contextlib.nullcontext() if found is None else found.scope()

    def by_device(variables):
        """Positions of `variables` grouped by device, in first-seen order."""
        out = {}
        for i, variable in enumerate(variables):
            out.setdefault(device(variable), []).append(i)
        return list(out.values())

    def placed_update_step(gradient, variable, learning_rate):
        with scope(variable):
            return update_step(gradient, variable, learning_rate)

    def placed_reduce(grads_and_vars):
        pairs = list(grads_and_vars)
        out = [None] * len(pairs)
        for positions in by_device([v for _, v in pairs]):
            with scope(pairs[positions[0]][1]):
                reduced = reduce_gradients([pairs[i] for i in positions])
            for i, pair in zip(positions, reduced):
                out[i] = pair
        return out

    def placed_weight_decay(variables):
        variables = list(variables)
        for positions in by_device(variables):
            with scope(variables[positions[0]]):
                weight_decay([variables[i] for i in positions])

    optimizer.update_step = placed_update_step
    optimizer._all_reduce_sum_gradients = placed_reduce
    optimizer._apply_weight_decay = placed_weight_decay
