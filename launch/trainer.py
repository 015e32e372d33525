"""The training run behind `launch.train`: models, data, checkpoints, resume.

`launch.train.train(config)` checks the settings (`launch.config`), takes the
lock on --model_dir (`launch.run_lock`) and only then imports this module,
which imports TensorFlow. Everything here runs under that lock.

`train` is its phases, in order, each a function here:

    devices   launch.run_devices.connect: the strategy (this process's devices,
              a cluster's, or a TPU's cores), the watchdog
    data      launch.data.load -> the arrays and BatchOrder (the rows of every
              global step)
    resume    CheckpointStore.find: what --resume restores (a refusal comes
              before the model is built)
    build     the model under the strategy, compiled (slots on stage devices)
    restore   variables, step, history from the checkpoint (and its segments);
              TensorBoard trimmed at that step
    callbacks StepTimer -> StepRecorder (history, NaN guard, TensorBoard)
              -> Checkpointer (verified checkpoints with the history inside)
              -> StopOnRequest (a signal: fit ends after the step, one save)
    fit       model.fit from the start step, answering stops, lost workers
              and divergence with a save or a clear error
    finish    the history copy, the timeline and the loss plot; the result
"""

import contextlib
import dataclasses
import importlib.util
import pathlib
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tfpipe
from launch import checkpoints
from launch import files
from launch import outputs
from launch import segments
from launch import history as history_lib
from launch import config as config_lib
from launch import data as data_lib
from launch import model_specs
from launch import restart
from launch import run_devices
from launch import signals
from launch import timeline_chart
from launch.errors import Diverged, RunError, Stopped, WorkerLost


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


def _run_settings(config, dataset, steps_per_epoch, whole_batches):
    """The settings a resumed run must share: they fix the variables, the data
    order and the computation. The learning rate is not one: a resume may
    change it, and the history records when (`RunHistory.changes`)."""
    run = {
        "model": config.model, "depth": config.depth, "dataset": dataset,
        "max_examples": config.max_examples, "stages": config.stages,
        "batch_size": config.batch_size, "steps_per_epoch": steps_per_epoch,
        "seed": config.seed, "microbatches": config.microbatches,
        "schedule": config.schedule, "execution": config.execution,
        "recompute": config.recompute,
    }
    if whole_batches:  # absent before TPU runs existed: a resume of those still matches
        run["whole_batches"] = True
    return run


@dataclasses.dataclass
class RunData:
    """The data phase's result: the arrays as the model takes them, the order
    of the batches, the length of the run and the settings it is resumed by."""

    data: data_lib.Data
    x_train: np.ndarray
    y_train: np.ndarray
    validation: tuple
    order: data_lib.BatchOrder
    steps_per_epoch: int
    total_steps: int
    run: dict


def _load_data(config, spec, whole_batches):
    """The data phase. `whole_batches`: every batch, training and validation,
    has --batch_size rows (a TPU's static program); the rest are left out."""
    dataset = spec.default_dataset if config.dataset == "auto" else config.dataset
    try:
        data = data_lib.load(dataset, seed=config.seed, data_dir=config.data_dir,
                             max_examples=config.max_examples)
    except ValueError as err:  # an unknown or unprepared TFDS data set, too little text
        raise RunError(str(err)) from None
    x_train, y_train = spec.view(data.x_train), data.y_train
    x_val, y_val = spec.view(data.x_val), data.y_val
    if data.kind != spec.data_kind:
        kinds = sorted(n for n, s in model_specs.MODELS.items() if s.data_kind == data.kind)
        raise RunError(
            f"--model={config.model} trains on {spec.data_kind} data, but --dataset="
            f"{dataset} is {data.kind} data (models for it: {', '.join(kinds)}).")
    least = config.batch_size if whole_batches else config.microbatches
    for split, rows in (("training", len(x_train)), ("validation", len(x_val))):
        if rows < least:
            need = (f"--batch_size={config.batch_size}: every batch of a TPU's program has "
                    f"that many rows" if whole_batches else
                    f"--microbatches={config.microbatches}: every {split} batch would leave "
                    f"micro-batches empty")
            raise RunError(
                f"--dataset={dataset} has {rows} {split} example(s)"
                f"{f' (--max_examples={config.max_examples})' if config.max_examples else ''}"
                f", fewer than {need}. Use more examples or "
                f"{'a smaller batch' if whole_batches else 'fewer micro-batches'}.")
    if whole_batches:
        kept = len(x_val) - len(x_val) % config.batch_size
        x_val, y_val = x_val[:kept], y_val[:kept]
    order = data_lib.BatchOrder(len(x_train), config.batch_size, config.seed, whole_batches)
    steps_per_epoch = config.steps_per_epoch or order.batches_per_pass
    return RunData(data, x_train, y_train, (x_val, y_val), order, steps_per_epoch,
                   config.epochs * steps_per_epoch,
                   _run_settings(config, dataset, steps_per_epoch, whole_batches))


