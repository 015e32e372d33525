"""Trains a model with tfpipe pipeline parallelism: `python -m launch.train`.

The defaults run offline in well under two minutes on a small CPU machine:
the digits MLP cut into 4 stages on 4 logical CPUs, 4 micro-batches, 3 epochs.

    python -m launch.train --stages=2 --microbatches=8 --epochs=5
    python -m launch.train --model=resnet                 # digits, 8x8 images
    python -m launch.train --model=transformer            # Python's help texts, bytes
    python -m launch.train --model=unet                   # digit ink masks, skip connections
    python -m launch.train --schedule=1f1b --execution=loop
    python -m launch.train --dataset=tfds:mnist --data_dir=/data/tfds   # prepared TFDS
    python -m launch.train --checkpoint_every=20 --resume # continue a stopped run

It writes, under --model_dir: TensorBoard logs (tensorboard/), checkpoints
every --checkpoint_every steps (checkpoints/), every step's loss
(history.json) and a plot of it (loss.png). `--resume` continues from the
latest checkpoint with the same batches the uninterrupted run would have seen.

Tests and other code call `train(TrainConfig(...))` directly, without flags.
"""

import dataclasses
import importlib.util
import os
import pathlib
import shutil
import sys
import time
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads: quieter logs

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpipe  # noqa: E402
from launch import checkpoints  # noqa: E402
from launch import data as data_lib  # noqa: E402
from models import mlp  # noqa: E402
from models import resnet_cnn  # noqa: E402
from models import transformer_lm  # noqa: E402
from models import unet  # noqa: E402


@dataclasses.dataclass
class TrainConfig:
    """Everything one training run needs; the flags of `main` map onto it."""

    model: str = "mlp"
    depth: int = 0  # hidden layers / residual blocks / Transformer blocks; 0: 4 (>= stages)
    dataset: str = "auto"  # auto: the model's default data set (MODELS[model].default_dataset)
    data_dir: str | None = None  # TFDS data directory, for dataset="tfds:NAME"
    max_examples: int = 0  # if > 0, use at most this many examples of each split
    stages: int = 4
    microbatches: int = 4
    schedule: str = "gpipe"
    recompute: str = "auto"  # auto: tfpipe's default for the execution
    execution: str = "unrolled"
    timeline: bool = True  # record one step's pipeline timeline at the end
    batch_size: int = 64
    epochs: int = 3
    steps_per_epoch: int = 0  # 0: one pass over the training data
    logical_cpus: int = 4
    model_dir: str = "/tmp/tfpipe_run"
    checkpoint_every: int = 100  # steps; 0: only at the end
    resume: bool = False
    learning_rate: float = 1e-3
    seed: int = 0
    verbose: int | None = None  # None: 1 (progress bar) on a tty, else 2 (a line per epoch)


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
    stages = transformer_lm.transformer_stages(
        config.stages, num_layers=_depth(config), vocab_size=data.num_classes,
        seq_len=data.seq_len)
    return tfpipe.PipelinedModel(stages, input_shape=(None, data.seq_len), input_dtype="int32",
                                 name="pipelined_transformer_lm")


def _build_unet(config, data):
    plain = unet.unet(input_shape=data.image_shape, num_classes=data.num_classes,
                      depth=2)
    return tfpipe.PipelinedModel.from_model(
        plain, balance=unet.stage_balance(plain, config.stages))


MODELS = {
    "mlp": ModelSpec("image", "digits", _build_mlp, data_lib.as_flat_8x8),
    "resnet": ModelSpec("image", "digits", _build_resnet),
    "transformer": ModelSpec("text", "pydoc_topics", _build_transformer),
    "unet": ModelSpec("segmentation", "digits_masks", _build_unet),
}

# Built-in data sets (no download); "tfds:NAME" loads a prepared TFDS data set.
DATASETS = data_lib.BUILTIN


def _choose(kind, name, choices):
    if name not in choices:
        raise ValueError(
            f"Unknown {kind} {name!r}; valid choices: {', '.join(sorted(choices))}."
        )
    return choices[name]


