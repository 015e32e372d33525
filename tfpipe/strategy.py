"""`PipelineStrategy`: the devices of one pipeline, as a `tf.distribute.Strategy`."""

import tensorflow as tf

from tfpipe import _internal
from tfpipe import placement
from tfpipe import recompute as recompute_lib
from tfpipe import schedules


class PipelineStrategy(tf.distribute.Strategy):
    """One pipeline replica whose stages live on `devices`, one stage each.

    Variables created under `scope()` go where the enclosing `tf.device` puts
    them (tfpipe builds stage k under `devices[k]`), optimizer slots go next to
    their variable, and each optimizer update runs on its variable's device.

    Args:
      devices: device names, stage k on `devices[k]`. Default: all logical
        GPUs, or all logical CPUs if there is no GPU.
      num_microbatches: M, micro-batches per mini-batch (default for models).
      schedule: `"gpipe"` or a `tfpipe.schedules` instance.
      recompute: `"always"`, `"except_last"` (default) or `"never"`.

    >>> tfpipe.testing.use_logical_cpus(4)               # doctest: +SKIP
    >>> strategy = tfpipe.PipelineStrategy(num_microbatches=8)
    >>> strategy.num_stages, strategy.num_microbatches   # doctest: +SKIP
    (4, 8)
    """

    def __init__(self, devices=None, num_microbatches=1, schedule="gpipe",
                 recompute="except_last"):
        if devices is None:
            devices = placement.default_devices()
        if isinstance(devices, str):
            devices = [devices]
        devices = [placement.canonical_device(d) for d in devices]
        if not devices:
            raise ValueError("PipelineStrategy needs at least one device.")
        if len(set(devices)) != len(devices):
            raise ValueError(f"PipelineStrategy devices must be distinct, got {devices}.")
        self._num_microbatches = validate_num_microbatches(num_microbatches)
        self._schedule = schedules.get(schedule)
        self._recompute = recompute_lib.validate(recompute)
        self._devices = tuple(devices)
        super().__init__(_internal.PipelineExtended(self, self._devices))

    @property
    def devices(self):
        """Full names of the pipeline's devices; stage k runs on `devices[k]`."""
        return self._devices

    @property
    def num_stages(self):
        """The most stages this strategy can place: one per device."""
        return len(self._devices)

    @property
    def num_microbatches(self):
        return self._num_microbatches

    @property
    def schedule(self):
        return self._schedule

    @property
    def recompute(self):
        return self._recompute

    def __repr__(self):
        return (f"PipelineStrategy(devices={list(self._devices)}, "
                f"num_microbatches={self._num_microbatches}, "
                f"schedule={self._schedule!r}, recompute={self._recompute!r})")


def validate_num_microbatches(num_microbatches):
    if (isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int)
            or num_microbatches < 1):
        raise ValueError(
            f"num_microbatches must be a positive integer, got {num_microbatches!r}."
        )
    return num_microbatches


def current_pipeline_strategy():
    """The `PipelineStrategy` in scope, or None."""
    strategy = tf.distribute.get_strategy()
    return strategy if isinstance(strategy, PipelineStrategy) else None