def _build(config, spec, data, devices):
    """The build phase: the model under the run's strategy, compiled."""
    with devices.strategy.scope():
        model = spec.build(config, data, **devices.settings)
        # Compiling a built PipelinedModel builds the optimizer there and then:
        # every slot on its variable's stage device, before any restore.
        model.compile(
            optimizer=keras.optimizers.Adam(config.learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


@dataclasses.dataclass
class Checkpoints:
    """The resume phase's result: where checkpoints go (`store`), where a
    resume reads them (`source`: the chief's folder for a worker that writes
    in a scratch one; else `store`; messages name its paths) and what it
    restores (`step`, `manifest`, or None)."""

    store: checkpoints.CheckpointStore
    source: checkpoints.CheckpointStore
    step: int = None
    manifest: dict = None


def _resume_point(config, run, record, resume_from):
    """The resume phase: finds what --resume restores from the files alone, so
    that a refusal comes before the model is built."""
    model_dir = pathlib.Path(config.model_dir)
    checkpoint_dir = model_dir / checkpoints.CHECKPOINT_DIR
    files.remove_temporary_files(model_dir, record)
    files.remove_temporary_files(checkpoint_dir, record)
    store = checkpoints.CheckpointStore(checkpoint_dir, checkpoint=None, record=record)
    source = store if resume_from is None else checkpoints.CheckpointStore(resume_from, None)
    found = Checkpoints(store, source)
    if config.resume:
        found.step, found.manifest = restart.resume_point(source, run, model_dir,
                                                          config.reshard)
    return found


def _restore(config, model, saved, devices, run, record):
    """The restore phase: the checkpoint object, then (with --resume) the
    variables, step and history. Returns (step variable, `RunHistory`)."""
    with tf.device("/CPU:0"):
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
    store, source = saved.store, saved.source
    store.checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, step=step)
    if devices.io_device is not None:  # every checkpoint file written by this process
        store.options = tf.train.CheckpointOptions(experimental_io_device=devices.io_device)
    source.checkpoint, source.options = store.checkpoint, store.options
    history_path = pathlib.Path(config.model_dir) / history_lib.HISTORY_FILE
    history = history_lib.RunHistory(history_path, run,
                                     changes=[{"step": 0, "learning_rate": config.learning_rate}])
    if saved.step is None:
        return step, history
    # Into the variables that exist already: values move, devices stay.
    history = history_lib.RunHistory.from_json(
        history_path, source.restore(saved.step, saved.manifest, strict=config.reshard),
        saved_ref=saved.manifest["history_ref"])
    # Segments past the checkpoint belong to checkpoints the resume skipped.
    segments.prune_after(store.dir / outputs.HISTORY_SEGMENTS, saved.step, record)
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
    print(f"Resuming from {source.path(saved.step)} (step {int(step)}).")
    devices.latest.append(source.path(saved.step))
    return step, history


@dataclasses.dataclass
class Run:
    """What the phases after the restore share."""

    config: config_lib.TrainConfig
    stop: signals.StopRequest
    record: outputs.Record
    devices: run_devices.RunDevices
    data: RunData
    saved: Checkpoints
    model: tfpipe.PipelinedModel
    step: tf.Variable
    history: history_lib.RunHistory


@dataclasses.dataclass
class Callbacks:
    """The callbacks phase's result: launch.train's own callbacks, in order,
    and the ones the finish phase reads."""

    own: list
    timer: StepTimer
    checkpointer: checkpoints.Checkpointer
    board: history_lib.TensorBoardLog
    timeline: object = None  # a `tfpipe.timeline.PipelineTimeline`, or None
    board_files: set = None  # the pipeline board's files before the timeline's


def _callbacks(run, before_save, start_step):
    """The callbacks phase."""
    config, data, saved, devices, record = run.config, run.data, run.saved, run.devices, run.record
    model_dir = pathlib.Path(config.model_dir)
    timer = StepTimer()
    board = history_lib.TensorBoardLog(model_dir / history_lib.TENSORBOARD_DIR, record)
    board.resume(start_step)  # drops only the logs of steps after the checkpoint
    variables = list(run.model.weights) + list(run.model.optimizer.variables)
    checkpointer = checkpoints.Checkpointer(
        saved.store, run.step, config.checkpoint_every, data.steps_per_epoch, run.history,
        variables,
        every_secs=config.checkpoint_every_secs,
        after_save=[board.rotate, lambda s: devices.latest.append(saved.source.path(s))],
        before_save=[before_save] if before_save else [])
    made = Callbacks([], timer, checkpointer, board)
    refusal = run.model.pipeline_host.timing_refusal
    if config.timeline and refusal:
        print(f"--timeline: no timeline at the end: {refusal}", flush=True)
    if config.timeline and not refusal:
        # One measured step (forward + backward, no update) when fit ends: a
        # Chrome trace and a Gantt chart, also shown in TensorBoard's Images.
        pipeline_board = model_dir / history_lib.TENSORBOARD_DIR / "pipeline"
        made.timeline = tfpipe.timeline.PipelineTimeline(
            data.x_train[: config.batch_size], data.y_train[: config.batch_size],
            log_dir=str(model_dir / outputs.TIMELINE_DIR), tensorboard_dir=str(pipeline_board),
            chart=timeline_chart.png)
        for suffix in (".json", ".png"):  # the names it will write, at the last epoch
            record.add(model_dir / outputs.TIMELINE_DIR / f"timeline_epoch{config.epochs}{suffix}")
        made.board_files = {entry.name for entry in outputs.entries(pipeline_board)}
    made.own = [
        # First, so that its clock starts before the others' work at each hook.
        *([devices.watchdog] if devices.watchdog is not None else []),
        timer,
        # First: it stops at a non-finite loss before anything records the step,
        # and puts the epoch's running means into the logs the others see.
        history_lib.StepRecorder(run.history, data.order.num_rows_of, start_step, board),
        checkpointer,  # after the StepRecorder: it saves the history that one appends to
        checkpoints.StopOnRequest(  # after the Checkpointer
            run.stop, run.step, data.steps_per_epoch,
            agree=(checkpoints.agreed_signal(devices.strategy)
                   if config.replicas == "tf_config" else None)),
    ]
    return made


def _fit(config, model, data, own, callbacks, verbose, start_step):
    """Fits from `start_step` to the run's end: the rest of a resumed epoch
    first, as its own Keras epoch."""
    def fit(first_step, last_step, epochs, initial_epoch):
        model.fit(
            data.order.dataset(data.x_train, data.y_train, first_step, last_step),
            epochs=epochs, initial_epoch=initial_epoch,
            steps_per_epoch=(last_step - first_step) // (epochs - initial_epoch),
            validation_data=data.validation, validation_batch_size=config.batch_size,
            callbacks=[*own, *callbacks],
            verbose=verbose,
            shuffle=False,  # the order is BatchOrder's, a function of the step
        )

    epoch, into_epoch = divmod(start_step, data.steps_per_epoch)
    if start_step < data.total_steps and into_epoch:
        fit(start_step, (epoch + 1) * data.steps_per_epoch, epoch + 1, epoch)
        epoch += 1
    if epoch < config.epochs:
        fit(epoch * data.steps_per_epoch, data.total_steps, config.epochs, epoch)


def _fit_with_stops(run, made, callbacks, verbose, start_step):
    """The fit phase: trains, then saves the final state. A stop request, a
    lost worker or divergence ends it with a save (or none, if nothing is
    finite) and an error that says what to do. Returns the final checkpoint."""
    config, stop, step, history, devices = run.config, run.stop, run.step, run.history, run.devices
    store, shown, record = run.saved.store, run.saved.source, run.record
    try:
        _fit(config, run.model, run.data, made.own, callbacks, verbose, start_step)
        made.checkpointer.save()  # the final state, whatever --checkpoint_every is
        return shown.path(int(step))
    except checkpoints.StopRequested:
        if int(step) == start_step and store.latest_step is None:
            raise Stopped(f"{stop.name} before the first step: nothing to save.",
                          signals.exit_code(stop.signum)) from None
        made.checkpointer.save()
        history.save(record)
        raise Stopped(f"{stop.name} after step {int(step)}: saved {shown.path(int(step))}; "
                      f"--resume continues the run from there.",
                      signals.exit_code(stop.signum)) from None
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
            tf.errors.AbortedError) as err:
        # A worker gone: a connection reset at once, or a collective's timeout.
        if devices.peers is None:
            raise
        latest = devices.latest
        kept = (f"The newest committed checkpoint is {latest[-1]}; --resume continues from "
                f"it." if latest else "No checkpoint had been committed.")
        raise WorkerLost(f"{tfpipe.cluster.describe_unavailable(err, devices.peers)} "
                         f"{kept}") from None
    except Diverged as err:
        with contextlib.suppress(OSError):
            history.save(record)  # the copy for people, up to the last finite step
        advice = restart.divergence_advice(store, made.checkpointer, history, err.step)
        raise Diverged(f"training diverged: {err}. Stopped there; nothing non-finite was "
                       f"saved. {advice}", err.step) from None
    finally:
        made.board.close()


