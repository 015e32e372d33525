"""Where a `launch.train` run's pipelines run: `connect(config, stop)`.

One of three kinds, each a strategy the library takes:

- this process's devices (logical GPUs if there are enough, else logical
  CPUs), --replicas=N rows of them: a `tfpipe.PipelineStrategy`;
- --cluster: worker processes (started here with local:N, or named by
  TF_CONFIG), stage k on task k, this process the single client; or
  --replicas=tf_config: this process is one replica of the TF_CONFIG cluster;
- --tpu=NAME|local: a `tf.distribute.TPUStrategy` whose replicas each hold
  one pipeline, stage k on logical core k (`tfpipe.tpu`).

Whether there are enough devices is the library's check (`PipelineStrategy`,
`tfpipe.tpu.device_assignment`), said here in the flags' words.
"""

import dataclasses
import sys

import tensorflow as tf

import tfpipe
from launch import config as config_lib
from launch import local_cluster
from launch import signals
from launch import supervisor
from launch.errors import RunError

# Where checkpoints are written from when the variables live on other tasks
# or a TPU: this process (the client), which holds --model_dir.
CLIENT_CPU = "/job:localhost/replica:0/task:0/device:CPU:0"


@dataclasses.dataclass
class RunDevices:
    """What `connect` made.

    Attributes:
      strategy: the `tfpipe.PipelineStrategy` or `tf.distribute.TPUStrategy`
        the model is built under.
      settings: the pipeline settings the model takes (`from_model` kwargs).
      peers: what a lost worker is named against (`tfpipe.cluster`'s
        `describe_unavailable`): a ClusterSpec, "tf_config" or None.
      watchdog: a `tfpipe.StepWatchdog` callback, or None.
      io_device: the device checkpoints are written from, or None (local).
      latest: the committed checkpoints, newest last (the watchdog's last words).
    """

    strategy: object
    settings: dict
    peers: object = None
    watchdog: object = None
    io_device: str = None
    latest: list = dataclasses.field(default_factory=list)

    @property
    def static_batches(self):
        """Whether every batch must have one static size (a TPU's replica program)."""
        with self.strategy.scope():
            return tfpipe.strategy.current_pipeline_host().static_batch_reason is not None


def model_settings(config):
    """The pipeline settings of `config`, as `PipelinedModel.from_model` takes them."""
    return dict(num_microbatches=config.microbatches,
                schedule=config_lib.schedule_setting(config),
                execution=None if config.execution == "auto" else config.execution,
                recompute=None if config.recompute == "auto" else config.recompute)


def pipeline_strategy(config, devices=None):
    """The run's `tfpipe.PipelineStrategy` on this process's devices (or
    `devices`), with --replicas rows. `launch.plan` uses it too. With
    --replicas=tf_config it starts this worker's server: call it before any
    TensorFlow op."""
    settings = model_settings(config)
    try:
        if config.replicas == "tf_config":
            return tfpipe.PipelineStrategy(
                cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver(),
                peer_timeout_s=config_lib.peer_timeout(config), **settings)
        replicas = config_lib.replica_count(config.replicas)
        strategy = tfpipe.PipelineStrategy(
            devices=_local_devices(config) if devices is None else devices,
            num_replicas=replicas, **settings)
        for replica in range(replicas):
            strategy.pipeline_devices(config.stages, config_lib.schedule_setting(config), replica)
        return strategy
    except ValueError as err:  # too few devices: the library's check
        raise RunError(f"--stages={config.stages} with --schedule={config.schedule}"
                       f"{_replicas_phrase(config)}: {err}") from None


def _local_devices(config):
    """This process's devices for --replicas rows of pipelines: logical GPUs
    if there are enough, else logical CPUs (all of them if they are too few,
    for the library to refuse)."""
    needed = config_lib.num_devices(config) * config_lib.replica_count(config.replicas)
    gpus = tfpipe.placement.available_devices("GPU")
    pool = gpus if len(gpus) >= needed else tfpipe.placement.available_devices("CPU")
    return pool[:needed] if len(pool) >= needed else pool


def _replicas_phrase(config):
    return "" if config.replicas in ("1", "tf_config") else f" and --replicas={config.replicas}"


def connect_tpu(name, cores_per_replica, num_replicas):
    """A `TPUStrategy` on the TPU `name` ("local": this TPU VM's), its
    replicas of `cores_per_replica` cores each (`tfpipe.tpu.device_assignment`)."""
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=name)
    tf.config.experimental_connect_to_cluster(resolver)
    topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    assignment = tfpipe.tpu.device_assignment(topology, cores_per_replica, num_replicas)
    return tf.distribute.TPUStrategy(resolver, experimental_device_assignment=assignment)