def _dataset_name(config, spec):
    name = spec.default_dataset if config.dataset == "auto" else config.dataset
    if not name.startswith(data_lib.TFDS_PREFIX) and name not in DATASETS:
        raise ValueError(
            f"Unknown dataset {name!r}; valid choices: auto, {', '.join(sorted(DATASETS))}, "
            f"or {data_lib.TFDS_PREFIX}NAME (a TensorFlow Datasets data set prepared "
            f"under --data_dir).")
    return name


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
        """Mean step time in ms, leaving out the first step (tracing)."""
        times = self.times[1:] or self.times
        return 1000.0 * float(np.mean(times)) if times else float("nan")


def _num_devices(config):
    """Devices the pipeline needs: one per stage, or stages / v when interleaved."""
    v = tfpipe.schedules.get(config.schedule).virtual_stages
    return -(-config.stages // v)


def _stage_devices(config):
    """The pipeline's devices: logical GPUs if there are enough, else logical CPUs."""
    needed = _num_devices(config)
    gpus = tfpipe.placement.available_devices("GPU")
    pool = gpus if len(gpus) >= needed else tfpipe.placement.available_devices("CPU")
    if needed > len(pool):
        raise ValueError(
            f"stages={config.stages} with schedule={config.schedule!r} needs {needed} "
            f"devices; there are {len(pool)}: {pool}. Use --logical_cpus >= {needed} on "
            f"a CPU machine.")
    return pool[:needed]


def _run_settings(config, model_name, dataset, steps_per_epoch):
    """The settings a resumed run must share: they fix variables and data order."""
    return {
        "model": model_name, "depth": config.depth, "dataset": dataset,
        "max_examples": config.max_examples, "stages": config.stages,
        "batch_size": config.batch_size, "steps_per_epoch": steps_per_epoch,
        "seed": config.seed, "learning_rate": config.learning_rate,
    }


def _clear_outputs(model_dir):
    """A fresh (not resumed) run starts without the outputs of an earlier one."""
    for name in (checkpoints.CHECKPOINT_DIR, "tensorboard", "timeline"):
        shutil.rmtree(model_dir / name, ignore_errors=True)
    for name in (checkpoints.HISTORY_FILE, checkpoints.LOSS_PLOT):
        (model_dir / name).unlink(missing_ok=True)


def train(config, callbacks=()):
    """Trains `config.model` on `config.dataset` as a tfpipe pipeline.

    Batches are drawn by `launch.data.BatchOrder`, a pure function of the
    global step; checkpoints hold the model, the optimizer and the step. With
    `config.resume` the run restores the latest checkpoint in
    `config.model_dir` (after compile, so the optimizer slots already exist on
    the stage devices) and continues with the batches the uninterrupted run
    would have drawn: 2N steps, or N steps + resume + N steps, give the same
    weights. Without it, earlier checkpoints, history and logs in model_dir
    are removed.

    Args:
      config: a `TrainConfig`.
      callbacks: more Keras callbacks for `fit`, after launch.train's own.

    Returns:
      A dict: "history" (per-epoch lists, as Keras' History.history, over the
      whole run including steps before a resume), "train_loss",
      "train_accuracy", "val_loss", "val_accuracy" (final epoch),
      "step_time_ms" (mean training step of this process, first step left
      out), "steps" (global steps done), "start_step" (where this process
      began), "checkpoint" (latest checkpoint path), "loss_plot" (PNG path),
      "pipeline_summary" (text) and "model" (the trained `PipelinedModel`).

    Raises:
      ValueError: unknown model or dataset, a model/data mismatch, an
        unprepared TFDS data set, more stages than devices, or a resume whose
        settings differ from the checkpointed run's.
      ImportError: the tensorboard package (for the TensorBoard callback) is missing.
    """
    spec = _choose("model", config.model, MODELS)
    dataset = _dataset_name(config, spec)
    if importlib.util.find_spec("tensorboard") is None:
        # Keras' TensorBoard callback needs it, and would fail only mid-epoch.
        raise ImportError(
            "launch.train logs to TensorBoard, which is not installed: "
            "pip install tensorboard"
        )
    if not tf.config.list_physical_devices("GPU") and _num_devices(config) > config.logical_cpus:
        raise ValueError(
            f"stages={config.stages} with schedule={config.schedule!r} needs "
            f"{_num_devices(config)} devices, but logical_cpus={config.logical_cpus}."
        )
    # A no-op when the process already has this many logical CPUs (e.g. main()
    # or a test's conftest called it); must precede every TensorFlow op.
    tfpipe.testing.use_logical_cpus(config.logical_cpus)
    devices = _stage_devices(config)
    keras.utils.set_random_seed(config.seed)

    data = data_lib.load(dataset, seed=config.seed, data_dir=config.data_dir,
                         max_examples=config.max_examples)
    if data.kind != spec.data_kind:
        kinds = sorted(n for n, s in MODELS.items() if s.data_kind == data.kind)
        raise ValueError(
            f"Model {config.model!r} trains on {spec.data_kind} data, but dataset "
            f"{dataset!r} is {data.kind} data (models for it: {', '.join(kinds)}).")
    x_train, y_train = spec.view(data.x_train), data.y_train
    x_val, y_val = spec.view(data.x_val), data.y_val

    order = data_lib.BatchOrder(len(x_train), config.batch_size, config.seed)
    steps_per_epoch = config.steps_per_epoch or order.batches_per_pass
    total_steps = config.epochs * steps_per_epoch
    run = _run_settings(config, config.model, dataset, steps_per_epoch)

    model_dir = pathlib.Path(config.model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_dir = model_dir / checkpoints.CHECKPOINT_DIR
    history_path = model_dir / checkpoints.HISTORY_FILE
    history = checkpoints.RunHistory(history_path, run)
    latest = tf.train.latest_checkpoint(str(checkpoint_dir)) if config.resume else None
    if latest and history_path.exists():
        history = checkpoints.RunHistory.load(history_path)
        diff = history.mismatches(run)
        if diff:
            raise ValueError(
                f"--resume: {model_dir} holds a run with other settings "
                f"({', '.join(f'{k}: {a!r} then, {b!r} now' for k, (a, b) in diff.items())}"
                f"). Use the same settings, or another --model_dir without --resume.")
    if not config.resume:
        _clear_outputs(model_dir)

    strategy = tfpipe.PipelineStrategy(
        devices=devices, num_microbatches=config.microbatches,
        schedule=config.schedule, execution=config.execution,
        recompute=None if config.recompute == "auto" else config.recompute,
    )
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
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, step=step)
    manager = tf.train.CheckpointManager(checkpoint, str(checkpoint_dir), max_to_keep=3)
    if latest:
        # Into the variables that exist already: values move, devices stay.
        checkpoint.restore(latest).assert_existing_objects_matched()
        history.truncate(int(step))
        print(f"Resuming from {latest} (step {int(step)}).")
    elif config.resume:
        print(f"--resume: no checkpoint in {checkpoint_dir}; starting from step 0.")
    start_step = int(step)

    verbose = config.verbose
    if verbose is None:
        verbose = 1 if sys.stdout.isatty() else 2
    timer = StepTimer()
    writer = tf.summary.create_file_writer(str(model_dir / "tensorboard" / "steps"))
    checkpointer = checkpoints.Checkpointer(manager, step, config.checkpoint_every,
                                            steps_per_epoch, history)
    timeline = None
    if config.timeline:
        # One measured step (forward + backward, no update) when fit ends: a
        # Chrome trace and a Gantt chart, also shown in TensorBoard's Images.
        timeline = tfpipe.profile.PipelineTimeline(
            x_train[: config.batch_size], y_train[: config.batch_size],
            log_dir=str(model_dir / "timeline"),
            tensorboard_dir=str(model_dir / "tensorboard" / "pipeline"))
    all_callbacks = [
        timer,
        checkpoints.StepRecorder(history, order.num_rows_of, start_step, writer),
        checkpointer,  # after the StepRecorder: it saves the history that one appends to
        keras.callbacks.TensorBoard(log_dir=str(model_dir / "tensorboard")),
        *([timeline] if timeline else []),
        *callbacks,
    ]

    validation = (x_val, y_val)

    def fit(first_step, last_step, epochs, initial_epoch):
        model.fit(
            order.dataset(x_train, y_train, first_step, last_step),
            epochs=epochs, initial_epoch=initial_epoch,
            steps_per_epoch=(last_step - first_step) // (epochs - initial_epoch),
            validation_data=validation, validation_batch_size=config.batch_size,
            callbacks=all_callbacks, verbose=verbose,
            shuffle=False,  # the order is BatchOrder's, a function of the step
        )

    epoch, into_epoch = divmod(start_step, steps_per_epoch)
    if start_step < total_steps and into_epoch:
        # Resumed mid-epoch: first the rest of that epoch, as its own Keras epoch.
        fit(start_step, (epoch + 1) * steps_per_epoch, epoch + 1, epoch)
        epoch += 1
    if epoch < config.epochs:
        fit(epoch * steps_per_epoch, total_steps, config.epochs, epoch)
    writer.close()

    checkpointer.save()  # the final state, whatever --checkpoint_every is
    plot_path = model_dir / checkpoints.LOSS_PLOT
    history.plot_loss(plot_path)
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
        "checkpoint": manager.latest_checkpoint,
        "loss_plot": str(plot_path),
        "data_kind": data.kind,
        "pipeline_summary": model.pipeline_summary(),
        "timeline": (timeline.paths[-1] if timeline and timeline.paths else None),
        "timeline_bubble": ((timeline.timelines[-1].measured_bubble,
                             timeline.timelines[-1].simulated_bubble)
                            if timeline and timeline.timelines else None),
        "model": model,
    }