def _finish(run, made, final):
    """The finish phase: the history copy, then the timeline and the loss plot
    (a signal abandons those two: the run is complete and saved). Returns
    the loss plot's path, or None."""
    config, step, history, record = run.config, run.step, run.history, run.record
    history.save(record)  # the copy for people: cheap, before what may be abandoned
    model_dir = pathlib.Path(config.model_dir)
    plot_path = model_dir / history_lib.LOSS_PLOT
    try:
        with run.stop.interrupting():
            if made.timeline is not None:
                made.timeline.set_model(run.model)
                made.timeline.record(config.epochs)
                record.add_new_files(model_dir / history_lib.TENSORBOARD_DIR / "pipeline",
                                     made.board_files)  # TensorFlow named it
            try:
                history.plot_loss(plot_path, record)
            except (OSError, ValueError, RuntimeError) as err:  # the run itself is complete
                restart.warn(f"could not write {plot_path} ({type(err).__name__}: {err}); the "
                             f"run, its checkpoint {run.saved.store.latest_path} and "
                             f"{model_dir / history_lib.HISTORY_FILE} are complete.")
                plot_path = None
    except signals.Interrupted as err:
        raise Stopped(f"{err} after the run's last step ({int(step)}): saved {final}; the run "
                      f"is complete, its timeline and loss plot were left out.",
                      signals.exit_code(err.signum)) from None
    return plot_path


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
    if importlib.util.find_spec("tensorboard") is None:
        # tf.summary needs it, and would fail only mid-epoch.
        raise ImportError(
            "launch.train logs to TensorBoard, which is not installed: "
            "pip install -e '.[train]' (or tensorboard)"
        )
    spec = model_specs.MODELS[config.model]
    # Start-up (devices, data, model, restore) has nothing to save: a signal
    # abandons it at once (`signals.Interrupted`, to the caller).
    start_up = contextlib.ExitStack()
    start_up.enter_context(stop.interrupting())
    devices = run_devices.connect(config, stop)
    keras.utils.set_random_seed(config.seed)
    data = _load_data(config, spec, devices.static_batches)
    saved = _resume_point(config, data.run, record, resume_from)
    model = _build(config, spec, data.data, devices)
    step, history = _restore(config, model, saved, devices, data.run, record)
    start_step = int(step)
    if start_step >= data.total_steps and config.resume and start_step:
        print(f"The run had finished: step {start_step} of {data.total_steps} "
              f"(--epochs={config.epochs} x {data.steps_per_epoch} steps); nothing to train.")
    verbose = config.verbose
    if verbose is None:
        verbose = 1 if sys.stdout.isatty() else 2
    if verbose:  # what this configuration costs, before the first step (tfpipe.plan)
        refusal = model.pipeline_host.timing_refusal
        print(f"No plan before the first step: {refusal}" if refusal else
              tfpipe.plan(model, config.batch_size, config.microbatches, repeats=1), flush=True)
    run = Run(config, stop, record, devices, data, saved, model, step, history)
    made = _callbacks(run, before_save, start_step)
    start_up.close()  # from here a signal is answered after the step, with a save
    final = _fit_with_stops(run, made, callbacks, verbose, start_step)
    plot_path = _finish(run, made, final)
    return _result(run, made, start_step, plot_path)


def _result(run, made, start_step, plot_path):
    per_epoch = run.history.per_epoch()

    def last(key):
        return float(per_epoch[key][-1]) if per_epoch.get(key) else float("nan")

    timeline = made.timeline
    return {
        "history": per_epoch,
        "train_loss": last("loss"),
        "train_accuracy": last("accuracy"),
        "val_loss": last("val_loss"),
        "val_accuracy": last("val_accuracy"),
        "step_time_ms": made.timer.mean_ms(),
        "steps": int(run.step),
        "start_step": start_step,
        "checkpoint": (None if run.saved.store.latest_step is None
                       else run.saved.source.path(run.saved.store.latest_step)),
        "loss_plot": None if plot_path is None else str(plot_path),
        "data_kind": run.data.data.kind,
        "pipeline_summary": run.model.pipeline_summary(),
        "timeline": (timeline.paths[-1] if timeline and timeline.paths else None),
        # Its figures in one line (measured bubble, predicted from measured
        # stage costs, the schedule's ideal, overlap): `Timeline.summary()`.
        "timeline_summary": (timeline.timelines[-1].summary()
                             if timeline and timeline.timelines else None),
        "model": run.model,
    }
