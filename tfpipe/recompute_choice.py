"""Which recompute mode a run gets when it was given none.

Re-computing a stage's activations in the backward pass saves memory and
costs a second forward of that stage: on the transformer benchmark at K=2,
"except_last" steps take ~20% longer than "never" (BUILD.md, "Speed-up on a
transformer").
So a run given no recompute mode keeps every activation ("never") where the
predicted peak fits the memory, and re-computes ("except_last", which keeps
only each stage's input) where it does not, or where tfpipe cannot tell:

- the peak of "never" per device is predicted by `tfpipe.prediction` from
  unit costs measured on the first micro-batch of the run's first batch
  (`tfpipe.costs.measure`, untimed): parameters, optimizer slots, gradients
  and the activations the schedule keeps alive at once;
- a device's memory is what its `StageDevice.memory()` reports (a GPU: the
  bytes TF's allocator may use; a CPU: the host's, which every CPU device and
  replica of the process shares), or `device_memory_bytes` per device where
  the user gives it; a TPU core or another task's device reports none;
- "never" when, in every memory pool, the summed peaks of the devices drawing
  on it are at most `FRACTION` of it. The rest is for what the prediction
  does not count: allocator fragmentation, the data pipeline, communication
  buffers, the optimizer update's temporaries.

At M = 1 the two modes are the same run (the last micro-batch is the only
one), so nothing is measured.
"""

import typing
from concurrent import futures

import tensorflow as tf

from tfpipe import costs
from tfpipe import prediction

FRACTION = 0.5
MODE_FITS, MODE_SAFE = "never", "except_last"
_UNREPORTED = ("the devices do not report their memory; pass device_memory_bytes to the "
               "PipelineStrategy")


class Choice(typing.NamedTuple):
    """The mode chosen and why (one sentence, shown by `model.summary()`)."""
    mode: str
    reason: str


def _size(nbytes):
    """'1.5 GiB', '3.2 MiB', '12.0 KiB'."""
    unit = next(u for u in (3, 2, 1, 0) if nbytes >= 1024**u or u == 0)
    return f"{nbytes / 1024**unit:.1f} {('B', 'KiB', 'MiB', 'GiB')[unit]}"


def choose(graph, balance, first_batch, x, config, replica_devices, optimizer,
           device_memory_bytes=None):
    """The recompute mode for a run given none (see the module docstring).

    Args:
      graph: the cut model's `tfpipe.graph.Graph`, hand-made stages' chain
        (`tfpipe.graph.stage_chain`), or None.
      balance: units per stage (K ints).
      first_batch: a function returning the run's first batch (x, y,
        sample_weight; all replicas' rows), or None where none was seen.
      x: where `first_batch` is None, the inputs of the step being traced
        (their static shapes are measured, on zeros), or None.
      config: the model's `tfpipe.config.PipelineConfig` (M, the schedule).
      replica_devices: R lists of the D `StageDevice`s of each replica.
      optimizer: the compiled optimizer (its slots per parameter), or None.
      device_memory_bytes: bytes each device may use, or None for what the
        devices report.
    Returns:
      A `Choice`.
    """
    m = config.num_microbatches
    if m == 1:
        return Choice(MODE_SAFE, "num_microbatches=1: the one micro-batch is the last, "
                                 "kept as with 'never'")
    if graph is None:
        return Choice(MODE_SAFE, "hand-made stages taking a nest of inputs: tfpipe measures "
                                 "a model it cut (from_model), or stages taking one tensor")
    if first_batch is None and x is None:
        return Choice(MODE_SAFE, "the step was made before any data was seen")
    if _pools(replica_devices, device_memory_bytes) is None:
        return Choice(MODE_SAFE, _UNREPORTED)
    # In a thread of its own: eagerly and with gradients recorded, also where
    # a step is being traced (`tf.init_scope` would pause the tapes that find
    # what a backward keeps).
    with futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(_measured, graph, balance, first_batch, x, config,
                             replica_devices, optimizer, device_memory_bytes).result()


def _measured(graph, balance, first_batch, x, config, replica_devices, optimizer,
              device_memory_bytes):
    """`choose`, from the measurement on: the predicted peak of "never"."""
    m = config.num_microbatches
    try:
        inputs = graph.standardize_inputs(first_batch()[0] if first_batch else
                                          tf.nest.map_structure(_zeros_like, x))
    except StopIteration:
        return Choice(MODE_SAFE, "the data has no first batch to measure")
    except (TypeError, ValueError) as err:  # shapes not static, say
        return Choice(MODE_SAFE, f"the inputs could not be read ({type(err).__name__}: {err})")
    try:
        rows = -(-costs.rows_of(inputs) // (m * len(replica_devices)))
        if not rows:
            return Choice(MODE_SAFE, "the first batch has no rows to measure")
        sample = tf.nest.map_structure(lambda t: t[:rows], inputs)  # one micro-batch
        units, tensor_bytes = costs.measure(graph, [sample], times=False)
    except Exception as err:  # pylint: disable=broad-except
        # Never wrong, only slower: recomputing needs no prediction.
        return Choice(MODE_SAFE, f"the activations could not be measured "
                                 f"({type(err).__name__}: {err})")
    names = [str(d) for d in replica_devices[0]]
    peaks = prediction.evaluate(graph, units, tensor_bytes, rows, rows * m, m,
                                config.schedule, MODE_FITS, balance, names,
                                optimizer_slots(optimizer), False).device_peak_bytes
    return decide(peaks, replica_devices, device_memory_bytes)


def decide(peaks, replica_devices, device_memory_bytes=None):
    """The mode for `peaks`, the bytes "never" is predicted to need on each
    device of one replica (D numbers), where `replica_devices` are R lists of
    D `StageDevice`s drawing on the memory each reports (or
    `device_memory_bytes` each)."""
    pools = _pools(replica_devices, device_memory_bytes)
    if pools is None:
        return Choice(MODE_SAFE, _UNREPORTED)
    need = {}
    for devices in replica_devices:
        for device, peak in zip(devices, peaks):
            pool = pools[device]
            need[pool] = need.get(pool, 0) + peak
    (pool, limit), used = max(((p, need[p] / p[1]) for p in need), key=lambda x: x[1])
    verdict = (f"'never' is predicted to need {_size(need[pool, limit])} of {pool}'s "
               f"{_size(limit)}")
    if used <= FRACTION:
        return Choice(MODE_FITS, f"{verdict}, within {FRACTION:.0%} of it")
    return Choice(MODE_SAFE, f"{verdict}, more than {FRACTION:.0%} of it")


def _zeros_like(t):
    """Zeros of `t`'s static shape and dtype (a traced input's stand-in)."""
    return tf.zeros(t.shape, t.dtype)


def _pools(replica_devices, device_memory_bytes):
    """{device: (pool name, bytes)}, or None if a device reports no memory."""
    pools = {}
    for devices in replica_devices:
        for device in devices:
            pools[device] = ((str(device), int(device_memory_bytes))
                             if device_memory_bytes is not None else device.memory())
            if pools[device] is None:
                return None
    return pools


def optimizer_slots(optimizer):
    """Slots per parameter of `optimizer` as the planner counts them
    (`tfpipe.prediction.optimizer_slots`); an optimizer it does not know
    counts as Adam's 2, none (not compiled yet) as 0."""
    if optimizer is None:
        return 0.0
    try:
        return prediction.optimizer_slots(optimizer)
    except ValueError:
        return 2.0
