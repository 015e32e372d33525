"""Trains a model with tfpipe pipeline parallelism: `python -m launch.train`.

The defaults run offline in well under two minutes on a small CPU machine:
the digits MLP cut into 4 stages on 4 logical CPUs, 4 micro-batches, 3 epochs.

    python -m launch.train --stages=2 --microbatches=8 --epochs=5

Tests and other code call `train(TrainConfig(...))` directly, without flags.
"""

import dataclasses
import importlib.util
import os
import pathlib
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads: quieter logs

from absl import app
from absl import flags
import keras
import numpy as np

import tfpipe
from models import mlp


@dataclasses.dataclass
class TrainConfig:
    """Everything one training run needs; the flags of `main` map onto it."""

    model: str = "mlp"
    dataset: str = "digits"
    stages: int = 4
    microbatches: int = 4
    schedule: str = "gpipe"
    recompute: str = "except_last"
    batch_size: int = 64
    epochs: int = 3
    logical_cpus: int = 4
    model_dir: str = "/tmp/tfpipe_run"
    learning_rate: float = 1e-3
    seed: int = 0
    verbose: int | None = None  # None: 1 (progress bar) on a tty, else 2 (a line per epoch)


# -- data sets: name -> fn(seed) -> ((x_train, y_train), (x_val, y_val)) --------


def load_digits(seed=0):
    """scikit-learn's bundled digits: 1797 8x8 images as 64 features in [0, 1].

    A fixed shuffle (numpy default_rng(seed)) then an 80/20 split.

    Returns:
      ((x_train, y_train), (x_val, y_val)): x float32 (n, 64), y int32 (n,);
      1437 training and 360 validation rows.
    """
    from sklearn import datasets  # pylint: disable=import-outside-toplevel

    digits = datasets.load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_train = int(round(0.8 * len(x)))
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


DATASETS = {"digits": load_digits}

# -- models: name -> fn(config) -> plain keras model ---------------------------

MODELS = {"mlp": lambda config: mlp.digits_mlp(config.stages)}

BALANCES = {"mlp": mlp.stage_balance}


def _choose(kind, name, choices):
    if name not in choices:
        raise ValueError(
            f"Unknown {kind} {name!r}; valid choices: {', '.join(sorted(choices))}."
        )
    return choices[name]


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


