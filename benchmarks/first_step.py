"""Time to the first training step, and trace time against M: `python -m benchmarks.first_step`.

A pipelined step is traced (Python builds the graph) and optimised (grappler)
before its first run; the unrolled form traces every action, so that time
grows with M. This measures, for `keras.applications.MobileNetV2` (32x32
inputs, 10 classes, `weights=None`) cut into `--stages` stages by params:

  setup_s       wall time from the built Keras model to a compiled one:
                for tfpipe `from_model` and `compile` (which cuts the stages,
                probes their boundaries and builds the optimizer's slots on
                each stage's device); for plain Keras `compile`, and for the
                "plain_built" row also `optimizer.build`
  first_fit_s   wall time of `fit` on one batch (trace, optimisation, one
                step): what a user waits for before the first step
  step_ms       the median of `--steps` later steps, each timed from Keras'
                `on_train_batch_begin` to `on_train_batch_end` in a second
                `fit` (its first step left out); `steps_ms` lists them all

for two plain Keras baselines on one device, and for tfpipe with each
execution and M in `--microbatches`, each in a fresh child process (logical
CPUs, default threads). The baselines differ in one thing:

  plain         `compile`, then `fit`, as a user writes it. Keras builds
                Adam's slots inside the first `fit`'s trace, and a
                `tf.function` that creates variables is traced twice, so this
                first fit holds two traces of the step.
  plain_built   the optimizer built (`optimizer.build`) before `fit`, as
                tfpipe's `compile` does: one trace.

Each row reports first_fit_s over each baseline's, and (setup_s +
first_fit_s) over plain's (the whole wait from a built model). The ratios,
not the absolute times, are the result: every row shares the machine's speed.

    python -m benchmarks.first_step                              # ~6 min on 2 cores
    python -m benchmarks.first_step --microbatches=1,8 --executions=loop
    python -m benchmarks.first_step --microbatches=8 --onednn=default,off
    python -m benchmarks.first_step --microbatches=8 --executions=stage_functions --recompute=always
"""

import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads

from benchmarks import common

IMAGE, CLASSES = 32, 10


def measure_first_fit(num_microbatches, execution, stages, batch, pipelined=True, seed=0,
                      steps=8, build_optimizer=False, recompute=None):
    """Builds MobileNetV2 (pipelined or plain); times its set-up, the first
    fit, then `steps` later steps; in a child. `build_optimizer` (plain only)
    builds the optimizer's variables in the set-up, before `fit`; `recompute`
    (pipelined only) is the strategy's, None for its default."""
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=((steps + 1) * batch, IMAGE, IMAGE, 3)).astype("float32")
    y = rng.integers(0, CLASSES, size=((steps + 1) * batch,))
    source = keras.applications.MobileNetV2(weights=None, input_shape=(IMAGE, IMAGE, 3),
                                            classes=CLASSES)
    compile_kwargs = dict(optimizer="adam", loss="sparse_categorical_crossentropy")
    if pipelined and build_optimizer:
        raise ValueError("build_optimizer=True is for plain Keras: tfpipe's compile "
                         "always builds the optimizer; pass pipelined=False.")
    start = time.perf_counter()
    if pipelined:
        strategy = tfpipe.PipelineStrategy(
            devices=[f"/CPU:{i}" for i in range(stages)], num_microbatches=num_microbatches,
            execution=execution, recompute=recompute)
        with strategy.scope():
            model = tfpipe.PipelinedModel.from_model(source, balance="params")
            model.compile(**compile_kwargs)
    else:
        model = source
        model.compile(jit_compile=False, **compile_kwargs)
        if build_optimizer:
            model.optimizer.build(model.trainable_variables)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0, shuffle=False)
    first = time.perf_counter() - start
    timer = StepTimer()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[timer])
    later = timer.steps_ms[1:]  # the second fit's first step sets up its iterator
    return {"setup_s": setup, "first_fit_s": first, "step_ms": statistics.median(later),
            "steps_ms": later, "recompute": model.recompute if pipelined else None,
            "peak_rss_mib": common.peak_rss_mib()}


def StepTimer():  # pylint: disable=invalid-name
    """A Keras callback that lists each training step's wall time (ms),
    from `on_train_batch_begin` to `on_train_batch_end` (Keras calls the
    step function in between and it returns when the step has run)."""
    import keras  # pylint: disable=import-outside-toplevel

    class _StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps_ms, self._start = [], None

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.steps_ms.append(1000.0 * (time.perf_counter() - self._start))

    return _StepTimer()


ONEDNN = {"default": {}, "off": {"TF_ENABLE_ONEDNN_OPTS": "0"}}  # child environments


BASELINES = {"plain": {}, "plain_built": {"build_optimizer": True}}  # measure_first_fit kwargs


