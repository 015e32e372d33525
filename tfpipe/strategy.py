"""`PipelineStrategy`: the devices of a pipeline, or of R data-parallel copies of
it, as a `tf.distribute.Strategy`."""

import itertools

import tensorflow as tf

from tfpipe import _internal
from tfpipe import config as config_lib
from tfpipe import placement
from tfpipe import schedules


_STRATEGIES_MADE = itertools.count()
_COLLECTIVE_KEY_STRIDE = 100_000  # group keys one strategy may use


class PipelineStrategy(tf.distribute.Strategy):
    """R data-parallel replicas of one pipeline (R = 1 by default) whose
    stages live on `devices`.

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
        A list of R lists of D devices is a grid: row r is replica r's
        pipeline, column k holds pipeline slot k of every replica.
      num_replicas: R, data-parallel replicas: the devices (given as a flat
        list, or the default ones) are split into R rows of D = len / R, in
        order. Each replica trains on 1/R of every global batch; each stage's
        variables and optimizer slots are mirrored over its column of the
        grid, and their gradients summed over it, so training equals one
        pipeline (and plain Keras) on the global batch.
        `num_replicas_in_sync` is R.
      cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`
        (e.g. `TFConfigClusterResolver()`) for multi-client data
        parallelism: every worker process of the cluster runs the same
        program with its own `TF_CONFIG` task and is one replica, whose
        pipeline runs on this process's `devices` (default: its local
        devices). Gradients and metrics are summed over the workers with TF's
        collective ops; R is the number of workers. Make the strategy before
        anything else runs TensorFlow ops (it starts this worker's server).

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
      execution: `"unrolled"` (every action is traced, so the graph grows
        with M), `"stage_functions"` (the same walk, each stage traced once as
        a `tf.function` and called per micro-batch: trace time grows far less
        with M; see `tfpipe.runtime.StageFunction`) or `"loop"` (a
        `tf.while_loop` over clock ticks, traced once whatever M; implies
        recompute `"always"`; see `tfpipe.loop`). Default: chosen per model
        by `tfpipe.config.default_execution`, `"stage_functions"` from M=8 on
        unless the schedule splits the backward, else `"unrolled"`.
      batch_norm: `"deferred"` (default) or `"plain"`; see `tfpipe.batchnorm`.

    >>> tfpipe.testing.use_logical_cpus(4)               # doctest: +SKIP
    >>> strategy = tfpipe.PipelineStrategy(num_microbatches=8)
    >>> strategy.num_stages, strategy.num_microbatches   # doctest: +SKIP
    (4, 8)
    """


    def __init__(self, devices=None, num_microbatches=None, schedule=None,
                 recompute=None, execution=None, batch_norm=None, num_replicas=None,
                 cluster_resolver=None):
        given = dict(num_microbatches=num_microbatches, schedule=schedule,
                     recompute=recompute, execution=execution, batch_norm=batch_norm)
        self._given = {k: v for k, v in given.items() if v is not None}
        self._config = config_lib.PipelineConfig.make(**self._given)
        # Read by TF's mirrored and collective machinery: its collective group
        # keys start there. Two grids in one process must not share keys (TF
        # refuses a group key reused for other devices); every worker process
        # runs the same program, so the n-th strategy gets the same base in each.
        self._collective_key_base = _COLLECTIVE_KEY_STRIDE * next(_STRATEGIES_MADE)
        if cluster_resolver is not None:
            if num_replicas is not None:
                raise ValueError(
                    f"PipelineStrategy num_replicas={num_replicas!r} with a "
                    f"cluster_resolver: the replicas are the cluster's worker processes "
                    f"(one pipeline each). Drop num_replicas.")
            extended = _internal.PipelineMultiWorkerExtended(self, cluster_resolver)
            task = extended.worker_task
            local = ([d for d in placement.available_devices("GPU") if placement.same_task(d, task)]
                     or [d for d in placement.available_devices("CPU")
                         if placement.same_task(d, task)])
            grid = device_grid(local if devices is None else devices)
            if len(grid) > 1:
                raise ValueError(
                    f"PipelineStrategy devices={devices!r} with a cluster_resolver: give "
                    f"this worker's pipeline as a flat list (each worker is one replica).")
        else:
            grid = device_grid(placement.default_devices() if devices is None else devices,
                               num_replicas)
            extended = (_internal.PipelineExtended(self, grid[0]) if len(grid) == 1
                        else _internal.PipelineGridExtended(self, grid))
        self._grid = grid
        self._devices = grid[0]
        super().__init__(extended)

    @property
    def devices(self):
        """Full names of replica 0's pipeline devices; stage k runs on
        `devices[k]` (replica r's on `device_grid[r][k]`)."""
        return self._devices

    @property
    def device_grid(self):
        """This process's rows of D device names: row r is local replica r's
        pipeline (R rows; one per worker process with a cluster_resolver)."""
        return self._grid

    @property
    def num_replicas(self):
        """R, the data-parallel replicas of all processes (`num_replicas_in_sync`)."""
        return self.num_replicas_in_sync

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

    def pipeline_devices(self, num_stages, schedule=None, replica=0):
        """(devices, stage_devices) for a model of `num_stages` stages.

        `devices` are the D devices replica `replica`'s pipeline uses (the
        first D of its row of the grid); `stage_devices[k]` is the one
        holding stage k. `schedule` defaults to the strategy's.

        Raises:
          ValueError: the schedule cannot place `num_stages` stages here.
        """
        schedule = self._config.schedule if schedule is None else schedules.get(schedule)
        count = schedules.devices_needed(schedule, num_stages)
        if count > len(self._devices):
            most = schedule.num_stages(len(self._devices))
            raise ValueError(
                f"{num_stages} stages but the strategy has only {most} "
                f"stage slots on {len(self._devices)} devices ({list(self._devices)}); "
                f"use at most {most} stages, or more devices (e.g. "
                f"tfpipe.testing.use_logical_cpus({count}) on CPU)."
            )
        devices = self._grid[replica][:count]
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
        devices = ([list(row) for row in self._grid] if len(self._grid) > 1
                   else list(self._devices))
        return (f"PipelineStrategy(devices={devices}, "
                f"num_microbatches={c.num_microbatches}, "
                f"schedule={c.schedule!r}, recompute={c.recompute!r}, "
                f"execution={c.execution!r}, batch_norm={c.batch_norm!r})")


