"""Which device each stage runs on, and checks that variables stay there.

Placement in TensorFlow fails silently: a misspelt device name falls back to
CPU:0, layers built symbolically land on the default device, and so do lazily
created optimizer slots. This module resolves device names strictly and builds
stages eagerly under their device so none of that can happen unnoticed.
"""

import collections.abc

import keras
import tensorflow as tf

from tfpipe import _internal
from tfpipe import devices as devices_lib


def available_devices(device_type=None):
    """Names of the logical devices TensorFlow sees, in index order."""
    devices = tf.config.list_logical_devices(device_type)
    return [d.name for d in devices]


def host_device():
    """This process's first CPU device (None if TF lists none)."""
    cpus = available_devices("CPU")
    return cpus[0] if cpus else None


def default_devices():
    """All logical GPUs if there are any, else all logical CPUs (of this
    process). Raises ValueError on a client connected to a cluster, where the
    default would put stage 0 on the client."""
    remote = [d for d in available_devices() if _full_spec(d)[0] != _LOCAL_JOB]
    if remote:
        raise ValueError(
            f"PipelineStrategy() on a connected client: the default devices would put "
            f"stage 0 on this client's own CPU, not on a worker (remote devices: "
            f"{remote}). Name the stage devices, e.g. PipelineStrategy(devices="
            f"tfpipe.cluster.worker_devices()) for stage k on /job:worker/task:k.")
    return available_devices("GPU") or available_devices("CPU")


# The job of a device name without one: this process's own device.
_LOCAL_JOB = "localhost"


def _full_spec(name):
    """(job, replica, task, device type, index) of a device name, a missing job
    meaning this process (`/job:localhost/replica:0/task:0`)."""
    spec = tf.DeviceSpec.from_string(str(name))
    return (spec.job or _LOCAL_JOB, spec.replica or 0, spec.task or 0,
            (spec.device_type or "").upper(), spec.device_index or 0)


def same_device(a, b):
    """Whether device names `a` and `b` name the same device: job, replica,
    task, type and index (a name without a job is this process's device)."""
    return _full_spec(a) == _full_spec(b)


def same_task(device, task):
    """Whether `device` is on `task` (`"/job:worker/task:1"`): same job,
    replica and task."""
    return _full_spec(device)[:3] == _full_spec(task)[:3]


def canonical_device(name):
    """Resolves a device string to the name TensorFlow lists for that device
    (`"cpu:1"` and `"/job:localhost/replica:0/task:0/device:CPU:1"` give
    `"/device:CPU:1"` on one machine). Raises ValueError if no logical device,
    or several tasks' devices, match (TensorFlow would silently take CPU:0).
    A `tfpipe.devices.StageDevice` stands for its name."""
    if isinstance(name, devices_lib.StageDevice):
        name = name.name
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"A device must be a non-empty string, got {name!r}.")
    try:
        spec = tf.DeviceSpec.from_string(name.strip())
    except ValueError as err:
        raise ValueError(f"Device {name!r} is not a valid device string: {err}") from None
    known = available_devices()
    matches = []
    for full in known:
        have = tf.DeviceSpec.from_string(full)
        if (
            spec.device_type is not None
            and spec.device_type.upper() == have.device_type
            and (spec.device_index or 0) == have.device_index
            # A missing replica or task matches any: several matches are
            # refused below rather than read as task 0.
            and (spec.job or _LOCAL_JOB) == (have.job or _LOCAL_JOB)
            and spec.replica in (None, have.replica or 0)
            and spec.task in (None, have.task or 0)
        ):
            matches.append(full)
    if len(matches) > 1:
        raise ValueError(
            f"Device {name!r} is ambiguous: it names no task, and the cluster has "
            f"{len(matches)} tasks with that device: {matches}. Use the full name with "
            f"the task, e.g. {matches[0]!r} (TensorFlow would silently take task 0).")
    if matches:
        return matches[0]
    raise ValueError(
        f"Device {name!r} does not exist. Available logical devices: {known}. "
        f"To get more logical CPUs on one machine call "
        f"tfpipe.testing.use_logical_cpus(n) before TensorFlow initialises.")


def device_of(variable):
    """The full device name of a Keras or TF variable's storage."""
    value = getattr(variable, "value", variable)
    return value.device


def misplaced_variables(variables, device):
    """Paths of those `variables` not stored on `device` (job, replica, task,
    type and index: a stage-1 variable on another task's CPU:0 is misplaced).

    `device` may be a list of R devices, one per data-parallel replica: then
    each variable must be mirrored with copy r on `device[r]`.
    """
    wanted = [str(d) for d in (device if isinstance(device, (list, tuple)) else [device])]
    bad = []
    for v in variables:
        have = [c.device for c in _internal.local_copies(v)]
        if len(have) != len(wanted) or not all(map(same_device, have, wanted)):
            where = have[0] if len(have) == 1 else have
            bad.append(f"{getattr(v, 'path', v.name)} on {where}")
    return bad


def place_variables(stages, stage_devices):
    """Puts every variable of every stage on its stage's device (a device, or
    stage k's column of R devices of a data-parallel grid, mirrored); returns
    {id(variable): home stage index}.

    A variable shared by several stages lives on the first one's device.
    Misplaced ones get their storage re-created there with the same value
    (`tfpipe._internal.move_variable`); the layers keep their variable objects.
    """
    homes = {}
    for k, (stage, device) in enumerate(zip(stages, stage_devices)):
        for v in stage.variables:
            if id(v) in homes:
                continue
            homes[id(v)] = k
            wanted = device
            place = getattr(device, "place_variable", None)
            if place is not None:  # a device kind that places its own (a TPU core)
                wanted = place(v)
                if not all(_listed(name) for name in wanted):
                    # This process does not have those devices (a strategy that only
                    # traces: tfpipe.testing.tpu_strategy); its variables fall back.
                    continue
            elif misplaced_variables([v], device):
                first = device[0] if isinstance(device, (list, tuple)) else device
                _internal.move_variable(v, tf.device(str(first)))
            bad = misplaced_variables([v], wanted)
            if bad:  # TensorFlow fell back to another device: never go on
                raise RuntimeError(f"tfpipe placement bug: stage {k} variable {bad[0]}.")
    return homes


def _listed(name):
    """Whether this process lists the device `name`."""
    return any(same_device(name, have) for have in available_devices())


def nested_optimizers(optimizer):
    """`optimizer` and every Keras optimizer reachable from its attributes,
    through lists, tuples, sets and mappings (an `OptimizerMap`), each once."""
    found, seen, frontier = [], set(), [optimizer]
    while frontier:
        obj = frontier.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, keras.optimizers.Optimizer):
            found.append(obj)
            frontier += list(vars(obj).values())
        elif isinstance(obj, collections.abc.Mapping):
            frontier += list(obj.values()) + [getattr(obj, "default_optimizer", None)]
        elif isinstance(obj, (list, tuple, set)):
            frontier += list(obj)
    return found
