"""Speed-up per schedule, with trace time: `python -m benchmarks.speedup`.

Two models (`--model`):

- mlp: `--layers` x Dense(`--width`, relu), Adam(1e-4), MSE, one fixed random
  batch of `--batch` rows (default 8 x Dense(512), 2048 rows: the smallest
  micro-batch, M=16, still has 128 rows), cut into K equal stages;
- transformer: the repo's decoder-only LM (`models/transformer_lm.py`:
  `--layers` pre-norm blocks of `--width` with `--heads` heads over
  `--seq_len` byte tokens, a 256-way logits head), Adam(1e-4), sparse
  cross-entropy on logits, one fixed random batch of `--batch` sequences, cut
  by `from_model` with the blocks spread evenly (`stage_balance`).

Each row (K, M, schedule) is one fresh child process with K logical CPU
devices, one intra-op thread and K inter-op threads, set before TensorFlow
starts, and `serialize_ops`: each device runs its ops one at a time in trace
order, one stream per device as on an accelerator, while the K inter-op
threads let different devices run at once. In the same child the plain Keras
model (same layers and batch, `jit_compile=False`) runs under TensorFlow's
single-threaded executor: one op at a time on one device, the reference.

  plain ms, tfpipe ms  the median over `--repeats` runs of `--steps` steps,
                       after `--warmup` calls, the two models taking turns
                       to go first
  speed-up             plain ms / tfpipe ms (same child: drift cancels)
  ideal                `tfpipe.schedules.simulate` (forward 1, backward 2,
                       the row's recompute): serial work / makespan
  trace s              the pipelined model's first call (trace, graph
                       optimisation, one step); the plain model's first call
                       runs before it, so the process's one-off costs fall
                       there

K=1 rows run the first schedule only. `--tree=old=/work/base` runs every row
against that checkout too (its `tfpipe` first on the child's sys.path), the
trees alternating row by row; their rows get "new/tree" ratios (this
checkout's value over theirs). Results: `--out` (JSON, with the machine).

    python -m benchmarks.speedup                                  # ~5 min on 2 cores
    python -m benchmarks.speedup --devices=2 --microbatches=4,8,16 --tree=old=/work/base
"""

import time

from benchmarks import common

SCHEDULES = ("gpipe", "1f1b", "zbh1", "default")  # default: tfpipe's choice (None)
RECOMPUTE = ("never", "except_last", "always", "default")  # default: tfpipe's (None)
EXECUTIONS = ("auto", "unrolled", "stage_functions", "loop")
MODEL = {"layers": 8, "width": 512, "batch": 2048}
# The transformer of issue 43's table: 8 blocks, width 128, 8 heads, 64 tokens, 32 sequences.
TRANSFORMER = {"layers": 8, "width": 128, "batch": 32, "heads": 8, "seq_len": 64}
MODELS = ("mlp", "transformer")
TIMING = {"warmup": 2, "repeats": 5, "steps": 3}
FIELDS = ("execution", "schedule_used", "plain_ms", "step_ms", "speedup", "ideal", "trace_s",
          "plain_trace_s", "trace_ratio", "recompute_used", "peak_rss_mib", "runs_ms",
          "plain_runs_ms", "tfpipe_file")


# -- in the child ---------------------------------------------------------------------


