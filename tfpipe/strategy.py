"""`PipelineStrategy`: the devices of one pipeline, as a `tf.distribute.Strategy`."""

import tensorflow as tf

from tfpipe import _internal
from tfpipe import config as config_lib
from tfpipe import placement
from tfpipe import schedules


class PipelineStrategy(tf.distribute.Strategy):
    """One pipeline replica whose stages live on `devices`.

    Variables created under `scope()` go where the enclosing `tf.device` puts
    them (tfpipe builds stage k under `devices[k]`), optimizer slots go next to
    their variable, and each optimizer update runs on its variable's device.

    Args:
      devices: device names. Stage k goes on `devices[k]` (GPipe, 1F1B), or
        on `devices[k mod D]` with `Interleaved`. Default: all logical GPUs,
        or all logical CPUs if there is no GPU. A remote device names its
        task (`"/job:worker/task:1/device:CPU:0"`; without the task it is
        refused when several tasks have it). On a client connected to a
        cluster there is no default (it would put stage 0 on the client):
        pass `devices=tfpipe.cluster.worker_devices()`.

    The other arguments are the defaults of the models made in this scope
    (each model owns its `tfpipe.config.PipelineConfig`); None means the
    library default. Settings given here explicitly also override those a
    saved model is loaded with in this scope.

      num_microbatches: M, micro-batches per mini-batch (default 1).
      schedule: `"gpipe"` (default), `"1f1b"`, `"interleaved"` (2 stages per
        device) or a `tfpipe.schedules.Schedule` instance such as
        `Interleaved(virtual_stages=4)` or a `Table` of actions.
      recompute: `"always"`, `"except_last"` or `"never"`; default
        `"except_last"` (unrolled) or `"always"` (loop).
      execution: `"unrolled"` (default: every action is traced, so the graph
        grows with M) or `"loop"` (a `tf.while_loop` over clock ticks, traced
        once whatever M; implies recompute `"always"`). See `tfpipe.loop`.
      batch_norm: `"deferred"` (default) or `"plain"`; see `tfpipe.batchnorm`.

    >>> tfpipe.testing.use_logical_cpus(4)               # doctest: +SKIP
    >>> strategy = tfpipe.PipelineStrategy(num_microbatches=8)
    >>> strategy.num_stages, strategy.num_microbatches   # doctest: +SKIP
    (4, 8)
    """

    def __init__(self, devices=None, num_microbatches=None, schedule=None,
                 recompute=None, execution=None, batch_norm=None):
        if devices is None:
            devices = placement.default_devices()
        if isinstance(devices, str):
            devices = [devices]
        devices = [placement.canonical_device(d) for d in devices]
        if not devices:
            raise ValueError("PipelineStrategy needs at least one device.")
        if len(set(devices)) != len(devices):
            raise ValueError(f"PipelineStrategy devices must be distinct, got {devices}.")
        given = dict(num_microbatches=num_microbatches, schedule=schedule,
                     recompute=recompute, execution=execution, batch_norm=batch_norm)
        self._given = {k: v for k, v in given.items() if v is not None}
        self._config = config_lib.PipelineConfig.make(**self._given)
        self._devices = tuple(devices)
        super().__init__(_internal.PipelineExtended(self, self._devices))

    @property
    def devices(self):
        """Full names of the pipeline's devices; stage k runs on `devices[k]`."""
        return self._devices

    @property
    def num_stages(self):
        """The most stages this strategy can place with its default schedule
        (v per device; v = 1 but for `Interleaved`)."""
        return self.max_stages(self._config.schedule)

    def max_stages(self, schedule):
        """The most stages `schedule` can place on this strategy's devices."""
        schedule = schedules.get(schedule)
        if isinstance(schedule, schedules.Table):
            return schedule.num_stages(len(schedule.table))
        return schedule.num_stages(len(self._devices))

    def pipeline_devices(self, num_stages, schedule=None):
        """(devices, stage_devices) for a model of `num_stages` stages.

        `devices` are the D devices the pipeline uses (the first D of
        `self.devices`); `stage_devices[k]` is the one holding stage k.
        `schedule` defaults to the strategy's.

        Raises:
          ValueError: the schedule cannot place `num_stages` stages here.
        """
        schedule = self._config.schedule if schedule is None else schedules.get(schedule)
        v = schedule.virtual_stages
        if isinstance(schedule, schedules.Table):
            count = len(schedule.table)
            if num_stages != schedule.num_stages(count):
                raise ValueError(
                    f"The schedule table has {schedule.num_stages(count)} stages "
                    f"but the model has {num_stages}."
                )
        elif num_stages % v:
            raise ValueError(
                f"{schedule!r} puts {v} stages on each device, so the number of "
                f"stages must be a multiple of {v}; got {num_stages}. Use "
                f"{v * -(-num_stages // v)} stages or another virtual_stages."
            )
        else:
            count = num_stages // v
        if count > len(self._devices):
            most = schedule.num_stages(len(self._devices))
            raise ValueError(
                f"{num_stages} stages but the strategy has only {most} "
                f"stage slots on {len(self._devices)} devices ({list(self._devices)}); "
                f"use at most {most} stages, or more devices (e.g. "
                f"tfpipe.testing.use_logical_cpus({count}) on CPU)."
            )
        devices = self._devices[:count]
        return devices, tuple(devices[schedule.stage_device(k, count)]
                              for k in range(num_stages))

    @property
    def config(self):
        """The default `PipelineConfig` of models made in this scope."""
        return self._config

    @property
    def given_settings(self):
        """The settings this strategy was given explicitly (a dict)."""
        return dict(self._given)

    @property
    def num_microbatches(self):
        return self._config.num_microbatches

    @property
    def schedule(self):
        return self._config.schedule

    @property
    def recompute(self):
        return self._config.recompute

    @property
    def execution(self):
        return self._config.execution

    def __repr__(self):
        c = self._config
        return (f"PipelineStrategy(devices={list(self._devices)}, "
                f"num_microbatches={c.num_microbatches}, "
                f"schedule={c.schedule!r}, recompute={c.recompute!r}, "
                f"execution={c.execution!r}, batch_norm={c.batch_norm!r})")


def current_pipeline_strategy():
    """The `PipelineStrategy` in scope, or None."""
    strategy = tf.distribute.get_strategy()
    return strategy if isinstance(strategy, PipelineStrategy) else None
