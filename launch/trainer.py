"""The training run behind `launch.train`: models, data, checkpoints, resume.

`launch.train.train(config)` checks the settings (`launch.config`), takes the
lock on --model_dir (`launch.run_lock`) and only then imports this module,
which imports TensorFlow. Everything here runs under that lock.

Data flow of one run:

    data_lib.load -> BatchOrder (the rows of every global step) -> model.fit
      callbacks: StepTimer -> StepRecorder (history, NaN guard, TensorBoard)
                 -> Checkpointer (verified checkpoints with the history inside)
                 -> StopOnRequest (a signal: fit ends after the step, one save)
    --resume: CheckpointStore.find -> restore (variables, step, history from its
              segments) -> TensorBoard trimmed at that step -> fit from that step
"""

import contextlib
import dataclasses
import importlib.util
import pathlib
import sys
import time
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

import tfpipe
from launch import checkpoints
from launch import files
from launch import outputs
from launch import segments
from launch import history as history_lib
from launch import local_cluster
from launch import config as config_lib
from launch import data as data_lib
from launch import restart
from launch import signals
from launch import supervisor
from launch.config import Diverged, RunError, Stopped, WorkerLost
from models import mlp
from models import resnet_cnn
from models import transformer_lm
from models import unet


# -- models: name -> how to build it as a pipeline, and the data it takes -------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A trainable model: what data it takes and how to build its pipeline.

    Attributes:
      data_kind: "image", "segmentation" or "text" (see `launch.data.Data`).
      default_dataset: the data set used for dataset="auto".
      build: fn(config, data) -> an uncompiled `tfpipe.PipelinedModel`, called
        under the `PipelineStrategy` scope.
      view: fn(x) -> x as the model takes it (e.g. flattened 8x8 images).
    """

    data_kind: str
    default_dataset: str
    build: Callable
    view: Callable = None

    def __post_init__(self):
        if self.view is None:
            object.__setattr__(self, "view", lambda x: x)


def _depth(config):
    """Blocks (or hidden layers) to build: --depth, else 4, and at least one per stage."""
    return max(config.depth or 4, config.stages)


def _build_mlp(config, data):
    # digits_mlp adds hidden layers itself when there are fewer than stages - 1.
    plain = mlp.digits_mlp(config.stages, depth=config.depth or 4,
                           num_classes=data.num_classes)
    return tfpipe.PipelinedModel.from_model(
        plain, balance=mlp.stage_balance(plain, config.stages))


def _build_resnet(config, data):
    plain = resnet_cnn.resnet_cnn(data.image_shape, data.num_classes,
                                  num_blocks=_depth(config))
    return tfpipe.PipelinedModel.from_model(
        plain, balance=resnet_cnn.stage_balance(plain, config.stages))


def _build_transformer(config, data):
    # Cut from the one-device model (not hand-made stages), so that its
    # checkpoints load at any --stages (--reshard).
    plain = transformer_lm.transformer_lm(
        num_layers=_depth(config), vocab_size=data.num_classes, seq_len=data.seq_len)
    return tfpipe.PipelinedModel.from_model(
        plain, balance=transformer_lm.stage_balance(plain, config.stages),
        name="pipelined_transformer_lm")


def _build_unet(config, data):
    plain = unet.unet(input_shape=data.image_shape, num_classes=data.num_classes,
                      depth=2)
    return tfpipe.PipelinedModel.from_model(
        plain, balance=unet.stage_balance(plain, config.stages))


_BUILDERS = {
    "mlp": (_build_mlp, data_lib.as_flat_8x8),
    "resnet": (_build_resnet, None),
    "transformer": (_build_transformer, None),
    "unet": (_build_unet, None),
}
MODELS = {name: ModelSpec(*config_lib.MODEL_DATA[name], build, view)
          for name, (build, view) in _BUILDERS.items()}

# Built-in data sets (no download); "tfds:NAME" loads a prepared TFDS data set.
DATASETS = data_lib.BUILTIN


class StepTimer(keras.callbacks.Callback):
    """Times each training step, from on_train_batch_begin to on_train_batch_end."""

    def __init__(self):
        super().__init__()
        self.times = []  # seconds, every step of every epoch
        self._start = None

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)

    def mean_ms(self):
        """Mean step time in ms, leaving out the first step (tracing); None if no step ran."""
        times = self.times[1:] or self.times
        return 1000.0 * float(np.mean(times)) if times else None


def _stage_devices(config):
    """The pipelines' devices (--replicas=N rows of them, in order): logical
    GPUs if there are enough, else logical CPUs."""
    needed = config_lib.num_devices(config) * config_lib.replica_count(config.replicas)
    gpus = tfpipe.placement.available_devices("GPU")
    pool = gpus if len(gpus) >= needed else tfpipe.placement.available_devices("CPU")
    if needed > len(pool):
        raise RunError(
            f"--stages={config.stages} with --schedule={config.schedule}"
            f"{_replicas_phrase(config)} needs {needed} devices; there are {len(pool)}: "
            f"{pool}. Use --logical_cpus >= {needed} on a CPU machine.")
    return pool[:needed]


def _replicas_phrase(config):
    return "" if config.replicas in ("1", "tf_config") else f" and --replicas={config.replicas}"


def pipeline_strategy(config, devices=None):
    """The run's `tfpipe.PipelineStrategy`: its devices (default
    `_stage_devices(config)`), replicas and pipeline settings. `launch.plan`
    uses it too. With --replicas=tf_config it starts this worker's server:
    call it before any TensorFlow op."""
    settings = dict(num_microbatches=config.microbatches, schedule=config.schedule,
                    execution=None if config.execution == "auto" else config.execution,
                    recompute=None if config.recompute == "auto" else config.recompute)
    if config.replicas == "tf_config":
        return tfpipe.PipelineStrategy(
            cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver(),
            peer_timeout_s=config_lib.peer_timeout(config), **settings)
    return tfpipe.PipelineStrategy(
        devices=_stage_devices(config) if devices is None else devices,
        num_replicas=config_lib.replica_count(config.replicas), **settings)


def _cluster_devices(config):
    """--cluster: starts (local:N) or finds (tf_config) the workers, connects
    this process to them as the single client, and returns (ClusterSpec,
    devices): device k is task k's GPU:0 if it has one, else its CPU:0.

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
    pids = getattr(target, "pids", None)  # a LocalCluster's workers
    return spec, devices, pids