def _pipelined(num_devices, num_microbatches, schedule, recompute, execution, layers, width,
               balance=None):
    import keras  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    strategy = tfpipe.PipelineStrategy(
        devices=[f"/CPU:{i}" for i in range(num_devices)], num_microbatches=num_microbatches,
        schedule=schedule, recompute=recompute, execution=execution)
    with strategy.scope():
        model = tfpipe.PipelinedModel(
            [keras.Sequential(common.mlp_layers(n, width))
             for n in balance or [layers // num_devices] * num_devices],
            input_shape=(None, width))
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    common.serialize_ops(model)
    return model


def _plain(layers, width):
    import keras  # pylint: disable=import-outside-toplevel
    model = keras.Sequential([keras.Input((width,))] + common.mlp_layers(layers, width))
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse", jit_compile=False)
    return model


def _transformers(num_devices, num_microbatches, schedule, recompute, execution, layers,
                  width, heads, seq_len, balance=None):
    """(plain transformer LM, the same weights cut into a pipeline)."""
    import keras  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    from models import transformer_lm  # pylint: disable=import-outside-toplevel

    def make():
        keras.utils.set_random_seed(0)
        return transformer_lm.transformer_lm(num_layers=layers, width=width, num_heads=heads,
                                             seq_len=seq_len)

    def compiled(model, **kwargs):
        model.compile(optimizer=keras.optimizers.Adam(1e-4), **kwargs,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    plain = compiled(make(), jit_compile=False)
    strategy = tfpipe.PipelineStrategy(
        devices=[f"/CPU:{i}" for i in range(num_devices)], num_microbatches=num_microbatches,
        schedule=schedule, recompute=recompute, execution=execution)
    with strategy.scope():
        source = make()
        model = compiled(tfpipe.PipelinedModel.from_model(
            source, balance=balance or transformer_lm.stage_balance(source, num_devices)))
    common.serialize_ops(model)
    return plain, model


def _timer(model, x, y, executor=None):
    """(first call's seconds, a function that times `steps` steps in ms each)."""
    import contextlib  # pylint: disable=import-outside-toplevel
    step = common.step_function(model)
    executor = executor or contextlib.nullcontext

    def call():
        with executor(), common.call_scope(model):
            return float(step(x, y)["loss"])

    start = time.perf_counter()
    call()
    first = time.perf_counter() - start

    def run(steps):
        start = time.perf_counter()
        for _ in range(steps):
            call()
        return 1000.0 * (time.perf_counter() - start) / steps
    return first, run


def measure(num_devices, num_microbatches, schedule, recompute="never", execution=None,
            layers=MODEL["layers"], width=MODEL["width"], batch=MODEL["batch"],
            warmup=TIMING["warmup"], repeats=TIMING["repeats"], steps=TIMING["steps"], seed=0,
            model="mlp", heads=TRANSFORMER["heads"], seq_len=TRANSFORMER["seq_len"],
            balance=None):
    """Times the pipelined model and plain Keras in this process (a child with
    `num_devices` logical CPUs); returns the row's measured fields. `balance`:
    units per stage (default: K equal stages, the transformer's blocks spread)."""
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(seed)
    schedule = None if schedule == "default" else schedule
    gen = tf.random.Generator.from_seed(seed)
    if model == "transformer":
        x = gen.uniform((batch, seq_len), 0, 256, tf.int32)
        y = gen.uniform((batch, seq_len), 0, 256, tf.int32)
        plain_model, pipelined_model = _transformers(
            num_devices, num_microbatches, schedule, recompute, execution, layers, width,
            heads, seq_len, balance)
    else:
        if balance is None and layers % num_devices:
            raise ValueError(f"{layers} layers do not cut into {num_devices} equal stages")
        x, y = gen.normal((batch, width)), gen.normal((batch, width))
        plain_model = _plain(layers, width)
        pipelined_model = None
    # One op at a time (private TF API): the one-device reference.
    plain_first, plain = _timer(plain_model, x, y,
                                lambda: context.function_executor_type(
                                    "SINGLE_THREADED_EXECUTOR"))
    model = pipelined_model or _pipelined(num_devices, num_microbatches, schedule, recompute,
                                          execution, layers, width, balance)
    trace_s, pipelined = _timer(model, x, y)
    for _ in range(warmup - 1):  # the first call was the first warm-up
        plain(1)
        pipelined(1)
    runs = common.alternate({"plain": lambda: plain(steps),
                             "tfpipe": lambda: pipelined(steps)}, repeats)
    plain_ms, step_ms = common.median(runs["plain"]), common.median(runs["tfpipe"])
    sim = tfpipe.schedules.simulate(model.schedule, num_microbatches, num_devices, 1.0, 2.0,
                                    recompute=model.recompute)
    return {"execution": model.execution, "schedule_used": model.schedule.name,
            "plain_ms": plain_ms, "step_ms": step_ms,
            "speedup": plain_ms / step_ms, "ideal": 3.0 * num_microbatches * num_devices
            / sim.makespan, "trace_s": trace_s, "plain_trace_s": plain_first,
            "trace_ratio": trace_s / plain_first, "recompute_used": model.recompute,
            "runs_ms": runs["tfpipe"], "plain_runs_ms": runs["plain"],
            "peak_rss_mib": common.peak_rss_mib()}


# -- in the parent ------------------------------------------------------------------------


def configs(devices, microbatches, schedules):
    """The (K, M, schedule) rows; K=1 runs the first schedule only."""
    return [(k, m, s) for k in devices for m in microbatches
            for s in (schedules if k > 1 else schedules[:1])]


def run(rows, trees=(("new", None),), log=print, timeout=1800, **kwargs):
    """`measure` in a fresh child per (row, tree), trees alternating; a list of
    dict rows (an "error" key where the child failed), with the first tree's
    step and trace time over each other tree's (`common.add_tree_ratios`)."""
    out = []
    for (k, m, schedule), (label, path) in common.interleave(rows, list(trees)):
        result = common.run_child(
            "benchmarks.speedup:measure",
            dict(num_devices=k, num_microbatches=m, schedule=schedule, **kwargs),
            intra_op=1, inter_op=k, devices=k, tree=path, timeout=timeout)
        row = {"tree": label, "num_devices": k, "num_microbatches": m, "schedule": schedule,
               "recompute": kwargs.get("recompute") or "default",
               "child_wall_s": result["child_wall_s"], **{f: result.get(f) for f in FIELDS}}
        if "error" in result:
            row.update(error=common.error_line(result), detail=result["error"],
                       stderr_tail=result.get("stderr_tail"))
        out.append(row)
        log(f"{label:>6} K={k} M={m:<3} {schedule:<6} "
            + (f"ERROR {row['error']}" if "error" in row else
               f"{row['execution']:<16} plain {row['plain_ms']:8.1f} ms  tfpipe "
               f"{row['step_ms']:8.1f} ms  speed-up {row['speedup']:.2f} (ideal "
               f"{row['ideal']:.2f})  trace {row['trace_s']:.2f} s"))
    return common.add_tree_ratios(
        out, lambda r: (r["num_devices"], r["num_microbatches"], r["schedule"]),
        ("step_ms", "trace_s"))


def table(rows):
    return common.tree_table(
        [("K", "num_devices", 0), ("M", "num_microbatches", 0), ("schedule", "schedule", 0),
         ("runs", "schedule_used", 0), ("execution", "execution", 0), ("recompute", "recompute_used", 0),
         ("plain ms", "plain_ms", 1), ("tfpipe ms", "step_ms", 1), ("speed-up", "speedup", 2),
         ("ideal (simulated)", "ideal", 2), ("trace s (first call)", "trace_s", 2),
         ("first call / plain's", "trace_ratio", 2)],
        rows, [("step ms", "step_ms"), ("trace s", "trace_s")])


def model_sizes(f):
    """The `--model` and its sizes, from flags `f` where given, else that
    model's defaults (`MODEL` or `TRANSFORMER`): `measure`'s model arguments."""
    sizes = TRANSFORMER if f.model == "transformer" else MODEL
    model = {key: (getattr(f, key) if f[key].present else default)
             for key, default in sizes.items()}
    model["model"] = f.model
    return model


def main(argv):
    from absl import flags  # pylint: disable=import-outside-toplevel
    f = flags.FLAGS
    info, start = common.begin(argv)
    trees = common.parse_trees(f.tree, f.label)
    model = model_sizes(f)
    timing = {"warmup": f.warmup, "repeats": f.repeats, "steps": f.steps}
    rows = run(configs([int(k) for k in f.devices], [int(m) for m in f.microbatches],
                       f.schedules), trees,
               recompute=None if f.recompute == "default" else f.recompute,
               execution=None if f.execution == "auto" else f.execution, **model, **timing)
    described = (f"{model['layers']} x Dense({model['width']}, relu), Adam, MSE, batch "
                 f"{model['batch']}" if f.model == "mlp" else
                 f"transformer LM, {model['layers']} blocks of width {model['width']}, "
                 f"{model['heads']} heads, {model['seq_len']} tokens, batch {model['batch']}, "
                 f"Adam")
    common.finish(f.out, info, start, rows, f"{described}, recompute={f.recompute}",
                  table(rows), model=model, timing=timing, recompute=f.recompute,
                  trees=dict(trees))


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_list("devices", ["1", "2"], "Pipeline devices K (K=1: the first schedule).")
    flags.DEFINE_list("microbatches", ["4", "8", "16"], "Micro-batch counts M.")
    flags.DEFINE_list("schedules", list(SCHEDULES), f"Schedules, of {', '.join(SCHEDULES)}.")
    flags.DEFINE_enum("recompute", "never", RECOMPUTE, "Recompute mode of every row.")
    flags.DEFINE_enum("execution", "auto", EXECUTIONS, "Execution of every row (auto: "
                      "tfpipe's choice).")
    flags.DEFINE_enum("model", "mlp", MODELS, "The model: mlp (Dense layers) or transformer "
                      "(the repo's LM); its sizes default to its own.")
    flags.DEFINE_integer("layers", MODEL["layers"], "Dense layers (a multiple of every K), or "
                         "transformer blocks (default 8).", lower_bound=1)
    flags.DEFINE_integer("width", MODEL["width"], "Dense width, or the transformer's (128).",
                         lower_bound=1)
    flags.DEFINE_integer("batch", MODEL["batch"], "Rows (sequences) per step (transformer: "
                         "32).", lower_bound=1)
    flags.DEFINE_integer("heads", TRANSFORMER["heads"], "Transformer attention heads.",
                         lower_bound=1)
    flags.DEFINE_integer("seq_len", TRANSFORMER["seq_len"], "Transformer tokens per sequence.",
                         lower_bound=1)
    flags.DEFINE_integer("warmup", TIMING["warmup"], "Untimed calls per model (the first "
                         "traces).", lower_bound=1)
    flags.DEFINE_integer("repeats", TIMING["repeats"], "Timed runs per model (the median "
                         "counts).", lower_bound=1)
    flags.DEFINE_integer("steps", TIMING["steps"], "Steps per timed run.", lower_bound=1)
    flags.DEFINE_string("out", str(common.RESULTS_DIR / "speedup.json"), "JSON output.")
    common.define_tree_flags()
    common.positive_ints("devices")
    common.positive_ints("microbatches")
    common.one_of("schedules", SCHEDULES)

    def layers_cut(values):
        if values["model"] == "transformer":
            return True  # from_model spreads the blocks
        bad = [k for k in values["devices"]
               if k.isdigit() and int(k) and values["layers"] % int(k)]
        if bad:
            raise flags.ValidationError(f"--layers={values['layers']} does not cut into "
                                        f"K={bad[0]} equal stages")
        return True
    flags.register_multi_flags_validator(["layers", "devices", "model"], layers_cut)


if __name__ == "__main__":
    from absl import app as _app
    _define_flags()
    _app.run(main)