# -- command line ---------------------------------------------------------------

_DEFAULTS = TrainConfig()
FLAGS = flags.FLAGS

flags.DEFINE_string("model", _DEFAULTS.model,
                    f"Model to train; one of {sorted(MODELS)} (mlp and resnet take images, "
                    f"unet segmentation masks, transformer text).")
flags.DEFINE_integer("depth", _DEFAULTS.depth,
                     "Hidden layers (mlp), residual blocks (resnet) or Transformer blocks "
                     "(transformer); 0: 4. Raised to at least --stages (a block per stage).")
flags.DEFINE_string(
    "dataset", _DEFAULTS.dataset,
    f"Data set: auto (the model's default: digits for mlp/resnet, digits_masks for "
    f"unet, pydoc_topics for transformer), one of {sorted(DATASETS)} (built in, no "
    f"download: digits is scikit-learn's 8x8 digits; digits_masks the same at 16x16 "
    f"with per-pixel ink labels; pydoc_topics is the English help text of Python's "
    f"stdlib pydoc_data.topics as bytes), or tfds:NAME for a TensorFlow Datasets data "
    f"set already prepared under --data_dir (image + label, or text; never downloaded).")
flags.DEFINE_string("data_dir", _DEFAULTS.data_dir,
                    "TFDS data directory for --dataset=tfds:NAME (default: TFDS's own, "
                    "~/tensorflow_datasets or $TFDS_DATA_DIR).")
