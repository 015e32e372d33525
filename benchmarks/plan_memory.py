"""The planner's memory prediction against measured peaks: `python -m benchmarks.plan_memory`.

For each configuration (recompute mode, M, K), `tfpipe.plan` predicts the
memory of the memory benchmark's model (`benchmarks.memory`: 64 -> L x
Dense(width, relu) -> Dense(16), Adam, one batch), here in this process,
and a fresh child process measures it (`benchmarks.memory.run_memory`: one
intra-op and one inter-op thread, every tensor its own mapping, so the
resident set follows live memory). What is compared:

  measured  = (built_mib - runtime_mib) + run_mib, all from the child:
              the resident set that building the model, its optimizer state
              and the batch add to a started TensorFlow, plus the peak of a
              later training step above the resident set just before it.
              Left out: the traced program and first-call graph
              optimisation (the child's trace_mib), which the planner does
              not predict.
  predicted = plan.host_peak_bytes (parameters, optimizer state and
              gradients of every stage, and the largest sum of live
              activations over the simulated step: all K devices live in
              the child's one process) + the batch (x, y).

    python -m benchmarks.plan_memory                      # ~2-3 min on 2 cores
    python -m benchmarks.plan_memory --layers=8 --width=512 --batch=4096
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads

from benchmarks import common  # noqa: E402
from benchmarks import memory  # noqa: E402

MODEL = {"layers": 8, "width": 512, "batch": 4096}
# (recompute, M, K): every recompute mode, M from 1 to 16, one and two devices.
CONFIGS = (("never", 1, 1), ("never", 4, 1), ("except_last", 4, 1), ("always", 4, 1),
           ("always", 16, 1), ("never", 4, 2), ("always", 4, 2))
TOLERANCE = 0.25


def plain_model(layers, width):
    """The benchmark's model as one plain Keras model (`benchmarks.memory`)."""
    import keras  # pylint: disable=import-outside-toplevel
    return keras.Sequential([keras.Input((memory.IN_WIDTH,))]
                            + common.mlp_layers(layers, width)
                            + [keras.layers.Dense(memory.OUT_WIDTH)])


def predict(layers, width, batch, recompute, num_microbatches, num_devices):
    """`tfpipe.plan` for the child's configuration (equal stages, the head on
    the last), here; needs `num_devices` logical devices in this process."""
    import tfpipe  # pylint: disable=import-outside-toplevel
    per = layers // num_devices
    balance = [per] * num_devices
    balance[-1] += 1
    model = plain_model(layers, width)
    return tfpipe.plan(model, batch, num_microbatches, balance=balance, schedule="gpipe",
                       recompute=recompute, optimizer="adam",
                       devices=[f"/CPU:{i}" for i in range(num_devices)],
                       measure_time=False, recommend=False)


def measure(layers, width, batch, configs=CONFIGS, parallel=1):
    """The child's `benchmarks.memory.measure_memory` result per configuration."""
    from concurrent import futures  # pylint: disable=import-outside-toplevel
    kwargs = [dict(layers=layers, width=width, batch=batch, recompute=r,
                   num_microbatches=m, num_devices=k, steps=2) for r, m, k in configs]
    with futures.ThreadPoolExecutor(max(1, parallel)) as pool:
        return list(pool.map(lambda kw: memory.run_memory(**kw), kwargs))


def compare(layers, width, batch, configs=CONFIGS, parallel=1, log=print, results=None):
    """Rows of predicted vs measured MiB, one per (recompute, M, K); `results`:
    the children's results if already measured (`measure`)."""
    if results is None:
        results = measure(layers, width, batch, configs, parallel)
    batch_mib = batch * (memory.IN_WIDTH + memory.OUT_WIDTH) * 4 / memory.MIB
    rows = []
    for (recompute, m, k), result in zip(configs, results):
        plan = predict(layers, width, batch, recompute, m, k)
        row = {"recompute": recompute, "num_microbatches": m, "num_devices": k,
               "params": plan.params, "child_params": result.get("params"),
               "predicted_static_mib": sum(s.param_bytes + s.optimizer_bytes
                                           for s in plan.stages) / memory.MIB + batch_mib,
               "predicted_mib": plan.host_peak_bytes / memory.MIB + batch_mib,
               "error": result.get("error"), "child": result}
        if "error" not in result:
            row["static_mib"] = result["built_mib"] - result["runtime_mib"]
            row["run_mib"] = result["run_mib"]
            row["trace_mib"] = result["trace_mib"]
            row["measured_mib"] = row["static_mib"] + result["run_mib"]
            row["ratio"] = row["predicted_mib"] / row["measured_mib"]
        rows.append(row)
        log(_line(row))
    return rows


def _line(row):
    if row.get("error"):
        return f"recompute={row['recompute']} M={row['num_microbatches']} ERROR {row['error']}"
    return (f"recompute={row['recompute']:<12} M={row['num_microbatches']:<3} "
            f"K={row['num_devices']}  predicted {row['predicted_mib']:7.1f} MiB  measured "
            f"{row['measured_mib']:7.1f} MiB (static {row['static_mib']:.1f} + step "
            f"{row['run_mib']:.1f})  predicted/measured {row['ratio']:.2f}")


def table(rows):
    body = [[r["recompute"], str(r["num_microbatches"]), str(r["num_devices"]),
             common.fmt(r["predicted_mib"], 1), common.fmt(r.get("measured_mib"), 1),
             common.fmt(r.get("static_mib"), 1), common.fmt(r.get("run_mib"), 1),
             common.fmt(r.get("trace_mib"), 1), common.fmt(r.get("ratio"))]
            for r in rows]
    return common.markdown_table(
        ["recompute", "M", "K", "predicted MiB", "measured MiB", "of which build",
         "of which step", "trace MiB (not predicted)", "predicted / measured"], body)


def main(argv):
    from absl import flags  # pylint: disable=import-outside-toplevel
    del argv
    f = flags.FLAGS
    import tfpipe  # pylint: disable=import-outside-toplevel
    tfpipe.testing.use_logical_cpus(max(k for _, _, k in CONFIGS))
    start = time.perf_counter()
    info = common.machine()
    print(f"machine: {common.machine_label(info)}")
    rows = compare(f.layers, f.width, f.batch, parallel=f.parallel)
    print(table(rows))
    out = common.write_json(f.out, {"machine": info, "model": MODEL | {
        "layers": f.layers, "width": f.width, "batch": f.batch}, "rows": rows,
        "wall_s": time.perf_counter() - start})
    print(f"wrote {out}")


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_integer("layers", MODEL["layers"], "Hidden Dense layers.")
    flags.DEFINE_integer("width", MODEL["width"], "Hidden width.")
    flags.DEFINE_integer("batch", MODEL["batch"], "Rows per step.")
    flags.DEFINE_integer("parallel", 2, "Children run at once.")
    flags.DEFINE_string("out", str(common.RESULTS_DIR / "plan_memory.json"), "JSON output.")


if __name__ == "__main__":
    from absl import app as _app
    _define_flags()
    _app.run(main)