def _print_stage_devices(config, strategy, spec, pids):
    """One line per worker device: its address (and pid) and its stages."""
    devices, stage_devices = strategy.pipeline_devices(config.stages)
    addresses = tfpipe.cluster.task_addresses(spec)
    print(f"--cluster={config.cluster}: this process is the client; stage devices:")
    for k, device in enumerate(devices):
        stages = [s for s, d in enumerate(stage_devices) if d == device]
        task = f"/job:{tfpipe.cluster.JOB}/task:{k}"
        where = addresses[task] + (f", pid {pids[k]}" if pids else "")
        print(f"  stage {', '.join(map(str, stages))} on {device} ({where})")
    sys.stdout.flush()


def _run_settings(config, model_name, dataset, steps_per_epoch):
    """The settings a resumed run must share: they fix the variables, the data
    order and the computation. The learning rate is not one: a resume may
    change it, and the history records when (`RunHistory.changes`)."""
    return {
        "model": model_name, "depth": config.depth, "dataset": dataset,
        "max_examples": config.max_examples, "stages": config.stages,
        "batch_size": config.batch_size, "steps_per_epoch": steps_per_epoch,
        "seed": config.seed, "microbatches": config.microbatches,
        "schedule": config.schedule, "execution": config.execution,
        "recompute": config.recompute,
    }


def _check_data(config, spec, dataset, data, x_train):
    if data.kind != spec.data_kind:
        kinds = sorted(n for n, s in MODELS.items() if s.data_kind == data.kind)
        raise RunError(
            f"--model={config.model} trains on {spec.data_kind} data, but --dataset="
            f"{dataset} is {data.kind} data (models for it: {', '.join(kinds)}).")
    for split, rows in (("training", len(x_train)), ("validation", len(data.x_val))):
        if rows < config.microbatches:
            raise RunError(
                f"--dataset={dataset} has {rows} {split} example(s)"
                f"{f' (--max_examples={config.max_examples})' if config.max_examples else ''}"
                f", fewer than --microbatches={config.microbatches}: every {split} batch "
                f"would leave micro-batches empty. Use more examples or fewer micro-batches.")


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