flags.DEFINE_integer("max_examples", _DEFAULTS.max_examples,
                     "If > 0, use at most this many examples of each split.")
flags.DEFINE_integer("stages", _DEFAULTS.stages,
                     "Pipeline stages K; stage k runs on device k (GPU k, else logical CPU "
                     "k), or on device k mod D with --schedule=interleaved[:v] (D = K / v).")
flags.DEFINE_integer("microbatches", _DEFAULTS.microbatches,
                     "Micro-batches M per mini-batch; must divide --batch_size.")
flags.DEFINE_string("schedule", _DEFAULTS.schedule,
                    "Pipeline schedule: gpipe, 1f1b, interleaved (2 stages per device) or "
                    "interleaved:v (v per device); passed to "
                    "tfpipe.PipelineStrategy(schedule=...).")
flags.DEFINE_string("recompute", _DEFAULTS.recompute,
                    "Activation recomputation: always, except_last, never, or auto "
                    "(except_last when unrolled, always for --execution=loop).")
flags.DEFINE_enum("execution", _DEFAULTS.execution, ["unrolled", "loop"],
                  "unrolled: every action traced (graph grows with M); loop: a "
                  "tf.while_loop over clock ticks (graph independent of M; recompute always).")
flags.DEFINE_bool("timeline", _DEFAULTS.timeline,
                  "At the end, time one step per stage and write a Chrome trace and a PNG "
                  "Gantt chart to --model_dir/timeline (and TensorBoard's Images).")
