"""Where a stage runs: one object for every kind of device.

Every place tfpipe puts a stage's variables or ops enters a `StageDevice`'s
`scope()`, so a new kind of device is one class here, not a branch
elsewhere: `StageDevice(name)` (a CPU, GPU or remote task's device; scope
`tf.device(name)`; `LocalCPU` and `LocalGPU` for this machine's, which
report their memory) and `LogicalCore(strategy, k)`, logical core k of each
replica of a TPUStrategy (scope `strategy.extended.experimental_logical_device(k)`;
tfpipe never writes TPU device strings). `LogicalCore` is traced on CPU; it has
not run on a TPU.
"""

import os

import tensorflow as tf

from tfpipe import _internal
from tfpipe import _internal_tpu


class StageDevice:
    """A device a stage runs on, by its device `name` (`tf.device` takes it);
    subclasses define `scope()`."""

    def __init__(self, name):
        if not isinstance(name, str) or not name:
            raise ValueError(f"A StageDevice needs a non-empty device name, got {name!r}.")
        self.name = name

    def scope(self):
        """A context manager that places variables and ops on this device."""
        return tf.device(self.name)

    @property
    def auto_xla(self):
        """Whether Keras' `jit_compile="auto"` compiles with XLA here (on GPUs)."""
        return tf.DeviceSpec.from_string(self.name).device_type == "GPU"

    def memory(self):
        """(pool, bytes): the memory this device allocates from, named so that
        devices sharing it share a pool, and the bytes TF may use there; None
        where TF does not report it (a remote task's device, a TPU core)."""
        return None

    def __eq__(self, other):
        return type(other) is type(self) and other.name == self.name

    def __hash__(self):
        return hash((type(self).__name__, self.name))

    def __str__(self):
        return self.name

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r})"


class LocalCPU(StageDevice):
    """A CPU device of this process: it allocates from the host's memory,
    which every CPU device (and replica) of the process shares."""

    def memory(self):
        try:
            return "host memory", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, OSError, ValueError):  # no sysconf (Windows)
            return None


class LocalGPU(StageDevice):
    """A GPU of this process: its own memory, the bytes TF's allocator may use."""

    def memory(self):
        limit = _internal.device_memory_limit(self.name)
        return None if limit is None else (self.name, limit)


class LogicalCore(StageDevice):
    """Logical core `index` (0-based) of every replica of a
    `tf.distribute.TPUStrategy`."""

    auto_xla = False  # the TPU compiles the replica's step itself

    def __init__(self, strategy, index):
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"A logical core index must be an int >= 0, got {index!r}.")
        super().__init__(f"TPU logical core {index}")
        self.strategy, self.index = strategy, index

    def scope(self):
        # Raises a ValueError past the replica's cores.
        return self.strategy.extended.experimental_logical_device(self.index)

    def place_variable(self, variable):
        """Re-creates `variable` in this core's scope, wherever it was (the
        TPUStrategy mirrors it over the replicas); returns the R device names
        that should hold its copies."""
        _internal.move_variable(variable, self.scope(), named_by_path=True)
        return self.replica_devices()

    def replica_devices(self):
        """The TPU device of this core in each replica (R names)."""
        return [row[self.index] for row in _internal_tpu.tpu_core_devices(self.strategy)]

    def __eq__(self, other):
        return (isinstance(other, LogicalCore) and other.index == self.index
                and other.strategy is self.strategy)

    def __hash__(self):
        return hash(("LogicalCore", id(self.strategy), self.index))


def as_stage_device(device):
    """`device` as a `StageDevice`: a name of this process's CPU or GPU becomes
    `LocalCPU` or `LocalGPU`, any other name the plain kind."""
    if isinstance(device, StageDevice):
        return device
    if isinstance(device, str):
        spec = tf.DeviceSpec.from_string(device)
        local = spec.job in (None, "localhost")
        kind = {"CPU": LocalCPU, "GPU": LocalGPU}.get(spec.device_type) if local else None
        return (kind or StageDevice)(device)
    raise ValueError(
        f"A stage device must be a device name (str) or a tfpipe.devices.StageDevice, "
        f"got {type(device).__name__}: {device!r}.")


def scope(device):
    """The placement scope of `device` (a name or a `StageDevice`)."""
    return as_stage_device(device).scope()