def grid(microbatches, executions, stages=4, batch=32, steps=8, onednn=("default",), log=print,
         timeout=1800, recompute=None):
    """For each oneDNN setting (`ONEDNN`: "default" keeps this process's
    environment, so TensorFlow's choice for the CPU unless
    TF_ENABLE_ONEDNN_OPTS is already set; "off" sets it to 0), the plain
    baselines (`BASELINES`), then every (execution, M); a list of rows, each
    over its own setting's baselines (`over_baselines`)."""
    for setting in onednn:  # all checked before the first child runs
        if setting not in ONEDNN:
            raise ValueError(f"onednn: {setting!r} is not one of {sorted(ONEDNN)}; "
                             "pass e.g. --onednn=default,off")
    rows = []
    for setting in onednn:
        configs = [(b, 1) for b in BASELINES] + [(e, m) for e in executions for m in microbatches]
        setting_rows = []
        for execution, m in configs:
            pipelined = execution not in BASELINES
            result = common.run_child(
                "benchmarks.first_step:measure_first_fit",
                dict(num_microbatches=m, execution=execution if pipelined else None,
                     stages=stages, batch=batch, pipelined=pipelined, steps=steps,
                     **(BASELINES[execution] if not pipelined else {"recompute": recompute})),
                intra_op=0, inter_op=0, devices=stages, timeout=timeout, env=ONEDNN[setting])
            row = {"execution": execution, "num_microbatches": m, "onednn": setting,
                   "result": result}
            row.update({k: result.get(k) for k in ("setup_s", "first_fit_s", "step_ms")})
            setting_rows.append(row)
            log(f"{execution:<11} M={m:<3} oneDNN {setting:<7} set-up "
                f"{common.fmt(row['setup_s'], 1)} s  first fit "
                f"{common.fmt(row['first_fit_s'], 1)} s  step {common.fmt(row['step_ms'], 0)} ms"
                + (f"  ERROR {common.error_line(result)}"
                   if "error" in result else ""))
        rows += over_baselines(setting_rows)
    return rows


def _ratio(a, b):
    return a / b if a and b else None


def _wait(row):
    """Set-up + first fit (s), or None where either is missing."""
    if row.get("setup_s") is None or not row.get("first_fit_s"):
        return None
    return row["setup_s"] + row["first_fit_s"]


def over_baselines(rows):
    """Adds to each of one setting's rows its first fit over each baseline's
    (`first_fit_over_plain`, `first_fit_over_plain_built`) and its whole wait
    from a built model over plain's (`wait_over_plain`: set-up + first fit);
    None where a figure is missing. Returns `rows`."""
    base = {r["execution"]: r for r in rows if r["execution"] in BASELINES}
    plain, built = base.get("plain", {}), base.get("plain_built", {})
    for row in rows:
        row["first_fit_over_plain"] = _ratio(row["first_fit_s"], plain.get("first_fit_s"))
        row["first_fit_over_plain_built"] = _ratio(row["first_fit_s"], built.get("first_fit_s"))
        row["wait_over_plain"] = _ratio(_wait(row), _wait(plain))
    return rows


def table(rows):
    """A markdown table; a oneDNN column only when the rows have several settings."""
    settings = len({r.get("onednn", "default") for r in rows}) > 1
    return common.markdown_table(
        ["execution", "M"] + (["oneDNN"] if settings else [])
        + ["set-up (s)", "first fit (s)", "first fit / plain", "first fit / plain_built",
           "(set-up + first fit) / plain's", "median later step (ms)"],
        [[r["execution"], str(r["num_microbatches"])]
         + ([r.get("onednn", "default")] if settings else [])
         + [common.fmt(r.get("setup_s"), 1), common.fmt(r["first_fit_s"], 1),
            common.fmt(r["first_fit_over_plain"]),
            common.fmt(r.get("first_fit_over_plain_built")),
            common.fmt(r.get("wait_over_plain")), common.fmt(r["step_ms"], 0)] for r in rows])


def main(argv):
    from absl import app  # pylint: disable=import-outside-toplevel
    from absl import flags  # pylint: disable=import-outside-toplevel
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    start = time.perf_counter()
    info = common.machine()
    print(f"machine: {common.machine_label(info)}; load average {info['load_average_at_start']}")
    rows = grid(common.parse_ints(f.microbatches), [e for e in f.executions.split(",") if e],
                stages=f.stages, batch=f.batch, steps=f.steps,
                onednn=[o for o in f.onednn.split(",") if o], recompute=f.recompute or None)
    print(table(rows))
    out = common.write_json(f.out, {"machine": info, "rows": rows,
                                    "wall_s": time.perf_counter() - start})
    print(f"wrote {out} in {time.perf_counter() - start:.0f} s")


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_string("microbatches", "1,8,32", "Micro-batch counts M.")
    flags.DEFINE_string("executions", "unrolled,stage_functions,loop", "Executions to time.")
    flags.DEFINE_integer("stages", 4, "Stages (logical CPUs).")
    flags.DEFINE_integer("batch", 32, "Rows per step (a multiple of every M).")
    flags.DEFINE_integer("steps", 8, "Later steps timed for step_ms (their median).")
    flags.DEFINE_string("onednn", "default",
                        "oneDNN settings, each a full grid: default (TensorFlow's choice for "
                        "this CPU) and/or off (TF_ENABLE_ONEDNN_OPTS=0).")
    flags.DEFINE_string("recompute", "", "The pipelined rows' recompute mode; empty for "
                        "tfpipe's default (except_last, or always for the loop form).")
    flags.DEFINE_string("out", str(common.RESULTS_DIR / "first_step.json"), "JSON output.")


if __name__ == "__main__":
    from absl import app as _app
    _define_flags()
    _app.run(main)
