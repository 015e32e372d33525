"""`PipelineStrategy`: the devices of a pipeline, or of R data-parallel copies of
it, as a `tf.distribute.Strategy`."""

import itertools

import tensorflow as tf

from tfpipe import _internal_distribute
from tfpipe import config as config_lib
from tfpipe import devices as devices_lib
from tfpipe import host
from tfpipe import placement
from tfpipe import tpu


_STRATEGIES_MADE = itertools.count()
_COLLECTIVE_KEY_STRIDE = 100_000  # group keys one strategy may use


class PipelineStrategy(host.PipelineHost, tf.distribute.Strategy):
    """R data-parallel replicas of one pipeline (R = 1 by default) whose
    stages live on `devices`.

    Variables created under `scope()` go where the enclosing `tf.device` puts
    them, optimizer slots and updates with their variable.

    Args:
      devices: device names, stage k on `devices[stage_device(k)]`. Default:
        all logical GPUs, else all logical CPUs; none on a client connected
        to a cluster (pass `tfpipe.cluster.worker_devices()`). A list of R
        lists of D devices is a grid: row r is replica r's pipeline.
      num_replicas: R: a flat (or default) device list is split into R rows.
        Each replica trains on 1/R of every global batch; stage variables are
        mirrored over their grid column and their gradients summed.
      cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`
        for multi-client data parallelism: each worker process of the
        cluster is one replica, its pipeline on this process's `devices`
        (default: its local devices); gradients and metrics are summed with
        TF's collective ops. Make the strategy before any other TF op.
      peer_timeout_s: with a `cluster_resolver`, how long (seconds) the
        start-up waits for every worker and each collective for its peers,
        and the heartbeats' timeout (half of it): a gone worker then fails
        the step with a TensorFlow error instead of blocking forever. None:
        TensorFlow's defaults (no collective timeout).
      device_memory_bytes: the bytes each device may use, where a model
        given no recompute mode chooses one from memory
        (`tfpipe.recompute_choice`); None: what each device reports (a GPU's
        memory, the host's for CPUs).
      num_microbatches, schedule, recompute, execution, batch_norm,
        call_losses: the defaults of models made in this scope
        (`tfpipe.config.PipelineConfig`; None: the library default). Settings
        given here explicitly also override those of a saved model loaded in
        this scope.

    >>> tfpipe.testing.use_logical_cpus(4)               # doctest: +SKIP
    >>> strategy = tfpipe.PipelineStrategy(num_microbatches=8)
    >>> strategy.num_stages, strategy.num_microbatches   # doctest: +SKIP
    (4, 8)
    """

    def __init__(self, devices=None, num_microbatches=None, schedule=None,
                 recompute=None, execution=None, batch_norm=None, num_replicas=None,
                 cluster_resolver=None, call_losses=None, peer_timeout_s=None,
                 device_memory_bytes=None):
        given = dict(num_microbatches=num_microbatches, schedule=schedule,
                     recompute=recompute, execution=execution, batch_norm=batch_norm,
                     call_losses=call_losses)
        self._given = {k: v for k, v in given.items() if v is not None}
        self._config = config_lib.PipelineConfig.make(**self._given)
        if device_memory_bytes is not None and (
                isinstance(device_memory_bytes, bool)
                or not isinstance(device_memory_bytes, (int, float)) or device_memory_bytes <= 0):
            raise ValueError(
                f"device_memory_bytes must be a positive number of bytes per device (e.g. "
                f"16 * 2**30), got {device_memory_bytes!r}; or None for what each device "
                f"reports.")
        self.device_memory_bytes = device_memory_bytes
        # TF's collective group keys start here: two grids in one process must
        # not share keys, and the n-th strategy gets the same base in every
        # worker process (each runs the same program).
        self._collective_key_base = _COLLECTIVE_KEY_STRIDE * next(_STRATEGIES_MADE)
        if cluster_resolver is not None:
            if num_replicas is not None:
                raise ValueError(
                    f"PipelineStrategy num_replicas={num_replicas!r} with a "
                    f"cluster_resolver: the replicas are the cluster's worker processes "
                    f"(one pipeline each). Drop num_replicas.")
            extended = _internal_distribute.PipelineMultiWorkerExtended(
                self, cluster_resolver, peer_timeout_s)
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
            extended = (_internal_distribute.PipelineExtended(self, grid[0]) if len(grid) == 1
                        else _internal_distribute.PipelineGridExtended(self, grid))
        self._grid = grid
        self._devices = grid[0]
        super().__init__(extended)

    @property
    def distribute_strategy(self):
        """The `tf.distribute.Strategy` models in this scope run under: this one
        (a `tfpipe.tpu.TPUPipelineHost` answers its TPUStrategy)."""
        return self

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

    def _stage_slots(self, replica):
        return tuple(devices_lib.as_stage_device(name) for name in self._grid[replica])

    def _too_many_stages(self, num_stages, most, count):
        return (f"{num_stages} stages but the strategy has only {most} stage slots on "
                f"{len(self._devices)} devices ({list(self._devices)}); use at most {most} "
                f"stages, or more devices (e.g. tfpipe.testing.use_logical_cpus({count}) on "
                f"CPU).")

    @property
    def num_microbatches(self):
        return self._config.num_microbatches

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
        return (f"PipelineStrategy(devices={devices}, num_microbatches={c.num_microbatches}, "
                f"schedule={c.schedule!r}, recompute={c.recompute!r}, execution={c.execution!r}, "
                f"batch_norm={c.batch_norm!r}, call_losses={c.call_losses!r})")


def device_grid(devices, num_replicas=None):
    """The R x D grid (a tuple of R tuples) of canonical device names that
    `devices` describe: one name, a flat list (cut into `num_replicas` rows;
    None: one), or a list of R equally long rows. Raises ValueError."""
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
                f"PipelineStrategy devices={devices!r}: every row (replica) needs the same number "
                f"of devices, at least one; got rows of {[len(row) for row in rows]}.")
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


def current_pipeline_host():
    """What a `PipelinedModel` made now runs on: the `PipelineStrategy` in
    scope, the `tfpipe.tpu.TPUPipelineHost` of a `TPUStrategy` in scope, or
    None (no strategy, or another kind)."""
    strategy = tf.distribute.get_strategy()
    if isinstance(strategy, PipelineStrategy):
        return strategy
    if tpu.is_tpu_strategy(strategy):
        return tpu.host_of(strategy)
    return None