def train(config):
    """Trains `config.model` on `config.dataset` as a tfpipe pipeline.

    Args:
      config: a `TrainConfig`.

    Returns:
      A dict: "history" (Keras History.history, per-epoch lists), "val_accuracy"
      (final epoch), "step_time_ms" (mean training step, first step left out),
      "train_loss", "train_accuracy" (final epoch) and "pipeline_summary" (text).

    Raises:
      ValueError: unknown model or dataset name, or more stages than logical CPUs.
      ImportError: the tensorboard package (for the TensorBoard callback) is missing.
    """
    load_data = _choose("dataset", config.dataset, DATASETS)
    make_model = _choose("model", config.model, MODELS)
    balance_fn = BALANCES[config.model]
    if importlib.util.find_spec("tensorboard") is None:
        # Keras' TensorBoard callback needs it, and would fail only mid-epoch.
        raise ImportError(
            "launch.train logs to TensorBoard, which is not installed: "
            "pip install tensorboard"
        )
    if config.stages > config.logical_cpus:
        raise ValueError(
            f"stages={config.stages} needs at least that many devices, but "
            f"logical_cpus={config.logical_cpus}."
        )
    # A no-op when the process already has this many logical CPUs (e.g. main()
    # or a test's conftest called it); must precede every TensorFlow op.
    tfpipe.testing.use_logical_cpus(config.logical_cpus)
    keras.utils.set_random_seed(config.seed)
    (x_train, y_train), (x_val, y_val) = load_data(config.seed)
    model_dir = pathlib.Path(config.model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)

    devices = [f"/CPU:{k}" for k in range(config.stages)]
    strategy = tfpipe.PipelineStrategy(
        devices=devices, num_microbatches=config.microbatches,
        schedule=config.schedule, recompute=config.recompute,
    )
    plain = make_model(config)
    with strategy.scope():
        model = tfpipe.PipelinedModel.from_model(
            plain, balance=balance_fn(plain, config.stages)
        )
        model.compile(
            optimizer=keras.optimizers.Adam(config.learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    timer = StepTimer()
    verbose = config.verbose
    if verbose is None:
        verbose = 1 if sys.stdout.isatty() else 2
    history = model.fit(
        x_train, y_train,
        batch_size=config.batch_size,
        epochs=config.epochs,
        validation_data=(x_val, y_val),
        callbacks=[timer, keras.callbacks.TensorBoard(log_dir=str(model_dir / "tensorboard"))],
        verbose=verbose,
    )
    hist = history.history
    return {
        "history": hist,
        "val_accuracy": float(hist["val_accuracy"][-1]),
        "step_time_ms": timer.mean_ms(),
        "train_loss": float(hist["loss"][-1]),
        "train_accuracy": float(hist["accuracy"][-1]),
        "pipeline_summary": model.pipeline_summary(),
    }


# -- command line ---------------------------------------------------------------

_DEFAULTS = TrainConfig()
FLAGS = flags.FLAGS

flags.DEFINE_string("model", _DEFAULTS.model, f"Model to train; one of {sorted(MODELS)}.")
flags.DEFINE_string("dataset", _DEFAULTS.dataset,
                    f"Data set; one of {sorted(DATASETS)} (digits: scikit-learn's "
                    f"bundled 8x8 digits, no download).")
flags.DEFINE_integer("stages", _DEFAULTS.stages,
                     "Pipeline stages K; stage k runs on logical CPU k.")
flags.DEFINE_integer("microbatches", _DEFAULTS.microbatches,
                     "Micro-batches M per mini-batch; must divide --batch_size.")
flags.DEFINE_string("schedule", _DEFAULTS.schedule, "Pipeline schedule (e.g. gpipe).")
flags.DEFINE_string("recompute", _DEFAULTS.recompute,
                    "Activation recomputation: always, except_last or never.")
flags.DEFINE_integer("batch_size", _DEFAULTS.batch_size, "Mini-batch size (rows per step).")
flags.DEFINE_integer("epochs", _DEFAULTS.epochs, "Training epochs.")
flags.DEFINE_integer("logical_cpus", _DEFAULTS.logical_cpus,
                     "Logical CPU devices to split the CPU into (>= --stages).")
flags.DEFINE_string("model_dir", _DEFAULTS.model_dir,
                    "Output folder; TensorBoard logs go to MODEL_DIR/tensorboard.")
flags.DEFINE_float("learning_rate", _DEFAULTS.learning_rate, "Adam learning rate.")


def config_from_flags():
    return TrainConfig(
        model=FLAGS.model, dataset=FLAGS.dataset, stages=FLAGS.stages,
        microbatches=FLAGS.microbatches, schedule=FLAGS.schedule,
        recompute=FLAGS.recompute, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs,
        logical_cpus=FLAGS.logical_cpus, model_dir=FLAGS.model_dir,
        learning_rate=FLAGS.learning_rate,
    )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    # Before any TensorFlow op: the device count is fixed once TF initialises.
    tfpipe.testing.use_logical_cpus(FLAGS.logical_cpus)
    config = config_from_flags()
    result = train(config)
    print()
    print(f"final train loss      {result['train_loss']:.4f}")
    print(f"final train accuracy  {result['train_accuracy']:.4f}")
    print(f"final val accuracy    {result['val_accuracy']:.4f}")
    print(f"mean step time        {result['step_time_ms']:.2f} ms")
    print(f"TensorBoard logs      {os.path.join(config.model_dir, 'tensorboard')}")
    print(result["pipeline_summary"])


if __name__ == "__main__":
    app.run(main)
