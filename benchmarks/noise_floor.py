"""Plain Keras' own rounding noise beside tfpipe's difference from it:
`python -m benchmarks.noise_floor`.

On an ill-conditioned model a difference from plain Keras says nothing by
itself: plain Keras' own step moves when its input is scaled by 1 + eps (eps
= 1e-7 in float32, 1e-15 in float64, about one unit of rounding). Per image
size and precision, in a fresh child process on 4 logical CPUs, for
keras.applications' ResNet50 (random weights, 5 classes, SGD steps over
`--images` images, `--batch` per step):

  update      the largest change of a trainable weight in plain Keras' step
  noise       the largest trainable weight difference between plain Keras' step
              on x and on x * (1 + eps): its own noise floor ("noise / update")
  <execution> the largest trainable weight difference of tfpipe (M = 1, 4
              stages) from plain Keras on x

(Trainable weights: BatchNorm's moving variances over a few 1x1 maps are so
large that they would swamp every column.)

A pipeline difference far above the noise in float32 but at or below it in
float64 is rounding; a real difference keeps its size in float64
(`tfpipe_tests/test_float64.py` proves every execution in float64).

    python -m benchmarks.noise_floor                    # ~4 min on 2 cores
    python -m benchmarks.noise_floor --sizes=64 --dtypes=float64
"""

from benchmarks import common

EPS = {"float32": 1e-7, "float64": 1e-15}
EXECUTIONS = ("unrolled", "stage_functions", "loop")


def measure(size, images, batch, dtype, executions):
    """One child: the row of the table above for one size and precision."""
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel

    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)

    def make():
        keras.utils.set_random_seed(0)
        return keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=5)

    def compiled(model):
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
        return model

    def largest(a, b):
        return max(float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64))))
                   for u, v in zip(a, b))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(images, size, size, 3)).astype(dtype)
    y = rng.integers(0, 5, images)
    def weights(model):
        return [v.numpy() for v in model.trainable_weights]

    trained = {}
    for name, inputs in (("plain", x), ("noisy", x * (1 + EPS[dtype]))):
        model = compiled(make())
        initial = weights(model)
        model.fit(inputs, y, batch_size=batch, shuffle=False, verbose=0)
        trained[name] = weights(model)
    row = {"size": size, "images": images, "batch": batch, "dtype": dtype, "eps": EPS[dtype],
           "update": largest(initial, trained["plain"]),
           "noise": largest(trained["plain"], trained["noisy"])}
    for execution in executions:
        model = make()
        with tfpipe.PipelineStrategy(num_microbatches=1, execution=execution).scope():
            compiled(tfpipe.PipelinedModel.from_model(model)).fit(
                x, y, batch_size=batch, shuffle=False, verbose=0)
        row[execution] = largest(trained["plain"], weights(model))
    return row


def table(rows, executions):
    for r in rows:
        if "update" in r:
            r["noise_per_update"] = r["noise"] / r["update"]
    return common.markdown_table(
        [("size", "size", None), ("images", "images", None), ("per batch", "batch", None),
         ("dtype", "dtype", None),
         ("eps", "eps", "g"), ("plain update", "update", ".3g"), ("plain noise", "noise", ".3g"),
         ("noise / update", "noise_per_update", ".2g")]
        + [(f"tfpipe {e}", e, ".3g") for e in executions], rows)


def main(argv):
    from absl import flags  # pylint: disable=import-outside-toplevel
    f = flags.FLAGS
    info, start = common.begin(argv)
    rows = []
    for size in map(int, f.sizes):
        for dtype in f.dtypes:
            rows.append(common.run_child("benchmarks.noise_floor:measure", dict(
                size=size, images=f.images, batch=f.batch, dtype=dtype,
                executions=list(f.executions)), intra_op=2, inter_op=2, devices=4))
            print(rows[-1], flush=True)
    common.finish(f.out, info, start, rows,
                  f"ResNet50 (random weights, 5 classes), SGD (lr 0.01) over {f.images} "
                  f"images, {f.batch} per step; tfpipe M=1 on 4 logical CPUs; trainable "
                  f"weights",
                  table(rows, f.executions), config={"images": f.images, "batch": f.batch})


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_list("sizes", ["32", "64"], "Image sizes (pixels a side).")
    flags.DEFINE_list("dtypes", list(EPS), f"Precisions, of {', '.join(EPS)}.")
    flags.DEFINE_list("executions", list(EXECUTIONS), "tfpipe executions.")
    flags.DEFINE_integer("images", 8, "Images in the step.", lower_bound=1)
    flags.DEFINE_integer("batch", 4, "Images per batch.", lower_bound=1)
    flags.DEFINE_string("out", str(common.RESULTS_DIR / "noise_floor.json"), "JSON output.")
    common.positive_ints("sizes")
    common.one_of("dtypes", list(EPS))
    common.one_of("executions", EXECUTIONS)


if __name__ == "__main__":
    from absl import app as _app
    _define_flags()
    _app.run(main)
