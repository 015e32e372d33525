"""Private TensorFlow APIs behind `tfpipe.PipelineStrategy`: its `StrategyExtended`s.

The other half of `tfpipe._internal`'s boundary, split off by subject: how
variables, slots and updates are placed and reduced for one pipeline, a grid
of pipeline replicas on one host, and replicas on several hosts
(`tfpipe_tests/test_testing_and_internal.py` and `test_data_parallel.py` pin
them).
"""
# pylint: disable=protected-access

import tensorflow as tf
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import multi_worker_util
from tensorflow.python.eager import context
from tensorflow.python.framework import ops


class PipelineExtended(distribute_lib._DefaultDistributionExtended):
    """Single-replica `StrategyExtended` that never overrides device scopes:
    unlike `OneDeviceStrategy` it creates each variable where the enclosing
    `tf.device` says, and optimizer slots with their variable (the host
    places the updates: `tfpipe.host.PipelineHost.place_optimizer`)."""

    def __init__(self, container_strategy, devices):
        super().__init__(container_strategy)
        self._pipeline_devices = tuple(devices)

    def _scope(self, strategy):
        # The default strategy's scope does not make itself current; the base
        # class's does (and routes variable creation through _create_variable).
        return distribute_lib.StrategyExtendedV1._scope(self, strategy)

    def _create_variable(self, next_creator, **kwargs):
        colocate_with = kwargs.pop("colocate_with", None)
        if colocate_with is not None:
            with ops.device(colocate_with.device):
                return next_creator(**kwargs)
        return next_creator(**kwargs)

    def colocate_vars_with(self, colocate_with_variable):
        # ops.colocate_with is lost when Keras lifts slot creation out of a
        # tf.function with init_scope; an explicit device survives.
        return ops.device(colocate_with_variable.device)

    def _call_for_each_replica(self, fn, args, kwargs):
        with _OneReplicaContext(self._container_strategy(), replica_id_in_sync_group=0):
            return fn(*args, **kwargs)

    def variable_created_in_scope(self, v):
        return getattr(v, "_distribute_strategy", None) is self._container_strategy()

    @property
    def worker_devices(self):
        return self._pipeline_devices

    @property
    def parameter_devices(self):
        return self._pipeline_devices

    def non_slot_devices(self, var_list):
        return self._pipeline_devices[0]


class _OneReplicaContext(distribute_lib.ReplicaContext):
    """One replica: an all-reduce (Keras' sum of the gradients) is the value
    itself. The base class's has a deviceless IdentityN, which the placer puts
    on the client: every remote stage's gradient would travel there and back."""

    def all_reduce(self, reduce_op, value, options=None):
        return value


class _Column:
    """The devices one stage's mirrored variable lives on, in the form
    `MirroredExtended._create_variable` reads from a `colocate_with`."""

    def __init__(self, devices):
        self._devices = tuple(devices)


class PipelineGridExtended(mirrored_strategy.MirroredExtended):
    """`StrategyExtended` of R data-parallel pipelines on a device grid
    (`grid[r][k]`: slot k of replica r; inputs arrive on `grid[r][0]`).

    TF's mirrored machinery, with one change: a variable created under
    `tf.device(grid[r][k])`, and its optimizer slots, are mirrored over
    column k (elsewhere: column 0); gradients are all-reduced over the column.
    """

    def __init__(self, container_strategy, grid):
        self._grid = tuple(tuple(row) for row in grid)
        self._column_of = {device_util.canonicalize(d): k
                           for row in self._grid for k, d in enumerate(row)}
        super().__init__(container_strategy, devices=[row[0] for row in self._grid])

    def _create_variable(self, next_creator, **kwargs):
        if kwargs.get("colocate_with") is None:
            current = device_util.current()
            k = self._column_of.get(device_util.canonicalize(current)) if current else None
            kwargs["colocate_with"] = _Column(row[k or 0] for row in self._grid)
        return super()._create_variable(next_creator, **kwargs)


class PipelineMultiWorkerExtended(collective_all_reduce_strategy.CollectiveAllReduceExtended):
    """`StrategyExtended` of one pipeline per worker process (multi-client):
    every process of a `TF_CONFIG` cluster runs the same program as one
    replica on its own local devices. A variable created under a local
    `tf.device` lives there (one copy per worker); gradients and metrics are
    summed by TF's collective ops, initial values broadcast from the chief.
    """

    def __init__(self, container_strategy, cluster_resolver, peer_timeout_s=None):
        # With `peer_timeout_s`: the start-up rendezvous (the coordination
        # service's registration), its heartbeats and every collective give up
        # after that long instead of waiting for a gone peer forever.
        if peer_timeout_s and context.context().coordination_service is None:
            spec = cluster_resolver.cluster_spec()
            context.context().configure_coordination_service(
                service_type="standalone",
                service_leader=multi_worker_util.coordination_leader(spec),
                cluster_register_timeout_in_ms=int(peer_timeout_s * 1000),
                heartbeat_timeout_in_ms=int(max(peer_timeout_s / 2, 1) * 1000),
                shutdown_barrier_timeout_in_ms=int(peer_timeout_s * 1000),
                coordinated_jobs=[coordination_config_pb2.CoordinatedJob(
                    name=job, num_tasks=spec.num_tasks(job))
                    for job in ("chief", "worker") if job in spec.jobs])
        super().__init__(container_strategy, cluster_resolver=cluster_resolver,
                         communication_options=collective_util.Options(
                             timeout_seconds=peer_timeout_s or None))

    @property
    def worker_task(self):
        """This process's task, `/job:<type>/task:<index>`."""
        return self._worker_device

    @property
    def num_workers(self):
        return self._num_workers

    def _create_variable(self, next_creator, **kwargs):
        if kwargs.get("colocate_with") is None:
            current = device_util.current()
            spec = tf.DeviceSpec.from_string(current) if current else None
            if spec is not None and spec.device_type:
                kwargs["colocate_with"] = _Column([
                    f"{self._worker_device}/device:{spec.device_type}:{spec.device_index or 0}"])
        return super()._create_variable(next_creator, **kwargs)

    def _reduce_to(self, reduce_op, value, destinations, options):
        # Keras' symbolic build reduces a whole (nested) data batch; the
        # collective implementation takes one value at a time.
        reduce_one = super()._reduce_to
        return tf.nest.map_structure(
            lambda v: reduce_one(reduce_op, v, destinations, options), value)