def device_grid(devices, num_replicas=None):
    """The R x D grid of canonical device names `devices` describe.

    Args:
      devices: one name, a flat list (one pipeline, or R rows of it with
        `num_replicas=R`), or a list of R equally long lists (rows).
      num_replicas: R; None means one row for a flat list, the number of
        rows for a grid.
    Returns:
      A tuple of R tuples of D device names.
    Raises:
      ValueError: naming the argument, the value and the fix.
    """
    if isinstance(devices, str):
        devices = [devices]
    devices = list(devices)
    if not devices:
        raise ValueError("PipelineStrategy needs at least one device; devices=[] was given.")
    nested = [isinstance(d, (list, tuple)) for d in devices]
    if any(nested) and not all(nested):
        raise ValueError(
            f"PipelineStrategy devices={devices!r} mixes names and lists: give a flat "
            f"list (one pipeline) or a list of equally long rows (one per replica).")
    if all(nested):
        rows = [list(row) for row in devices]
        if len({len(row) for row in rows}) != 1 or not rows[0]:
            raise ValueError(
                f"PipelineStrategy devices={devices!r}: every row (replica) needs the "
                f"same number of devices, at least one; got rows of "
                f"{[len(row) for row in rows]}.")
        if num_replicas is not None and num_replicas != len(rows):
            raise ValueError(
                f"PipelineStrategy num_replicas={num_replicas!r} but devices has "
                f"{len(rows)} rows; drop num_replicas or give that many rows.")
    else:
        r = 1 if num_replicas is None else num_replicas
        if not isinstance(r, int) or isinstance(r, bool) or r < 1 or len(devices) % r:
            raise ValueError(
                f"PipelineStrategy num_replicas={num_replicas!r} must be a positive int "
                f"that divides the {len(devices)} devices {devices} into equal rows; "
                f"use one of {[n for n in range(1, len(devices) + 1) if len(devices) % n == 0]}.")
        d = len(devices) // r
        rows = [devices[i * d:(i + 1) * d] for i in range(r)]
    grid = tuple(tuple(placement.canonical_device(name) for name in row) for row in rows)
    flat = [name for row in grid for name in row]
    if len(set(flat)) != len(flat):
        raise ValueError(f"PipelineStrategy devices must be distinct, got {flat}.")
    return grid


def current_pipeline_strategy():
    """The `PipelineStrategy` in scope, or None."""
    strategy = tf.distribute.get_strategy()
    return strategy if isinstance(strategy, PipelineStrategy) else None
