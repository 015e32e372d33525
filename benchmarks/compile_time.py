"""Trace and compile time against M for one XLA program, per execution:
`python -m benchmarks.compile_time`.

Issue 42 asks whether the loop execution (a `tf.while_loop` over clock ticks,
`tfpipe.loop`) earns its code where it should win: one XLA program whose
size does not grow with M, a TPU's situation. Each row is a fresh child with
one logical CPU device. The repo's transformer LM (`--layers` blocks of
`--width`, `--heads` heads, `--seq_len` tokens, `--batch` sequences) is one
stage on that device (tfpipe places one stage per device; K stages on one
device is a TPU replica's cores, which a CPU cannot stand in for), compiled
with `jit_compile=True`, so tfpipe compiles the whole step, M micro-batches
and their gradient accumulation, as one XLA program (`tfpipe.xla.stage_xla`). GPipe, recompute="always" for every execution (the
only mode the loop runs), so the rows do the same arithmetic:

  first call s   the first training step: trace, XLA compile, one step
  step ms        the median of `--repeats` later steps
  graph nodes    nodes of the traced step's graph, function bodies included
                 (what XLA is handed)
  plain first s  plain Keras' first call of the same model, jit_compile=True,
                 in the same child before tfpipe's (the process's one-off
                 costs fall there)

`--model=mlp`: `--layers` x Dense(`--width`, relu), MSE, `--batch` rows.

    python -m benchmarks.compile_time                          # ~10 min on 2 cores
    python -m benchmarks.compile_time --microbatches=2,8 --executions=unrolled,loop
"""

import time

from benchmarks import common

EXECUTIONS = ("unrolled", "stage_functions", "loop")
MODELS = ("transformer", "mlp")
TRANSFORMER = {"layers": 4, "width": 64, "batch": 32, "heads": 4, "seq_len": 32}
FIELDS = ("first_call_s", "step_ms", "graph_nodes", "plain_first_s", "plain_ms")


def _graph_nodes(concrete):
    """Nodes of a concrete function's graph and of every function it calls."""
    graph_def = concrete.graph.as_graph_def()
    return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


def measure(execution, num_microbatches, layers, width, batch, heads, seq_len,
            model="transformer", repeats=5, seed=0):
    """One row in this child (one logical CPU): plain Keras' first call, then
    the pipelined model's, both under jit_compile=True."""
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    from models import transformer_lm  # pylint: disable=import-outside-toplevel

    kind = model

    def make():
        keras.utils.set_random_seed(seed)
        if kind == "mlp":
            return keras.Sequential([keras.Input((width,))] + common.mlp_layers(layers, width))
        return transformer_lm.transformer_lm(num_layers=layers, width=width, num_heads=heads,
                                             seq_len=seq_len)

    def compiled(made):
        made.compile(optimizer=keras.optimizers.Adam(1e-4), jit_compile=True,
                     loss="mse" if kind == "mlp" else
                     keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return made

    gen = tf.random.Generator.from_seed(seed)
    if kind == "mlp":
        x, y = gen.normal((batch, width)), gen.normal((batch, width))
    else:
        x = gen.uniform((batch, seq_len), 0, 256, tf.int32)
        y = gen.uniform((batch, seq_len), 0, 256, tf.int32)

    def timed(made):
        step = tf.function(lambda a, b: made.train_step((a, b)), autograph=False,
                           jit_compile=True)
        start = time.perf_counter()
        with common.call_scope(made):
            float(step(x, y)["loss"])
        first = time.perf_counter() - start
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            with common.call_scope(made):
                float(step(x, y)["loss"])
            times.append(1000.0 * (time.perf_counter() - start))
        return step, first, common.median(times)

    _, plain_first, plain_ms = timed(compiled(make()))
    strategy = tfpipe.PipelineStrategy(devices=["/CPU:0"], schedule="gpipe",
                                       num_microbatches=num_microbatches, recompute="always",
                                       execution=execution)
    with strategy.scope():
        source = make()
        pipelined = compiled(tfpipe.PipelinedModel.from_model(source,
                                                              balance=[len(source.layers)]))
    step, first, step_ms = timed(pipelined)
    with common.call_scope(pipelined):
        nodes = _graph_nodes(step.get_concrete_function(x, y))
    return {"first_call_s": first, "step_ms": step_ms, "graph_nodes": nodes,
            "plain_first_s": plain_first, "plain_ms": plain_ms,
            "execution_used": pipelined.execution}


def run(executions, microbatches, log=print, timeout=1800, **kwargs):
    """`measure` in a fresh one-device child per (execution, M); dict rows."""
    rows = []
    for m in microbatches:
        for execution in executions:
            result = common.run_child("benchmarks.compile_time:measure",
                                      dict(kwargs, execution=execution, num_microbatches=m),
                                      devices=1, timeout=timeout)
            row = {"execution": execution, "num_microbatches": m,
                   **{f: result.get(f) for f in FIELDS}}
            if "error" in result:
                row.update(error=common.error_line(result), detail=result["error"])
            else:
                row["first_ratio"] = row["first_call_s"] / row["plain_first_s"]
            rows.append(row)
            log(f"M={m:<3} {execution:<16} " + (
                f"ERROR {row['error']}" if "error" in row else
                f"first call {row['first_call_s']:7.2f} s ({row['first_ratio']:.2f} plain's)  "
                f"step {row['step_ms']:8.1f} ms  nodes {row['graph_nodes']}"))
    return rows


def table(rows):
    return common.markdown_table(
        [("M", "num_microbatches", 0), ("execution", "execution", 0),
         ("first call s", "first_call_s", 2), ("/ plain's", "first_ratio", 2),
         ("step ms", "step_ms", 1), ("graph nodes", "graph_nodes", 0),
         ("plain first s", "plain_first_s", 2), ("plain ms", "plain_ms", 1)], rows)


def main(argv):
    from absl import flags  # pylint: disable=import-outside-toplevel
    f = flags.FLAGS
    info, start = common.begin(argv)
    model = {key: getattr(f, key) for key in TRANSFORMER}
    model["model"] = f.model
    rows = run(f.executions, [int(m) for m in f.microbatches], repeats=f.repeats, **model)
    described = (f"{f.layers} x Dense({f.width}, relu), MSE, batch {f.batch}" if f.model == "mlp"
                 else f"transformer LM, {f.layers} blocks of width {f.width}, {f.heads} heads, "
                 f"{f.seq_len} tokens, batch {f.batch}")
    common.finish(f.out, info, start, rows, f"{described}, Adam, one stage on one CPU, "
                  f"jit_compile=True, GPipe, recompute=always", table(rows), model=model)


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_enum("model", "transformer", MODELS, "The repo's transformer LM, or "
                      "--layers x Dense(--width) (the other flags: its sizes).")
    flags.DEFINE_list("executions", list(EXECUTIONS), f"Of {', '.join(EXECUTIONS)}.")
    flags.DEFINE_list("microbatches", ["2", "4", "8", "16", "32"], "Micro-batch counts M.")
    for key, default in TRANSFORMER.items():
        flags.DEFINE_integer(key, default, f"Transformer {key}.", lower_bound=1)
    flags.DEFINE_integer("repeats", 5, "Timed steps after the first (the median counts).",
                         lower_bound=1)
    flags.DEFINE_string("out", str(common.RESULTS_DIR / "compile_time.json"), "JSON output.")
    common.positive_ints("microbatches")
    common.one_of("executions", EXECUTIONS)


if __name__ == "__main__":
    from absl import app as _app
    _define_flags()
    _app.run(main)
