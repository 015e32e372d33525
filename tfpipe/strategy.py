"""`PipelineStrategy`: the devices of one pipeline, as a `tf.distribute.Strategy`."""

import tensorflow as tf

from tfpipe import _internal
from tfpipe import placement
from tfpipe import recompute as recompute_lib
from tfpipe import schedules


class PipelineStrategy(tf.distribute.Strategy):
    """One pipeline replica whose stages live on `devices`.

    Variables created under `scope()` go where the enclosing `tf.device` puts
    them (tfpipe builds stage k under `devices[k]`), optimizer slots go next to
    their variable, and each optimizer update runs on its variable's device.

    Args:
      devices: device names. Stage k goes on `devices[k]` (GPipe, 1F1B), or
        on `devices[k mod D]` with `Interleaved`. Default: all logical GPUs,
        or all logical CPUs if there is no GPU.
      num_microbatches: M, micro-batches per mini-batch (default for models).
      schedule: `"gpipe"` (default), `"1f1b"`, `"interleaved"` (2 stages per
        device) or a `tfpipe.schedules.Schedule` instance such as
        `Interleaved(virtual_stages=4)` or a `Table` of actions.
      recompute: `"always"`, `"except_last"` or `"never"`; default
        `"except_last"` (unrolled) or `"always"` (loop).
      execution: `"unrolled"` (default: every action is traced, so the graph
        grows with M) or `"loop"` (a `tf.while_loop` over clock ticks, traced
        once whatever M; implies recompute `"always"`). See `tfpipe.loop`.

    >>> tfpipe.testing.use_logical_cpus(4)               # doctest: +SKIP
    >>> strategy = tfpipe.PipelineStrategy(num_microbatches=8)
    >>> strategy.num_stages, strategy.num_microbatches   # doctest: +SKIP
    (4, 8)
    """

    def __init__(self, devices=None, num_microbatches=1, schedule="gpipe",
                 recompute=None, execution="unrolled"):
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
        self._recompute_arg = recompute
        self._recompute = recompute_lib.resolve(recompute, execution)
        self._execution = execution
        self._devices = tuple(devices)
        super().__init__(_internal.PipelineExtended(self, self._devices))

    @property
    def devices(self):
        """Full names of the pipeline's devices; stage k runs on `devices[k]`."""
        return self._devices

    @property
    def num_stages(self):
        """The most stages this strategy can place (v per device; v = 1 but
        for `Interleaved`)."""
        return self._schedule.num_stages(len(self._devices))

    def pipeline_devices(self, num_stages):
        """(devices, stage_devices) for a model of `num_stages` stages.

        `devices` are the D devices the pipeline uses (the first D of
        `self.devices`); `stage_devices[k]` is the one holding stage k.

        Raises:
          ValueError: the schedule cannot place `num_stages` stages here.
        """
        v = self._schedule.virtual_stages
        if isinstance(self._schedule, schedules.Table):
            count = len(self._schedule.table)
            if num_stages != self._schedule.num_stages(count):
                raise ValueError(
                    f"The schedule table has {self._schedule.num_stages(count)} stages "
                    f"but the model has {num_stages}."
                )
        elif num_stages % v:
            raise ValueError(
                f"{self._schedule!r} puts {v} stages on each device, so the number of "
                f"stages must be a multiple of {v}; got {num_stages}. Use "
                f"{v * -(-num_stages // v)} stages or another virtual_stages."
            )
        else:
            count = num_stages // v
        if count > len(self._devices):
            raise ValueError(
                f"{num_stages} stages but the strategy has only {self.num_stages} "
                f"stage slots on {len(self._devices)} devices ({list(self._devices)}); "
                f"use at most {self.num_stages} stages, or more devices (e.g. "
                f"tfpipe.testing.use_logical_cpus({count}) on CPU)."
            )
        devices = self._devices[:count]
        return devices, tuple(devices[self._schedule.stage_device(k, count)]
                              for k in range(num_stages))

    @property
    def num_microbatches(self):
        return self._num_microbatches

    @property
    def schedule(self):
        return self._schedule

    @property
    def recompute(self):
        return self._recompute

    @property
    def execution(self):
        return self._execution

    def __repr__(self):
        return (f"PipelineStrategy(devices={list(self._devices)}, "
                f"num_microbatches={self._num_microbatches}, "
                f"schedule={self._schedule!r}, recompute={self._recompute!r}, "
                f"execution={self._execution!r})")


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