def _tpu(config):
    try:
        strategy = connect_tpu(config.tpu, config_lib.num_devices(config),
                               config_lib.replica_count(config.replicas))
    except (ValueError, RuntimeError, tf.errors.OpError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RunError(
            f"--tpu={config.tpu} with --stages={config.stages}, --schedule={config.schedule}"
            f"{_replicas_phrase(config)}: {first}. Run on a Cloud TPU VM (--tpu=local) or "
            f"name a reachable TPU, with stages (or stages / V interleaved) x replicas "
            f"within its cores.") from None
    print(f"--tpu={config.tpu}: {strategy.num_replicas_in_sync} replica(s) of "
          f"{config_lib.num_devices(config)} core(s); stage k on logical core k.", flush=True)
    return RunDevices(strategy, model_settings(config), io_device=CLIENT_CPU)


def _cluster(config, stop):
    """--cluster: starts (local:N) or finds (tf_config) the workers, connects
    this process to them as the single client, and places stage k on task
    k's GPU:0 if it has one, else its CPU:0.

    Local workers live as long as this process (the trained model's variables
    are on them): `LocalCluster` kills them at exit, the `StepWatchdog`'s
    `on_end` before its `os._exit`, and each ends by itself if this process
    goes away."""
    if config.cluster.startswith("local:"):
        target = local_cluster.LocalCluster(int(config.cluster.split(":")[1]))
        target.start()
    else:
        target = "tf_config"
    spec = tfpipe.cluster.connect(target)
    gpus = tfpipe.placement.available_devices("GPU")
    devices = []
    for k in range(config_lib.num_devices(config)):
        gpu = f"/job:{tfpipe.cluster.JOB}/task:{k}/device:GPU:0"
        on_gpu = any(tfpipe.placement.same_device(gpu, g) for g in gpus)
        devices.append(tfpipe.placement.canonical_device(
            gpu if on_gpu else f"/job:{tfpipe.cluster.JOB}/task:{k}/device:CPU:0"))
    run = RunDevices(pipeline_strategy(config, devices), model_settings(config), peers=spec,
                     io_device=CLIENT_CPU)
    if config.step_timeout:
        run.watchdog = _watchdog(config.step_timeout, spec, stop, run.latest)
    _print_stage_devices(config, run.strategy, spec, getattr(target, "pids", None))
    return run


def _replica_of_tf_config(config, stop):
    """--replicas=tf_config: this process's pipeline, one replica of the cluster."""
    # A gone peer must end this worker, not block it: every step and
    # collective is bounded here; the start-up rendezvous (which holds
    # the GIL) and a stop by the supervisor (`launch.supervisor`).
    latest = []
    watchdog = _watchdog(
        config_lib.peer_timeout(config),
        tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec(), stop, latest)
    # Starts this worker's server: after the logical CPUs, before any op.
    supervisor.report(supervisor.RENDEZVOUS_BEGINS)
    strategy = pipeline_strategy(config)
    supervisor.report(supervisor.RENDEZVOUS_ENDS)
    task = strategy.extended.worker_task
    print(f"--replicas=tf_config: {task} is replica {int(task.rsplit(':', 1)[1])} of "
          f"{strategy.num_replicas_in_sync}; its pipeline runs on {list(strategy.devices)}.",
          flush=True)
    return RunDevices(strategy, model_settings(config), peers="tf_config", watchdog=watchdog,
                      latest=latest)


def connect(config, stop):
    """The run's `RunDevices`. Call it before any TensorFlow op (it makes the
    logical CPUs, and a cluster's connection or server)."""
    # A no-op when the process already has this many logical CPUs (e.g. a
    # test's conftest called it).
    tfpipe.testing.use_logical_cpus(config.logical_cpus)
    if config.tpu:
        run = _tpu(config)
    elif config.cluster:
        run = _cluster(config, stop)
    elif config.replicas == "tf_config":
        run = _replica_of_tf_config(config, stop)
    else:
        run = RunDevices(pipeline_strategy(config), model_settings(config))
    stop.install()  # a multi-worker strategy's coordination service took SIGTERM
    return run


def _print_stage_devices(config, strategy, spec, pids):
    """One line per worker device: its address (and pid) and its stages."""
    devices, stage_devices = strategy.pipeline_devices(config.stages,
                                                       config_lib.schedule_setting(config))
    addresses = tfpipe.cluster.task_addresses(spec)
    print(f"--cluster={config.cluster}: this process is the client; stage devices:")
    for k, device in enumerate(devices):
        stages = [s for s, d in enumerate(stage_devices) if d == device]
        task = f"/job:{tfpipe.cluster.JOB}/task:{k}"
        where = addresses[task] + (f", pid {pids[k]}" if pids else "")
        print(f"  stage {', '.join(map(str, stages))} on {device} ({where})")
    sys.stdout.flush()


def _watchdog(timeout_s, cluster, stop, latest):
    """A `tfpipe.StepWatchdog` over `cluster` whose last words release the
    run's lock and name the newest committed checkpoint (`latest[-1]`)."""
    def on_end(message):
        local_cluster.kill_local_workers()  # os._exit runs no atexit handler
        stop.run_hard_exit_hooks()
        kept = (f"The newest committed checkpoint is {latest[-1]}; --resume on every worker "
                f"continues from it." if latest else "No checkpoint had been committed.")
        signals.say(f"launch.train: lost a worker: {message} {kept}")
    return tfpipe.StepWatchdog(timeout_s=timeout_s, cluster=cluster, on_end=on_end)
