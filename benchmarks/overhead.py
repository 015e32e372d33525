"""tfpipe's overhead over plain Keras at K=1, M=1: `python -m benchmarks.overhead`.

One process trains the same MLP (`models.mlp.digits_mlp(1)`, 64 -> 4x128 -> 10)
on the same random data (4096 x 64 float32, 10 classes) with the same
optimizer (Adam 1e-3) and loss, twice over:

  plain   keras.Sequential.fit
  tfpipe  PipelinedModel.from_model(...) on devices=["/CPU:0"], one stage,
          num_microbatches=1, recompute="never"

With one stage and one micro-batch the pipeline does the same arithmetic as
plain Keras, so the ratio of step times measures tfpipe's own overhead
(scatter/gather, the engine's per-stage backward, the strategy). Goal:
tfpipe / plain <= 1.05.

Method: both models are built and traced by a warm-up run first (not timed);
then `--repeats` timed runs of `--steps` steps each, alternating which model
goes first. A callback times every step from on_train_batch_begin to
on_train_batch_end; a run's time is the mean of its steps, and the reported
time is the median over runs.

For stable numbers TensorFlow runs with one intra-op and one inter-op thread
(set before TensorFlow initialises): the model is tiny, and thread-pool
scheduling noise would otherwise swamp the difference being measured.

    python -m benchmarks.overhead --steps=100 --repeats=5
"""

import json
import os
import pathlib
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads: quieter logs

from absl import app
from absl import flags
import keras
import numpy as np
import tensorflow as tf

import tfpipe
from models import mlp

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 50, "Timed training steps per run (after the warm-up run).")
flags.DEFINE_integer("batch_size", 256, "Rows per training step.")
flags.DEFINE_integer("repeats", 5,
                     "Timed runs per model, alternating plain/tfpipe order; the median "
                     "run is reported.")
flags.DEFINE_integer("examples", 4096, "Rows of random training data.")
flags.DEFINE_string("out", "benchmarks/results/overhead.json",
                    "Where to write the results as JSON (folders are created).")

GOAL = 1.05
NUM_CLASSES = 10


def _set_threads():
    """One intra-op and one inter-op thread; must run before TF initialises."""
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def _data(examples, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 64)).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=(examples,)).astype("int32")
    return x, y


def _dataset(x, y, batch_size):
    return (tf.data.Dataset.from_tensor_slices((x, y))
            .repeat()
            .batch(batch_size, drop_remainder=True)
            .prefetch(2))


class StepTimer(keras.callbacks.Callback):
    """Records each training step's time, on_train_batch_begin to _end."""

    def __init__(self):
        super().__init__()
        self.times = []
        self._start = None

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def _models(seed=0):
    """(plain, pipelined): same architecture and initial weights, both compiled."""
    keras.utils.set_random_seed(seed)
    plain = mlp.digits_mlp(1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    strategy = tfpipe.PipelineStrategy(devices=["/CPU:0"], num_microbatches=1,
                                       recompute="never")
    with strategy.scope():
        # Copies plain's initial weights, before plain trains.
        pipelined = tfpipe.PipelinedModel.from_model(plain, balance=[len(plain.layers)])
        pipelined.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    plain.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile=False)
    return plain, pipelined


def _run(model, dataset, steps):
    """Mean step time in ms over one fit() of `steps` steps."""
    timer = StepTimer()
    model.fit(dataset, steps_per_epoch=steps, epochs=1, callbacks=[timer], shuffle=False,
              verbose=0)
    return 1000.0 * float(np.mean(timer.times))


def benchmark(steps, batch_size, repeats, examples):
    """Returns a dict of results; see the module docstring for the method."""
    x, y = _data(examples)
    dataset = _dataset(x, y, batch_size)
    plain, pipelined = _models()
    models = {"plain": plain, "tfpipe": pipelined}
    for model in models.values():  # warm-up: tracing, first-step allocations
        _run(model, dataset, steps)
    runs = {name: [] for name in models}
    for r in range(repeats):
        order = ["plain", "tfpipe"] if r % 2 == 0 else ["tfpipe", "plain"]
        for name in order:
            runs[name].append(_run(models[name], dataset, steps))
    plain_ms = statistics.median(runs["plain"])
    tfpipe_ms = statistics.median(runs["tfpipe"])
    ratio = tfpipe_ms / plain_ms
    return {
        "plain_step_ms": plain_ms,
        "tfpipe_step_ms": tfpipe_ms,
        "ratio": ratio,
        "goal": GOAL,
        "meets_goal": ratio <= GOAL,
        "runs_ms": runs,
        "config": {
            "steps": steps, "batch_size": batch_size, "repeats": repeats,
            "examples": examples, "features": 64, "classes": NUM_CLASSES,
            "model": "digits_mlp(1): 64 -> 4 x Dense(128, relu) -> Dense(10)",
            "optimizer": "Adam(1e-3)", "tfpipe": "K=1 (/CPU:0), M=1, recompute=never",
            "intra_op_threads": 1, "inter_op_threads": 1,
        },
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                     "python": platform.python_version()},
    }


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    _set_threads()  # first: before any TensorFlow op initialises the runtime
    result = benchmark(FLAGS.steps, FLAGS.batch_size, FLAGS.repeats, FLAGS.examples)
    out = pathlib.Path(FLAGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"plain Keras step   {result['plain_step_ms']:.3f} ms (median of "
          f"{FLAGS.repeats} runs x {FLAGS.steps} steps, batch {FLAGS.batch_size})")
    print(f"tfpipe K=1 M=1     {result['tfpipe_step_ms']:.3f} ms")
    print(f"ratio tfpipe/plain {result['ratio']:.3f}  (goal <= {GOAL}: "
          f"{'met' if result['meets_goal'] else 'NOT met'})")
    print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