def train(config, callbacks=(), stop=None, before_save=None, record=None, resume_from=None):
    """Trains `config.model` on `config.dataset` as a tfpipe pipeline.

    Call it through `launch.train.train`, which checks `config`, holds the
    lock on `config.model_dir` and prepares it, and passes the
    `launch.signals.StopRequest` (`stop`), the lock's check (`before_save`,
    run before each checkpoint) and the `launch.outputs.Record` of what the
    run writes (`record`) while this runs; a cluster's worker that is not the
    chief gets its own scratch --model_dir and the chief's checkpoints folder
    to resume from (`resume_from`, read only). See that function.
    """
    record = record if record is not None else outputs.Record(config.model_dir)
    stop = stop if stop is not None else signals.StopRequest()
    # Start-up (devices, data, model, restore) has nothing to save: a signal
    # abandons it at once (`signals.Interrupted`, to the caller).
    start_up = contextlib.ExitStack()
    start_up.enter_context(stop.interrupting())
    spec = MODELS[config.model]
    dataset = spec.default_dataset if config.dataset == "auto" else config.dataset
    if importlib.util.find_spec("tensorboard") is None:
        # tf.summary needs it, and would fail only mid-epoch.
        raise ImportError(
            "launch.train logs to TensorBoard, which is not installed: "
            "pip install -e '.[train]' (or tensorboard)"
        )
    needed = config_lib.num_devices(config) * config_lib.replica_count(config.replicas)
    if (not config.cluster and not tf.config.list_physical_devices("GPU")
            and needed > config.logical_cpus):
        raise RunError(
            f"--stages={config.stages} with --schedule={config.schedule}"
            f"{_replicas_phrase(config)} needs {needed} devices, but --logical_cpus={config.logical_cpus} (and there is no "
            f"GPU). Use --logical_cpus={needed}.")
    # A no-op when the process already has this many logical CPUs (e.g. a test's
    # conftest called it); must precede every TensorFlow op.
    tfpipe.testing.use_logical_cpus(config.logical_cpus)
    cluster_spec = pids = strategy = watchdog = None
    latest = []  # the newest committed checkpoint, for the watchdog's last line
    if config.cluster:  # after the logical CPUs (fixed once connected), before any op
        cluster_spec, devices, pids = _cluster_devices(config)
        if config.step_timeout:
            watchdog = _watchdog(config.step_timeout, cluster_spec, stop, latest)
    elif config.replicas == "tf_config":
        # A gone peer must end this worker, not block it: every step and
        # collective is bounded here; the start-up rendezvous (which holds
        # the GIL) and a stop by the supervisor (`launch.supervisor`).
        watchdog = _watchdog(
            config_lib.peer_timeout(config),
            tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec(), stop, latest)
        # Starts this worker's server: after the logical CPUs, before any op.
        supervisor.report(supervisor.RENDEZVOUS_BEGINS)
        strategy = pipeline_strategy(config)
        supervisor.report(supervisor.RENDEZVOUS_ENDS)
        devices = strategy.devices
        task = strategy.extended.worker_task
        print(f"--replicas=tf_config: {task} is replica {int(task.rsplit(':', 1)[1])} of "
              f"{strategy.num_replicas_in_sync}; its pipeline runs on {list(devices)}.",
              flush=True)
    else:
        devices = _stage_devices(config)
    keras.utils.set_random_seed(config.seed)

    try:
        data = data_lib.load(dataset, seed=config.seed, data_dir=config.data_dir,
                             max_examples=config.max_examples)
    except ValueError as err:  # an unknown or unprepared TFDS data set, too little text
        raise RunError(str(err)) from None
    x_train, y_train = spec.view(data.x_train), data.y_train
    x_val, y_val = spec.view(data.x_val), data.y_val
    _check_data(config, spec, dataset, data, x_train)

    order = data_lib.BatchOrder(len(x_train), config.batch_size, config.seed)
    steps_per_epoch = config.steps_per_epoch or order.batches_per_pass
    total_steps = config.epochs * steps_per_epoch
    run = _run_settings(config, config.model, dataset, steps_per_epoch)

    model_dir = pathlib.Path(config.model_dir)
    checkpoint_dir = model_dir / checkpoints.CHECKPOINT_DIR
    history_path = model_dir / history_lib.HISTORY_FILE
    files.remove_temporary_files(model_dir, record)
    files.remove_temporary_files(checkpoint_dir, record)
    # The checkpoint object is set once the model exists; finding and checking
    # what to resume from needs only the files, so a refusal comes first.
    store = checkpoints.CheckpointStore(checkpoint_dir, checkpoint=None, record=record)
    source = store if resume_from is None else checkpoints.CheckpointStore(resume_from, None)
    resume_step = manifest = None
    if config.resume:
        resume_step, manifest = restart.resume_point(source, run, model_dir, config.reshard)

    strategy = strategy or pipeline_strategy(config, devices)
    stop.install()  # a multi-worker strategy's coordination service took SIGTERM
    if cluster_spec is not None:
        _print_stage_devices(config, strategy, cluster_spec, pids)
    with strategy.scope():
        model = spec.build(config, data)
        # Compiling a built PipelinedModel builds the optimizer there and then:
        # every slot on its variable's stage device, before the restore below.
        model.compile(
            optimizer=keras.optimizers.Adam(config.learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    with tf.device("/CPU:0"):
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
    store.checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, step=step)
    if cluster_spec is not None:  # every checkpoint file written by this process, here
        store.options = tf.train.CheckpointOptions(
            experimental_io_device="/job:localhost/replica:0/task:0/device:CPU:0")
    source.checkpoint, source.options = store.checkpoint, store.options
    # Where the run's checkpoints are, as messages name them: the chief's for a
    # worker that writes in a scratch folder.
    shown = source if resume_from is not None else store
    history = history_lib.RunHistory(history_path, run,
                                     changes=[{"step": 0, "learning_rate": config.learning_rate}])
    if resume_step is not None:
        # Into the variables that exist already: values move, devices stay.
        history = history_lib.RunHistory.from_json(
            history_path, source.restore(resume_step, manifest, strict=config.reshard),
            saved_ref=manifest["history_ref"])
        # Segments past the checkpoint belong to checkpoints the resume skipped.
        segments.prune_after(store.dir / outputs.HISTORY_SEGMENTS, resume_step, record)
        if config.reshard:
            changed = [k for k in restart.LAYOUT_SETTINGS if history.run.get(k) != run[k]]
            previous = {k: history.run.get(k) for k in changed}
            history.run = run  # a later --resume continues at the new layout
            if changed:
                history.changes.append({"step": int(step), "reshard": {
                    k: [previous[k], run[k]] for k in changed}})
            print(f"--reshard: checkpoint written at {previous}, continuing at "
                  f"{ {k: run[k] for k in changed} }.")
        rate = history.learning_rate()
        if rate != config.learning_rate:
            history.changes.append({"step": int(step), "learning_rate": config.learning_rate})
            print(f"--learning_rate: {rate:g} until step {int(step)}, {config.learning_rate:g} "
                  f"from here (recorded in the history).")
        # The checkpoint restored the optimizer's rate too: the one asked for now.
        model.optimizer.learning_rate = config.learning_rate
        print(f"Resuming from {source.path(resume_step)} (step {int(step)}).")
        latest.append(source.path(resume_step))
    start_step = int(step)
    if start_step >= total_steps and config.resume and start_step:
        print(f"The run had finished: step {start_step} of {total_steps} "
              f"(--epochs={config.epochs} x {steps_per_epoch} steps); nothing to train.")

    verbose = config.verbose
    if verbose is None:
        verbose = 1 if sys.stdout.isatty() else 2
    if verbose:  # what this configuration costs, before the first step (tfpipe.plan)
        print(tfpipe.plan(model, config.batch_size, config.microbatches, repeats=1), flush=True)
    timer = StepTimer()
    board = history_lib.TensorBoardLog(model_dir / history_lib.TENSORBOARD_DIR, record)
    board.resume(start_step)  # drops only the logs of steps after the checkpoint
    variables = list(model.weights) + list(model.optimizer.variables)
    checkpointer = checkpoints.Checkpointer(store, step, config.checkpoint_every,
                                            steps_per_epoch, history, variables,
                                            every_secs=config.checkpoint_every_secs,
                                            after_save=[board.rotate, lambda s: latest.append(
                                                shown.path(s))],
                                            before_save=[before_save] if before_save else [])
    timeline = None
    pipeline_board = model_dir / history_lib.TENSORBOARD_DIR / "pipeline"
    if config.timeline:
        # One measured step (forward + backward, no update) when fit ends: a
        # Chrome trace and a Gantt chart, also shown in TensorBoard's Images.
        timeline = tfpipe.timeline.PipelineTimeline(
            x_train[: config.batch_size], y_train[: config.batch_size],
            log_dir=str(model_dir / outputs.TIMELINE_DIR), tensorboard_dir=str(pipeline_board))
        for suffix in (".json", ".png"):  # the names it will write, at the last epoch
            record.add(model_dir / outputs.TIMELINE_DIR / f"timeline_epoch{config.epochs}{suffix}")
        board_files = {entry.name for entry in outputs.entries(pipeline_board)}
    own_callbacks = [
        # First, so that its clock starts before the others' work at each hook.
        *([watchdog] if watchdog is not None else []),
        timer,
        # First: it stops at a non-finite loss before anything records the step,
        # and puts the epoch's running means into the logs the others see.
        history_lib.StepRecorder(history, order.num_rows_of, start_step, board),
        checkpointer,  # after the StepRecorder: it saves the history that one appends to
        checkpoints.StopOnRequest(  # after the Checkpointer
            stop, step, steps_per_epoch,
            agree=(checkpoints.agreed_signal(strategy) if config.replicas == "tf_config"
                   else None)),
    ]
    validation = (x_val, y_val)

    def fit(first_step, last_step, epochs, initial_epoch):
        model.fit(
            order.dataset(x_train, y_train, first_step, last_step),
            epochs=epochs, initial_epoch=initial_epoch,
            steps_per_epoch=(last_step - first_step) // (epochs - initial_epoch),
            validation_data=validation, validation_batch_size=config.batch_size,
            callbacks=[*own_callbacks, *callbacks],
            verbose=verbose,
            shuffle=False,  # the order is BatchOrder's, a function of the step
        )

    start_up.close()  # from here a signal is answered after the step, with a save
    try:
        epoch, into_epoch = divmod(start_step, steps_per_epoch)
        if start_step < total_steps and into_epoch:
            # Resumed mid-epoch: first the rest of that epoch, as its own Keras epoch.
            fit(start_step, (epoch + 1) * steps_per_epoch, epoch + 1, epoch)
            epoch += 1
        if epoch < config.epochs:
            fit(epoch * steps_per_epoch, total_steps, config.epochs, epoch)
        checkpointer.save()  # the final state, whatever --checkpoint_every is
        final = shown.path(int(step))
    except checkpoints.StopRequested:
        if int(step) == start_step and store.latest_step is None:
            raise Stopped(f"{stop.name} before the first step: nothing to save.",
                          signals.exit_code(stop.signum)) from None
        checkpointer.save()
        history.save(record)
        raise Stopped(f"{stop.name} after step {int(step)}: saved {shown.path(int(step))}; "
                      f"--resume continues the run from there.",
                      signals.exit_code(stop.signum)) from None
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
            tf.errors.AbortedError) as err:
        # A worker gone: a connection reset at once, or a collective's timeout.
        peers = cluster_spec if cluster_spec is not None else (
            "tf_config" if config.replicas == "tf_config" else None)
        if peers is None:
            raise
        kept = (f"The newest committed checkpoint is {latest[-1]}; --resume continues from "
                f"it." if latest else "No checkpoint had been committed.")
        raise WorkerLost(f"{tfpipe.cluster.describe_unavailable(err, peers)} {kept}") from None
    except Diverged as err:
        with contextlib.suppress(OSError):
            history.save(record)  # the copy for people, up to the last finite step
        advice = restart.divergence_advice(store, checkpointer, history, err.step)
        raise Diverged(f"training diverged: {err}. Stopped there; nothing non-finite was "
                       f"saved. {advice}", err.step) from None
    finally:
        board.close()

    history.save(record)  # the copy for people: cheap, before what may be abandoned
    plot_path = model_dir / history_lib.LOSS_PLOT
    try:
        # The run is complete and saved: a signal abandons the timeline and the plot.
        with stop.interrupting():
            if timeline is not None:
                timeline.set_model(model)
                timeline.record(config.epochs)
                record.add_new_files(pipeline_board, board_files)  # TensorFlow named it
            try:
                history.plot_loss(plot_path, record)
            except (OSError, ValueError, RuntimeError) as err:  # the run itself is complete
                restart.warn(f"could not write {plot_path} ({type(err).__name__}: {err}); the run, "
                      f"its checkpoint {store.latest_path} and {history_path} are complete.")
                plot_path = None
    except signals.Interrupted as err:
        raise Stopped(f"{err} after the run's last step ({int(step)}): saved {final}; the run "
                      f"is complete, its timeline and loss plot were left out.",
                      signals.exit_code(err.signum)) from None
    per_epoch = history.per_epoch()

    def last(key):
        return float(per_epoch[key][-1]) if per_epoch.get(key) else float("nan")

    return {
        "history": per_epoch,
        "train_loss": last("loss"),
        "train_accuracy": last("accuracy"),
        "val_loss": last("val_loss"),
        "val_accuracy": last("val_accuracy"),
        "step_time_ms": timer.mean_ms(),
        "steps": int(step),
        "start_step": start_step,
        "checkpoint": None if store.latest_step is None else shown.path(store.latest_step),
        "loss_plot": None if plot_path is None else str(plot_path),
        "data_kind": data.kind,
        "pipeline_summary": model.pipeline_summary(),
        "timeline": (timeline.paths[-1] if timeline and timeline.paths else None),
        # Its figures in one line (measured bubble, predicted from measured
        # stage costs, the schedule's ideal, overlap): `Timeline.summary()`.
        "timeline_summary": (timeline.timelines[-1].summary()
                             if timeline and timeline.timelines else None),
        "model": model,
    }
