"""tfpipe at K=1, M=1 against plain Keras: `python -m benchmarks.overhead`.

One child process (one intra-op and one inter-op thread: the model is tiny,
and thread-pool noise would swamp the difference) builds the same MLP twice,
64 -> 4 x Dense(`--width`, relu) -> Dense(10), Adam(1e-3), sparse categorical
cross-entropy, with the same initial weights, on the same random data:

  plain   keras.Sequential, `fit`
  tfpipe  PipelinedModel.from_model(...) on ["/CPU:0"]: one stage,
          num_microbatches=1, recompute="never"

With one stage and one micro-batch the pipeline does plain Keras' arithmetic,
so the ratios measure tfpipe's own cost:

  first fit s   the first `fit` of `--steps` steps (tracing, graph
                optimisation, the steps), after a throwaway fit of another
                small model has paid the process's one-off costs; the two
                models take turns to go first, child by child. Plain Keras
                as users write it: its optimizer is built in its first step,
                which it therefore traces twice
  step ms       a callback times every step of a later `fit`; a run's time is
                its mean step, the figure the median of `--repeats` runs, the
                two models taking turns to go first

`--rounds` children per tree, each figure the median over them; with
`--tree=old=/work/base` the trees alternate child by child (A, B, A, B, ...).

    python -m benchmarks.overhead                                 # ~1 min on 2 cores
    python -m benchmarks.overhead --tree=old=/work/base
"""

import time

from benchmarks import common

MEASURED = ("plain_ms", "step_ms", "plain_first_fit_s", "first_fit_s")
NUM_CLASSES, FEATURES = 10, 64


def _models(width, seed=0):
    """(plain, pipelined): the same layers' architecture and initial weights, compiled."""
    import keras  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(seed)
    plain = keras.Sequential([keras.Input((FEATURES,))] + common.mlp_layers(4, width)
                             + [keras.layers.Dense(NUM_CLASSES)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tfpipe.PipelineStrategy(devices=["/CPU:0"], num_microbatches=1,
                                 recompute="never").scope():
        twin = keras.models.clone_model(plain)
        twin.set_weights(plain.get_weights())
        pipelined = tfpipe.PipelinedModel.from_model(twin, balance=[len(twin.layers)])
        pipelined.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    plain.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile=False)
    return {"plain": plain, "tfpipe": pipelined}


def measure(steps, batch, repeats, width, first="plain", seed=0):
    """Both models' first fit and step time in this child; `first` fits first."""
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch * steps, FEATURES)).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=(batch * steps,)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch).prefetch(2)

    class StepTimer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.times = []

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    def fit(model):
        timer = StepTimer()
        model.fit(data, steps_per_epoch=steps, epochs=1, callbacks=[timer], verbose=0)
        return 1000.0 * float(np.mean(timer.times))

    throwaway = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    throwaway.compile(optimizer="adam", loss="mse")
    throwaway.fit(np.zeros((4, 3)), np.zeros((4, 2)), verbose=0)
    models = _models(width, seed)
    first_fit = {}
    for name in sorted(models, key=lambda n: n != first):
        start = time.perf_counter()
        fit(models[name])
        first_fit[name] = time.perf_counter() - start
    runs = common.alternate({name: lambda m=m: fit(m) for name, m in models.items()}, repeats)
    return {"plain_ms": common.median(runs["plain"]), "step_ms": common.median(runs["tfpipe"]),
            "plain_first_fit_s": first_fit["plain"], "first_fit_s": first_fit["tfpipe"],
            "runs_ms": runs, "first": first}


def run(trees=(("new", None),), rounds=2, log=print, **kwargs):
    """`rounds` children per tree, trees alternating, the models' order
    alternating per round; one row per tree (medians), the ratios tfpipe/plain
    and, where there are several trees, the first tree's over each other's."""
    children = {label: [] for label, _ in trees}
    for r, (label, path) in common.interleave(range(rounds), list(trees)):
        result = common.run_child("benchmarks.overhead:measure",
                                  dict(kwargs, first=("plain", "tfpipe")[r % 2]), tree=path)
        children[label].append(result)
        log(f"{label:>6} round {r}: " + (f"ERROR {common.error_line(result)}" if "error" in
                                        result else ", ".join(f"{key} {result[key]:.3f}"
                                                              for key in MEASURED)))
    rows = []
    for label, results in children.items():
        good = [r for r in results if "error" not in r]
        row = {"tree": label, "children": results}
        row.update({key: common.median([r[key] for r in good]) for key in MEASURED})
        if good:
            row["step_ratio"] = row["step_ms"] / row["plain_ms"]
            row["first_fit_ratio"] = row["first_fit_s"] / row["plain_first_fit_s"]
        if len(good) < len(results):
            row["error"] = next(common.error_line(r) for r in results if "error" in r)
        rows.append(row)
    return common.add_tree_ratios(rows, lambda r: None, ("step_ms", "first_fit_s"))


def table(rows):
    return common.tree_table(
        [("plain step ms", "plain_ms", 3), ("tfpipe step ms", "step_ms", 3),
         ("step tfpipe / plain", "step_ratio", 3),
         ("plain first fit s", "plain_first_fit_s", 2), ("tfpipe first fit s", "first_fit_s", 2),
         ("first fit tfpipe / plain", "first_fit_ratio", 2)],
        rows, [("step ms", "step_ms"), ("first fit s", "first_fit_s")])


def main(argv):
    from absl import flags  # pylint: disable=import-outside-toplevel
    f = flags.FLAGS
    info, start = common.begin(argv)
    trees = common.parse_trees(f.tree, f.label)
    config = {"steps": f.steps, "batch": f.batch, "repeats": f.repeats, "width": f.width}
    rows = run(trees, f.rounds, **config)
    common.finish(f.out, info, start, rows, f"{FEATURES} -> 4 x Dense({f.width}, relu) -> "
                  f"Dense({NUM_CLASSES}), Adam, batch {f.batch}, {f.steps} steps a fit; "
                  f"tfpipe K=1, M=1; medians of {f.rounds} children", table(rows),
                  config=config, rounds=f.rounds, trees=dict(trees))


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_integer("steps", 50, "Steps per fit.", lower_bound=1)
    flags.DEFINE_integer("batch", 256, "Rows per step.", lower_bound=1)
    flags.DEFINE_integer("repeats", 5, "Timed fits per model and child.", lower_bound=1)
    flags.DEFINE_integer("width", 128, "Hidden width.", lower_bound=1)
    flags.DEFINE_integer("rounds", 4, "Children per tree (models' order alternating).",
                         lower_bound=1)
    flags.DEFINE_string("out", str(common.RESULTS_DIR / "overhead.json"), "JSON output.")
    common.define_tree_flags()


if __name__ == "__main__":
    from absl import app as _app
    _define_flags()
    _app.run(main)
