"""Which device each stage runs on, and checks that variables stay there.

Placement in TensorFlow fails silently: a misspelt device name falls back to
CPU:0, layers built symbolically land on the default device, and so do lazily
created optimizer slots. This module resolves device names strictly and builds
stages eagerly under their device so none of that can happen unnoticed.
"""

import tensorflow as tf

from tfpipe import _internal


def available_devices(device_type=None):
    """Names of the logical devices TensorFlow sees, in index order."""
    devices = tf.config.list_logical_devices(device_type)
    return [d.name for d in devices]


def default_devices():
    """All logical GPUs if there are any, else all logical CPUs."""
    return available_devices("GPU") or available_devices("CPU")


def canonical_device(name):
    """Resolves a device string to the name TensorFlow lists for that device.

    `"/CPU:1"`, `"cpu:1"`, `"/device:CPU:1"` and
    `"/job:localhost/replica:0/task:0/device:CPU:1"` all resolve to
    `"/device:CPU:1"` on one machine.

    Raises:
      ValueError: no logical device matches `name` (TensorFlow itself would
        silently fall back to CPU:0).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"A device must be a non-empty string, got {name!r}.")
    try:
        spec = tf.DeviceSpec.from_string(name.strip())
    except ValueError as err:
        raise ValueError(f"Device {name!r} is not a valid device string: {err}") from None
    known = available_devices()
    for full in known:
        have = tf.DeviceSpec.from_string(full)
        if (
            spec.device_type is not None
            and spec.device_type.upper() == have.device_type
            and (spec.device_index or 0) == have.device_index
            # Local devices are listed without job/replica/task; the process
            # itself is /job:localhost/replica:0/task:0.
            and spec.job in (None, have.job or "localhost")
            and spec.replica in (None, have.replica or 0)
            and spec.task in (None, have.task or 0)
        ):
            return full
    raise ValueError(
        f"Device {name!r} does not exist. Available logical devices: {known}. "
        f"To get more logical CPUs on one machine call "
        f"tfpipe.testing.use_logical_cpus(n) before TensorFlow initialises."
    )


def device_of(variable):
    """The full device name of a Keras or TF variable's storage."""
    value = getattr(variable, "value", variable)
    return value.device


def misplaced_variables(variables, device):
    """Paths of those `variables` not stored on `device` (type and index)."""
    want = tf.DeviceSpec.from_string(device)
    bad = []
    for v in variables:
        have = tf.DeviceSpec.from_string(device_of(v))
        if (have.device_type, have.device_index) != (want.device_type, want.device_index):
            bad.append(f"{getattr(v, 'path', v.name)} on {device_of(v)}")
    return bad


def place_variables(stages, stage_devices):
    """Puts every variable of every stage on its stage's device.

    A variable used by several stages (a shared layer, a tied embedding)
    lives on the device of the first stage that uses it. Variables already
    there are left alone; others get their storage re-created there with the
    same value (`tfpipe._internal.move_variable`); the layers keep their
    variable objects.

    Returns:
      {id(variable): stage index} for every variable: its home stage.
    """
    homes = {}
    for k, (stage, device) in enumerate(zip(stages, stage_devices)):
        want = tf.DeviceSpec.from_string(device)
        for v in stage.variables:
            if id(v) in homes:
                continue
            homes[id(v)] = k
            have = tf.DeviceSpec.from_string(device_of(v))
            if (have.device_type, have.device_index) != (want.device_type, want.device_index):
                _internal.move_variable(v, device)
    return homes