flags.DEFINE_integer("batch_size", _DEFAULTS.batch_size, "Mini-batch size (rows per step).")
flags.DEFINE_integer("epochs", _DEFAULTS.epochs, "Training epochs.")
flags.DEFINE_integer("steps_per_epoch", _DEFAULTS.steps_per_epoch,
                     "Steps per epoch; 0: one pass over the training data. Batches are "
                     "drawn in seeded passes, so epochs need not align with passes.")
flags.DEFINE_integer("logical_cpus", _DEFAULTS.logical_cpus,
                     "Logical CPU devices to split the CPU into (>= the pipeline's devices: --stages, or --stages / v when interleaved).")
flags.DEFINE_string("model_dir", _DEFAULTS.model_dir,
                    "Output folder: tensorboard/ (logs), checkpoints/, history.json "
                    "(every step's loss) and loss.png. A run without --resume clears them.")
flags.DEFINE_integer("checkpoint_every", _DEFAULTS.checkpoint_every,
                     "Save a checkpoint (model, optimizer, step) every this many steps; "
                     "0: only at the end. The final state is always saved.")
flags.DEFINE_bool("resume", _DEFAULTS.resume,
                  "Continue from the latest checkpoint in --model_dir (same batches and "
                  "loss curve as if never stopped); starts afresh if there is none.")
flags.DEFINE_float("learning_rate", _DEFAULTS.learning_rate, "Adam learning rate.")
flags.DEFINE_integer("seed", _DEFAULTS.seed, "Seed of the initial weights and the data order.")


def config_from_flags():
    return TrainConfig(
        model=FLAGS.model, depth=FLAGS.depth, dataset=FLAGS.dataset, data_dir=FLAGS.data_dir,
        max_examples=FLAGS.max_examples, stages=FLAGS.stages,
        microbatches=FLAGS.microbatches, schedule=FLAGS.schedule,
        recompute=FLAGS.recompute, execution=FLAGS.execution, timeline=FLAGS.timeline,
        batch_size=FLAGS.batch_size, epochs=FLAGS.epochs,
        steps_per_epoch=FLAGS.steps_per_epoch, logical_cpus=FLAGS.logical_cpus,
        model_dir=FLAGS.model_dir, checkpoint_every=FLAGS.checkpoint_every,
        resume=FLAGS.resume, learning_rate=FLAGS.learning_rate, seed=FLAGS.seed,
    )


def format_summary(config, result):
    """The text `main` prints at the end of a run."""
    lines = [
        "",
        f"final train loss      {result['train_loss']:.4f}",
        f"final train accuracy  {result['train_accuracy']:.4f}",
        f"final val loss        {result['val_loss']:.4f}",
        f"final val accuracy    {result['val_accuracy']:.4f}",
    ]
    if result["data_kind"] == "text":
        lines.append(f"val bits per byte     {result['val_loss'] / np.log(2):.3f}")
    lines += [
        f"steps                 {result['steps']} (this run: from step {result['start_step']})",
        f"mean step time        {result['step_time_ms']:.2f} ms",
        f"TensorBoard logs      {os.path.join(config.model_dir, 'tensorboard')}",
        f"latest checkpoint     {result['checkpoint']}",
        f"loss curve            {result['loss_plot']}",
    ]
    if result.get("timeline"):
        measured, simulated = result["timeline_bubble"]
        lines.append(f"pipeline timeline     {result['timeline']} (bubble measured "
                     f"{measured:.1%}, simulated {simulated:.1%})")
    lines += [
        result["pipeline_summary"],
    ]
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    # Before any TensorFlow op: the device count is fixed once TF initialises.
    tfpipe.testing.use_logical_cpus(FLAGS.logical_cpus)
    if not FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)  # not an INFO line per checkpoint
    config = config_from_flags()
    result = train(config)
    print(format_summary(config, result))


if __name__ == "__main__":
    app.run(main)
