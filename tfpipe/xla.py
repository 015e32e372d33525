"""A step compiled as one XLA program: when it is allowed, and the static
shapes it needs.

`jit_compile=True` compiles the whole step when every stage sits on one
device or on the cores of one TPU replica; on several devices each stage
function is compiled as its own program on its own device (`stage_xla`),
since one XLA cluster would pull every stage onto one. The loop step's
TensorLists and a TPU need every batch's N to be a multiple of M
(`check_static_batch`).
"""

import numpy as np
import tensorflow as tf

from tfpipe import _internal
from tfpipe import devices as devices_lib


def in_xla_program():
    """True while tracing code that XLA compiles as one program
    (`jit_compile=True`, or a TPU computation)."""
    return _internal.in_xla_context()


def needs_stage_functions(jit_compile, pipeline_devices):
    """Whether `compile(jit_compile=...)` compiles each stage as its own XLA
    program, which needs execution="stage_functions": `True` on several
    devices."""
    return jit_compile is True and len(set(pipeline_devices)) > 1


def stage_xla(jit_compile, pipeline_devices, stage_functions):
    """How `PipelinedModel.compile(jit_compile=...)` uses XLA on devices
    tfpipe places ops on by name: (whole step as one program, each stage
    function as its own program on its device). (A TPU's host compiles
    differently: `tfpipe.tpu.TPUPipelineHost.xla_modes`.)

    One device: `True` compiles the whole step, as Keras does. Several
    devices: one program would pull every stage onto one device, so `True`
    compiles each stage's forward and backward separately, which needs
    execution="stage_functions" (else a ValueError); Keras' `"auto"` does the
    same when every device is of a kind Keras' "auto" compiles on (a GPU:
    `StageDevice.auto_xla`), and nothing elsewhere.
    """
    devices = list(dict.fromkeys(pipeline_devices))
    if len(devices) <= 1:
        return jit_compile is True, False
    if jit_compile == "auto":
        auto = all(devices_lib.as_stage_device(d).auto_xla for d in devices)
        return False, bool(auto and stage_functions)
    if jit_compile is not True:
        return False, False
    if not stage_functions:
        raise ValueError(
            f"PipelinedModel.compile(jit_compile=True) on several devices "
            f"({[str(d) for d in devices]}) "
            f"compiles each stage as its own XLA program on its own device, which needs "
            f"execution='stage_functions' (one program for the whole step would pull every "
            f"stage onto one device), but the execution was set to another. Pass "
            f"execution='stage_functions' (or leave it unset: tfpipe then chooses it) to the "
            f"PipelineStrategy or the model, or use jit_compile=False.")
    return False, True


def _leading_dim(spec):
    for leaf in tf.nest.flatten(spec):
        shape = getattr(leaf, "shape", None)
        if shape is not None and shape.rank:
            return True, shape[0]
    return False, None


def static_batch_problem(x, batch_size, num_microbatches):
    """A sentence saying what keeps the batches of `x` (what `fit` takes: a
    `tf.data.Dataset` or a nest of arrays) from all having one static size
    that is a multiple of `num_microbatches`; None if nothing does, or if `x`
    is a generator or `PyDataset`. `batch_size` None: Keras' 32 for arrays."""
    m = int(num_microbatches)
    if x is None:
        return None
    if isinstance(x, tf.data.Dataset):
        found, rows = _leading_dim(x.element_spec)
        if not found:
            return None
        if rows is None:
            return ("the dataset's batch dimension is None (its last batch may be "
                    "smaller): batch it with .batch(n, drop_remainder=True)")
        if rows % m:
            return f"the dataset's batches have {rows} rows, not a multiple of {m}"
        return None
    if callable(getattr(x, "__next__", None)) or hasattr(x, "__getitem__") and \
            hasattr(x, "on_epoch_end"):
        return None  # a generator or PyDataset
    leaves = [leaf for leaf in tf.nest.flatten(x) if leaf is not None]
    if not leaves or not np.shape(leaves[0]):
        return None
    examples = int(np.shape(leaves[0])[0])
    size = 32 if batch_size is None else int(batch_size)
    if size % m:
        return f"batch_size={size} is not a multiple of {m}"
    if examples % size:
        return (f"{examples} examples in batches of {size} leave a last batch of "
                f"{examples % size} rows")
    return None


def check_static_batch(x, batch_size, num_microbatches, what, reason, num_replicas=1):
    """Raises a `ValueError` naming the fix if `static_batch_problem` finds
    one; `what` is the call (`"fit"`), `reason` why static batches are needed
    (`"a TPU"`). With R = `num_replicas` replicas each global batch is split
    R ways, then M ways: it must be a multiple of R x M."""
    m, r = int(num_microbatches), int(num_replicas)
    problem = static_batch_problem(x, batch_size, m * r)
    if problem is None:
        return
    multiple = (f"num_microbatches={m}" if r == 1 else
                f"num_replicas x num_microbatches = {r} x {m} = {m * r}")
    raise ValueError(
        f"{what}: {reason} needs every batch to have the same static size, a multiple of "
        f"{multiple}, but {problem}. Use a tf.data.Dataset batched with .batch(n, "
        f"drop_remainder=True) where n is a multiple of {m * r} (a ragged batch needs "
        f"drop_remainder=True), or arrays whose length is a multiple of batch_size.")
