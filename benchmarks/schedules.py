"""Pipeline speed-up per schedule, and trace time vs M: `python -m benchmarks.schedules`.

Speed-up. The model is a deep MLP of `--layers` equal Dense(`--width`, relu)
layers, trained with Adam and MSE on one fixed random batch of `--batch` rows.
It is cut into equal stages: K stages for "gpipe" and "1f1b", 2K for
"interleaved" (v=2, only where M % K == 0). Every configuration (K, M,
schedule) runs in a fresh child process with K logical CPU devices, one
intra-op thread and K inter-op threads (set before TensorFlow initialises): each
op is single-threaded, and the pipeline's `serialize_ops` chains every op of a
device in trace order (the engine's control dependencies already order its
actions), so each device is one stream, as on an accelerator, while the K
inter-op threads let different devices' streams run at once. (Without the
chaining a logical CPU also overlaps independent ops inside one action, a
layer's dW and dx, which made K=2, M=1 look 1.4x faster than one device.)

In the same child, alternating with the pipelined model, the plain Keras
model (same layers, same batch, `jit_compile=False`) runs on one device under
TensorFlow's single-threaded function executor: one op at a time, the
one-device reference. The speed-up is plain step time / pipelined step time,
both measured in that child (so machine drift cancels). Also recorded, for
transparency, is the plain model under the default executor with K inter-op
threads ("plain_threaded"): a one-device model can overlap independent ops
(e.g. a layer's dW and dx matmuls) when it has spare threads.

Step time: a tf.function around `model.train_step`; two warm-up calls (the
first traces, not timed), then `--repeats` runs of `--steps` steps per model,
the order rotating each repeat; a run's time is its mean step, the reported
time the median run. `cpu_per_wall` (process CPU seconds / wall seconds
during the timed runs) shows how many cores were busy.

Ideals, printed beside the measurement: K*M/(M+K-1) (GPipe, equal stages,
no communication cost) and the schedule's own ideal from
`tfpipe.schedules.simulate` (serial work / simulated makespan, backward =
2x forward; a micro-batch the recompute mode replays pays its forward again).
On a machine with fewer cores than K devices no schedule can beat the core
count, so `ratio_to_bound` also divides by min(ideal, usable cores).

Recompute modes. `--recompute` takes a list (a row per mode).
`--compare_recompute` times the same pipeline under other modes in each row's
child, alternating with it; `recompute_cost` gives their throughput over the
row's, measured (paired per repeat, so drift between children cannot enter)
and simulated.

Trace time. For M in `--trace_microbatches` and each of `--trace_executions`
("unrolled", "stage_functions", "loop"; all recompute="always"), a fresh child
traces a throwaway model first (so the process's one-off first-trace costs, ~3 s,
are not counted), then times `get_concrete_function` of the train step without
AutoGraph, as Keras' fit traces it, three times, each a fresh `tf.function` of the
same model (trace_s: Python tracing, the median; trace_runs_s: all three; one
trace swings by a garbage collection or two), counts the graph's
ops (top-level, and including nested function bodies: the loop's while body and
switch branches),
then times the first call (first_call_s: graph optimisation, partitioning
and one step) and a few steady steps. The model is small (width 64) so the
trace, not the arithmetic, dominates.

Results go to `--out` (JSON: every child's raw numbers and the machine) and a
PNG next to it. Absolute times are labelled with the machine (CPU model,
core count, versions).

    python -m benchmarks.schedules                       # full grid, ~12 min on 2 cores
    python -m benchmarks.schedules --devices=2 --microbatches=1,8 --repeats=1 --steps=1
    python -m benchmarks.schedules --explain=benchmarks/results/zero_bubble_amd.json
    python -m benchmarks.schedules --devices=2 --microbatches=4,8 --schedules=gpipe,1f1b \
        --executions=stage_functions --recompute=except_last --compare_recompute=always \
        --trace_microbatches=

`--explain` runs nothing: for a stored file's --timeline rows it prints where
measured/ideal goes (`ratio_factors`: the bubble against the simulated one, and the
rest: the micro-batch actions' time against the plain step, the recorded step
against the timed one).
"""

import json
import os
import pathlib
import resource
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads

from benchmarks import common

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv")
TWO_STAGES_PER_DEVICE = ("interleaved", "zbv")
VIRTUAL_STAGES = 2
GOAL = 0.9  # measured / ideal at K=2, M>=8

# Defaults: 8 layers of 512 cut evenly for 1, 2, 4 devices and 8 interleaved
# stages; 2048 rows keep the smallest micro-batch (M=16: 128 rows) efficient.
DEFAULT_MODEL = {"batch": 2048, "width": 512, "layers": 8}
TRACE_MODEL = {"batch": 64, "width": 64, "layers": 8}


# -- ideals (pure Python) -----------------------------------------------------------


def ideal_speedup(num_devices, num_microbatches):
    """GPipe's ideal with equal stages: K*M / (M + K - 1)."""
    return num_devices * num_microbatches / (num_microbatches + num_devices - 1)


def simulated_speedup(schedule, num_devices, num_microbatches, recompute="never"):
    """Serial work / makespan from `tfpipe.schedules.simulate`.

    Work is counted as for the plain model (forward 1, backward 2 per
    device-share and micro-batch); a micro-batch that `recompute` replays
    pays its forward again in the simulation, so recompute lowers this ideal
    to what the pipeline can reach against a model that does not recompute.
    """
    schedules = common.schedules_module()
    sim = schedules.simulate(_schedule(schedule), num_microbatches, num_devices, 1.0, 2.0,
                             recompute=recompute)
    return num_microbatches * num_devices * 3.0 / sim.makespan


def _schedule(name):
    schedules = common.schedules_module()
    return schedules.Interleaved(VIRTUAL_STAGES) if name == "interleaved" else name


def num_stages(schedule, num_devices):
    return num_devices * (VIRTUAL_STAGES if schedule in TWO_STAGES_PER_DEVICE else 1)


def valid(schedule, num_devices, num_microbatches, layers):
    """Whether (schedule, K, M) can run this model (interleaved needs M % K == 0)."""
    if schedule == "interleaved" and (num_devices < 2 or num_microbatches % num_devices):
        return False
    return layers % num_stages(schedule, num_devices) == 0


# -- one child: build, trace, time ---------------------------------------------------


def _build_pipelined(num_devices, num_microbatches, schedule, recompute, execution, layers,
                     width, serialize_ops=False):
    import keras  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    stages = num_stages(schedule, num_devices)
    if layers % stages:
        raise ValueError(f"{layers} layers do not cut into {stages} equal stages.")
    strategy = tfpipe.PipelineStrategy(
        devices=[f"/CPU:{i}" for i in range(num_devices)], num_microbatches=num_microbatches,
        schedule=_schedule(schedule), recompute=recompute, execution=execution)
    with strategy.scope():
        model = tfpipe.PipelinedModel(
            [keras.Sequential(common.mlp_layers(layers // stages, width), name=f"stage_{k}")
             for k in range(stages)],
            input_shape=(None, width))
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    # One op at a time per device, in trace order: an accelerator stream.
    model.set_trace_options(serialize_ops=serialize_ops)
    return model


def _build_plain(layers, width):
    import keras  # pylint: disable=import-outside-toplevel
    model = keras.Sequential([keras.Input((width,))] + common.mlp_layers(layers, width))
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse", jit_compile=False)
    model.optimizer.build(model.trainable_variables)
    return model


def _single_threaded():
    """Context: tf.functions called inside run one op at a time (private TF API)."""
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
    return context.function_executor_type("SINGLE_THREADED_EXECUTOR")


class _Timed:
    """A model's traced train step, timed by `run`."""

    def __init__(self, model, x, y, executor=None, trace_repeats=1):
        import contextlib  # pylint: disable=import-outside-toplevel
        import functools  # pylint: disable=import-outside-toplevel
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        import tfpipe  # pylint: disable=import-outside-toplevel
        self._executor = executor or contextlib.nullcontext
        # As Keras' fit traces and calls it: without AutoGraph (it would
        # convert tfpipe's own Python, which fit never does, and inflate the
        # trace time), in the execution's call scope.
        self._scope = (functools.partial(tfpipe.stage.call_scope, model.pipeline_config.traits)
                       if isinstance(model, tfpipe.PipelinedModel) else contextlib.nullcontext)
        # Each trace is a fresh tf.function of the same model: `trace_s` is
        # their median (one trace swings by a garbage collection or two).
        self.trace_runs_s = []
        for _ in range(trace_repeats):
            fn = tf.function(lambda a, b: model.train_step((a, b)), autograph=False)
            start = time.perf_counter()
            with self._scope():
                self.concrete = fn.get_concrete_function(tf.TensorSpec(x.shape, x.dtype),
                                                         tf.TensorSpec(y.shape, y.dtype))
            self.trace_runs_s.append(time.perf_counter() - start)
        self.trace_s = statistics.median(self.trace_runs_s)
        self.ops, self.ops_total = common.count_ops(self.concrete)
        self._args = (x, y)
        self.runs_ms, self.cpu_per_wall = [], []
        start = time.perf_counter()
        self._call()
        self.first_call_s = time.perf_counter() - start

    def _call(self):
        with self._executor(), self._scope():
            out = self.concrete(*self._args)
        return float(out["loss"])

    def run(self, steps):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        for _ in range(steps):
            loss = self._call()
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
        self.runs_ms.append(1000.0 * wall / steps)
        self.cpu_per_wall.append(cpu / wall)
        return loss

    def summary(self):
        return {
            "step_ms": statistics.median(self.runs_ms) if self.runs_ms else None,
            "runs_ms": self.runs_ms,
            "cpu_per_wall": statistics.median(self.cpu_per_wall) if self.cpu_per_wall else None,
            "trace_s": self.trace_s, "trace_runs_s": self.trace_runs_s,
            "first_call_s": self.first_call_s, "ops": self.ops, "ops_total": self.ops_total,
        }


def measure_step(num_devices, num_microbatches, schedule="gpipe", recompute="never",
                 execution="unrolled", batch=DEFAULT_MODEL["batch"],
                 width=DEFAULT_MODEL["width"], layers=DEFAULT_MODEL["layers"], warmup=2,
                 repeats=5, steps=3, baselines=("plain", "plain_threaded"), seed=0,
                 serialize_ops=True, trace_repeats=1, timeline=False, compare_recompute=()):
    """Times one pipelined configuration and the plain baselines; runs in a child.

    The calling process must have >= `num_devices` logical CPUs and its
    threads set (see `run_config`). Returns a JSON-ready dict: per model
    ("tfpipe" and each of `baselines`) step_ms (median run), runs_ms,
    cpu_per_wall, trace_s (median of `trace_repeats` traces), trace_runs_s,
    first_call_s, ops, ops_total; and "speedup"
    (baseline step / tfpipe step) per baseline. With repeats=0 only the trace
    and first call are measured. With `timeline`, "timeline" holds one
    recorded step's costs (`recorded_costs`). Each mode of
    `compare_recompute` adds the same pipeline under that recompute mode
    ("tfpipe[<mode>]"), timed in the same rotation, and "recompute_pairs":
    {mode: the median over repeats of tfpipe's run time over its run time in
    the same repeat} (above 1: that mode is faster).
    """
    import keras  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(seed)
    x, y = common.random_batch(batch, width, seed)
    pipelined = _build_pipelined(num_devices, num_microbatches, schedule, recompute, execution,
                                 layers, width, serialize_ops)
    models = {"tfpipe": _Timed(pipelined, x, y, trace_repeats=trace_repeats)}
    for mode in compare_recompute:
        models[f"tfpipe[{mode}]"] = _Timed(_build_pipelined(
            num_devices, num_microbatches, schedule, mode, execution, layers, width,
            serialize_ops), x, y)
    if "plain" in baselines:
        models["plain"] = _Timed(_build_plain(layers, width), x, y, _single_threaded)
    if "plain_threaded" in baselines:
        models["plain_threaded"] = _Timed(_build_plain(layers, width), x, y)
    losses = {}
    for name, timed in models.items():
        for _ in range(max(0, warmup - 1)):  # the first call was the first warm-up
            timed.run(1)
        timed.runs_ms.clear()
        timed.cpu_per_wall.clear()
    names = list(models)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            losses[name] = models[name].run(steps)
    result = {name: timed.summary() for name, timed in models.items()}
    result["speedup"] = {
        name: (result[name]["step_ms"] / result["tfpipe"]["step_ms"]
               if repeats and result["tfpipe"]["step_ms"] else None)
        for name in models if not name.startswith("tfpipe")
    }
    result["recompute_pairs"] = {
        mode: statistics.median(a / b for a, b in zip(models["tfpipe"].runs_ms,
                                                      models[f"tfpipe[{mode}]"].runs_ms))
        for mode in compare_recompute if repeats}
    result["config"] = {
        "num_devices": num_devices, "num_microbatches": num_microbatches,
        "schedule": schedule, "recompute": recompute, "execution": execution,
        "batch": batch, "width": width, "layers": layers,
        "stages": num_stages(schedule, num_devices), "warmup": warmup, "repeats": repeats,
        "steps": steps, "optimizer": "Adam(1e-4)", "loss": "mse",
        "serialize_ops": serialize_ops, "compare_recompute": list(compare_recompute),
    }
    result["last_loss"] = losses.get("tfpipe")
    if timeline:
        result["timeline"] = recorded_costs(pipelined, x, y)
    result["peak_rss_mib"] = common.peak_rss_mib()
    return result


def recorded_costs(model, x, y):
    """One step of `model` recorded (`tfpipe.profile.record_step`: forward and
    backward, no update) and the schedule simulated on its measured costs.

    Returns a dict: "mean_ms" per action kind (over all stages), "stage_ms"
    (per stage: "forward", "backward" (B, or I + W) and "weight" (W) means,
    the costs `simulate` takes), "span_ms" (the recorded step's forward and
    backward), "predicted_span_ms" (the schedule simulated on "stage_ms"; no
    transfers or contention), and the timeline's measured and predicted
    bubbles.
    """
    import tfpipe  # pylint: disable=import-outside-toplevel
    timeline = tfpipe.profile.record_step(model, x, y)
    forward, backward, weight = tfpipe.profile.stage_costs(timeline.events, len(model.stages))
    predicted = tfpipe.schedules.simulate(model.schedule, model.num_microbatches,
                                          len(model.pipeline_devices), forward, backward,
                                          weight_cost=weight)
    kinds = sorted({e.kind for e in timeline.events})
    return {
        "mean_ms": {kind: statistics.mean(e.end_ms - e.start_ms for e in timeline.events
                                          if e.kind == kind) for kind in kinds},
        "stage_ms": {"forward": forward, "backward": backward, "weight": weight},
        "span_ms": max(e.end_ms for e in timeline.events),
        "predicted_span_ms": predicted.makespan,
        "measured_bubble": timeline.measured_bubble,
        "predicted_bubble": timeline.predicted_bubble,
    }


def run_config(num_devices, num_microbatches, schedule="gpipe", timeout=1800, **kwargs):
    """`measure_step` in a fresh child (K devices, 1 intra-op, K inter-op threads),
    plus the ideals; returns one result row."""
    result = common.run_child(
        "benchmarks.schedules:measure_step",
        dict(num_devices=num_devices, num_microbatches=num_microbatches, schedule=schedule,
             **kwargs),
        intra_op=1, inter_op=max(1, num_devices), devices=max(1, num_devices),
        timeout=timeout)
    recompute = kwargs.get("recompute", "never")
    row = {"num_devices": num_devices, "num_microbatches": num_microbatches,
           "schedule": schedule, "execution": kwargs.get("execution", "unrolled"),
           "recompute": recompute, "ideal": ideal_speedup(num_devices, num_microbatches),
           "ideal_sim": simulated_speedup(schedule, num_devices, num_microbatches, recompute),
           "cores": common.usable_cores()}
    row["bound"] = min(row["ideal_sim"], row["cores"])
    speedup = (result.get("speedup") or {}).get("plain")
    row["speedup"] = speedup
    row["ratio_to_ideal"] = speedup / row["ideal_sim"] if speedup else None
    row["ratio_to_bound"] = speedup / row["bound"] if speedup else None
    row["speedup_vs_threaded"] = (result.get("speedup") or {}).get("plain_threaded")
    row["result"] = result
    row["ratio_factors"] = ratio_factors(row)
    return row


def ratio_factors(row):
    """A --timeline row's measured/ideal (`ratio_to_ideal`) as busy * rest,
    rest = work * span; None without a recorded step.

    - "busy": the recorded step's busy share (its actions' time per device,
      below, over its span) over the schedule's simulated one (ideal_sim / K):
      its bubble against the bubble it would have at the ideal costs. A ratio
      within one step, so a uniformly slow recorded step does not move it.
    - "rest": everything else, measured/ideal / busy.
    - "work": the plain step over the recorded actions' time per device (every
      stage's F + B per micro-batch, times M, over K devices). Below 1 when M
      micro-batch actions cost more in sum than one plain step (smaller
      matmuls); no schedule wins that back.
    - "span": the recorded span (forward and backward) over the timed step
      (which adds the update). One recorded step against the median of runs:
      when it ran slow, "span" is high and "work" low by the same factor, so
      read "work" only where "span" is near 1.
    """
    recorded = row.get("result", {}).get("timeline")
    if not recorded or not row.get("ratio_to_ideal"):
        return None
    k, m = row["num_devices"], row["num_microbatches"]
    stage_ms = recorded["stage_ms"]
    work_per_device = m * (sum(stage_ms["forward"]) + sum(stage_ms["backward"])) / k
    plain_ms = row["result"]["plain"]["step_ms"]
    step_ms = row["result"]["tfpipe"]["step_ms"]
    work = plain_ms / (k * work_per_device)
    span = recorded["span_ms"] / step_ms
    return {"busy": (work_per_device / recorded["span_ms"]) / (row["ideal_sim"] / k),
            "rest": work * span, "work": work, "span": span}


def explain(path):
    """The `ratio_factors` of a results file's --timeline rows, as text."""
    rows = json.loads(pathlib.Path(path).read_text())["speedup"]
    names = ("busy", "rest", "work", "span")
    lines = [f"{'K':>2} {'M':>3} {'schedule':<12} {'measured/ideal':>14} "
             + " ".join(f"{n:>6}" for n in names)]
    for row in rows:
        factors = ratio_factors(row)
        if factors:
            lines.append(f"{row['num_devices']:>2} {row['num_microbatches']:>3} "
                         f"{row['schedule']:<12} {row['ratio_to_ideal']:>14.3f} "
                         + " ".join(f"{factors[n]:>6.3f}" for n in names))
    return "\n".join(lines)


def grid_configs(devices, microbatches, schedules=SCHEDULES, executions=("unrolled",),
                 recomputes=("never",), layers=DEFAULT_MODEL["layers"]):
    """The (K, M, schedule, execution, recompute) runs of a speed-up grid:
    every valid combination, in order. The loop form runs only
    recompute="always" (it keeps only stage inputs), so its other modes are
    left out."""
    return [(k, m, schedule, execution, recompute)
            for k in devices for schedule in schedules for m in microbatches
            if valid(schedule, k, m, layers) and (k > 1 or schedule == "gpipe")
            for execution in executions for recompute in recomputes
            if execution != "loop" or recompute == "always"]


def speedup_grid(devices, microbatches, schedules=SCHEDULES, log=print,
                 executions=("unrolled",), recomputes=("never",), **kwargs):
    """`run_config` for every run of `grid_configs`; a list of rows. The
    loop form runs only "always", so its rows compare no other mode
    (`compare_recompute` in kwargs)."""
    if "loop" in executions and set(recomputes) - {"always"}:
        log(f"loop: runs only recompute='always'; skipping "
            f"{sorted(set(recomputes) - {'always'})} for it")
    rows = []
    for k, m, schedule, execution, recompute in grid_configs(
            devices, microbatches, schedules, executions, recomputes,
            kwargs.get("layers", DEFAULT_MODEL["layers"])):
        extra = dict(kwargs, **({"compare_recompute": ()} if execution == "loop" else {}))
        row = run_config(k, m, schedule, execution=execution, recompute=recompute, **extra)
        rows.append(row)
        log(_speedup_line(row))
    return rows


def measure_trace(num_devices, num_microbatches, execution, schedule="gpipe",
                  batch=TRACE_MODEL["batch"], width=TRACE_MODEL["width"],
                  layers=TRACE_MODEL["layers"], steps=3, trace_repeats=3):
    """Trace time (median of `trace_repeats` traces), op counts and first-call
    time of one configuration; in a child.

    A throwaway model of the same kind (smallest M, one layer per stage) is
    traced first, so that one-off costs of the process's first trace (AutoGraph,
    Keras and TensorFlow lazy set-up, about 3 s) are not counted.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    warm_m = num_devices if schedule == "interleaved" else 1
    warm = _build_pipelined(num_devices, warm_m, schedule, "always", execution,
                            num_stages(schedule, num_devices), 4)
    x, y = common.random_batch(2 * warm_m, 4)
    tf.function(lambda a, b: warm.train_step((a, b)),
                autograph=False).get_concrete_function(x, y)
    result = measure_step(num_devices, num_microbatches, schedule=schedule,
                          recompute="always", execution=execution, batch=batch, width=width,
                          layers=layers, warmup=1, repeats=1, steps=steps, baselines=(),
                          serialize_ops=False, trace_repeats=trace_repeats)
    out = dict(result["tfpipe"])
    out["compile_s"] = out["first_call_s"] - out["step_ms"] / 1000.0
    out["config"] = result["config"]
    out["peak_rss_mib"] = result["peak_rss_mib"]
    return out


def trace_grid(devices, microbatches, executions=("unrolled", "loop"), log=print,
               timeout=1800, **kwargs):
    """`measure_trace` in a fresh child per (K, execution, M); a list of rows."""
    rows = []
    for k in devices:
        for execution in executions:
            for m in microbatches:
                result = common.run_child(
                    "benchmarks.schedules:measure_trace",
                    dict(num_devices=k, num_microbatches=m, execution=execution, **kwargs),
                    intra_op=1, inter_op=max(1, k), devices=max(1, k), timeout=timeout)
                row = {"num_devices": k, "num_microbatches": m, "execution": execution,
                       "result": result}
                for key in ("trace_s", "first_call_s", "compile_s", "ops", "ops_total",
                            "step_ms"):
                    row[key] = result.get(key)
                rows.append(row)
                log(_trace_line(row))
    return rows


# -- printing and plotting --------------------------------------------------------


def _speedup_line(row):
    r = row["result"]
    if "error" in r:
        return (f"K={row['num_devices']} M={row['num_microbatches']:<3} "
                f"{row['schedule']:<11} ERROR {common.error_line(r)}")
    return (f"K={row['num_devices']} M={row['num_microbatches']:<3} {row['schedule']:<11} "
            f"{_key(row, 'execution')[0]:<8} {_key(row, 'recompute')[0]:<11} "
            f"plain {r['plain']['step_ms']:8.1f} ms  tfpipe {r['tfpipe']['step_ms']:8.1f} ms  "
            f"speed-up {row['speedup']:.2f} (ideal {row['ideal']:.2f}, sim {row['ideal_sim']:.2f})"
            f"  measured/ideal {row['ratio_to_ideal']:.2f}  cpu/wall "
            f"{r['tfpipe']['cpu_per_wall']:.2f}"
            + "".join(f"  {mode} {r[f'tfpipe[{mode}]']['step_ms']:.1f} ms (paired {pair:.3f})"
                      for mode, pair in r.get("recompute_pairs", {}).items()))


def _trace_line(row):
    if row["trace_s"] is None:
        return (f"K={row['num_devices']} M={row['num_microbatches']:<3} {row['execution']:<8} "
                f"ERROR {common.error_line(row['result'])}")
    return (f"K={row['num_devices']} M={row['num_microbatches']:<3} {row['execution']:<8} "
            f"trace {row['trace_s']:6.2f} s  first call {row['first_call_s']:6.2f} s  "
            f"ops {row['ops']:6d} (with function bodies {row['ops_total']:6d})")


def speedup_table(rows):
    headers = ["K", "M", "schedule", "execution", "recompute", "plain ms", "tfpipe ms",
               "speed-up", "ideal K*M/(M+K-1)", "ideal (simulated)", "measured / simulated ideal",
               "measured / min(simulated ideal, cores)",
               "cpu/wall", "vs plain (threaded)"]
    body = []
    for row in rows:
        r = row["result"]
        if "error" in r:
            body.append([str(row["num_devices"]), str(row["num_microbatches"]),
                         row["schedule"], *_key(row, "execution", "recompute"), "error", "-",
                         "-", row["ideal"], row["ideal_sim"], "-", "-", "-", "-"])
            continue
        body.append([str(row["num_devices"]), str(row["num_microbatches"]), row["schedule"],
                     *_key(row, "execution", "recompute"), common.fmt(r["plain"]["step_ms"], 1),
                     common.fmt(r["tfpipe"]["step_ms"], 1),
                     row["speedup"], row["ideal"], row["ideal_sim"], row["ratio_to_ideal"],
                     row["ratio_to_bound"], r["tfpipe"]["cpu_per_wall"],
                     row["speedup_vs_threaded"]])
    return common.markdown_table(headers, body)


def trace_table(rows):
    headers = ["K", "M", "execution", "trace s", "first call s", "ops", "ops incl. bodies"]
    return common.markdown_table(headers, [
        [str(r["num_devices"]), str(r["num_microbatches"]), r["execution"], r["trace_s"],
         r["first_call_s"], r["ops"], r["ops_total"]] for r in rows])


def trace_pivot_table(rows):
    """One row per (K, execution), one column per M: "trace s / first call s / ops"."""
    ms = sorted({r["num_microbatches"] for r in rows})
    keys = sorted({(r["num_devices"], r["execution"]) for r in rows},
                  key=lambda key: (key[0], key[1] != "unrolled"))
    cell = {(r["num_devices"], r["execution"], r["num_microbatches"]): r for r in rows}
    body = []
    for k, execution in keys:
        line = [str(k), execution]
        for m in ms:
            r = cell.get((k, execution, m))
            line.append("-" if r is None or r["trace_s"] is None else
                        f"{r['trace_s']:.1f} / {r['first_call_s']:.2f} / {r['ops_total']}")
        body.append(line)
    return common.markdown_table(["K", "execution"] + [f"M={m}" for m in ms], body)


def plot(speedup_rows, trace_rows, path, title=""):
    """Speed-up vs M per K (one line per schedule, ideal curves dashed) and
    trace time / op count vs M, unrolled vs loop."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    ks = sorted({r["num_devices"] for r in speedup_rows})
    rows = (1 if ks else 0) + (1 if trace_rows else 0)
    cols = max(len(ks), 2 if trace_rows else 1, 1)
    fig, grid = plt.subplots(max(rows, 1), cols, figsize=(5 * cols, 4 * max(rows, 1)),
                             squeeze=False)
    for ax in grid.flat:
        ax.set_visible(False)
    axes = list(grid[0][:len(ks)]) + (list(grid[-1][:2]) if trace_rows else [])
    for ax in axes:
        ax.set_visible(True)
    for ax, k in zip(axes, ks):
        mine = [r for r in speedup_rows if r["num_devices"] == k]
        ms = sorted({r["num_microbatches"] for r in mine})
        ax.plot(ms, [ideal_speedup(k, m) for m in ms], "k--", label="ideal K*M/(M+K-1)")
        for schedule in SCHEDULES:
            pts = [(r["num_microbatches"], r["speedup"]) for r in mine
                   if r["schedule"] == schedule and r["speedup"]]
            if pts:
                ax.plot(*zip(*pts), "o-", label=f"{schedule} (measured)")
            sim = [(r["num_microbatches"], r["ideal_sim"]) for r in mine
                   if r["schedule"] == schedule == "interleaved"]
            if sim:
                ax.plot(*zip(*sim), ":", label="interleaved ideal (simulated)")
        ax.axhline(common.usable_cores(), color="grey", lw=0.8, label="usable cores")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches M")
        ax.set_ylabel("speed-up over one device")
        ax.set_title(f"K={k}")
        ax.legend(fontsize=7)
    if trace_rows:
        ax_t, ax_o = axes[len(ks)], axes[len(ks) + 1]
        for k in sorted({r["num_devices"] for r in trace_rows}):
            for execution, style in (("unrolled", "o-"), ("stage_functions", "^-"),
                                     ("loop", "s-")):
                pts = [(r["num_microbatches"], r["trace_s"], r["first_call_s"], r["ops_total"])
                       for r in trace_rows if r["num_devices"] == k
                       and r["execution"] == execution and r["trace_s"] is not None]
                if not pts:
                    continue
                m, trace, first, ops = zip(*pts)
                ax_t.plot(m, trace, style, label=f"K={k} {execution}: trace")
                ax_t.plot(m, first, style, alpha=0.4, label=f"K={k} {execution}: first call")
                ax_o.plot(m, ops, style, label=f"K={k} {execution}")
        for ax, label in ((ax_t, "seconds"), (ax_o, "graph ops (incl. function bodies)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("micro-batches M")
            ax.set_ylabel(label)
            ax.legend(fontsize=7)
        ax_t.set_title("trace / first-call time")
        ax_o.set_title("graph size")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def goal_summary(rows):
    """The K=2, M>=8 rows against the 0.9-of-ideal goal."""
    hits = [r for r in rows if r["num_devices"] == 2 and r["num_microbatches"] >= 8
            and r.get("ratio_to_ideal")]
    if not hits:
        return None
    worst = min(r["ratio_to_ideal"] for r in hits)
    return {"goal": GOAL, "worst_ratio_k2_m_ge_8": worst, "meets_goal": worst >= GOAL}


def zero_bubble_summary(rows):
    """At each (K, M): ZB-H1's speed-up over 1F1B's (both against the plain
    model in their own child), and ZB-V's measured / simulated ideal."""
    out = []
    unrolled = [r for r in rows if _key(r, "execution") == ("unrolled",)
                and r.get("speedup")]
    for k, m, recompute in sorted({_key(r, "num_devices", "num_microbatches", "recompute")
                                   for r in unrolled}):
        at = {r["schedule"]: r for r in unrolled
              if _key(r, "num_devices", "num_microbatches", "recompute") == (k, m, recompute)}
        entry = {"num_devices": k, "num_microbatches": m}
        if recompute:
            entry["recompute"] = recompute
        if "zbh1" in at and "1f1b" in at:
            entry["zbh1_over_1f1b"] = at["zbh1"]["speedup"] / at["1f1b"]["speedup"]
            entry["zbh1_over_1f1b_simulated"] = at["zbh1"]["ideal_sim"] / at["1f1b"]["ideal_sim"]
            recorded = at["zbh1"]["result"].get("timeline")
            if recorded:  # --timeline
                # Both schedules simulated on ZB-H1's recorded per-stage costs
                # (1F1B's B = I + W): the gain this model's real F, I, W allow.
                # (Not the two recorded spans' ratio: one recorded step each,
                # stamps included, moved it from 0.83 to 1.17 between runs.)
                entry["zbh1_over_1f1b_simulated_on_zbh1_costs"] = split_gain(
                    recorded["stage_ms"], k, m)
        if "zbv" in at:
            entry["zbv_ratio_to_ideal"] = at["zbv"]["ratio_to_ideal"]
        if any(key.startswith(("zbh1", "zbv")) for key in entry):
            out.append(entry)
    return out


def split_gain(stage_ms, num_devices, num_microbatches):
    """1F1B's simulated step over ZB-H1's on the same per-stage costs
    (`recorded_costs`' "stage_ms"): what splitting the backward gains."""
    import tfpipe  # pylint: disable=import-outside-toplevel
    forward, backward = stage_ms["forward"], stage_ms["backward"]
    one_f_one_b = tfpipe.schedules.simulate(tfpipe.schedules.OneFOneB(), num_microbatches,
                                            num_devices, forward, backward)
    zero_bubble = tfpipe.schedules.simulate(tfpipe.schedules.ZeroBubbleH1(), num_microbatches,
                                            num_devices, forward, backward,
                                            weight_cost=stage_ms["weight"])
    return one_f_one_b.makespan / zero_bubble.makespan


def loop_throughput(rows):
    """Per (K, M, schedule): loop step time over unrolled step time's inverse
    (loop throughput / unrolled throughput), where both were run."""
    out = []
    fields = ("num_devices", "num_microbatches", "schedule", "recompute")
    for key in sorted({_key(r, *fields) for r in rows}):
        at = {_key(r, "execution")[0]: r for r in rows
              if _key(r, *fields) == key and r.get("speedup")}
        if "loop" in at and "unrolled" in at:
            out.append({"num_devices": key[0], "num_microbatches": key[1],
                        "schedule": key[2],
                        "loop_over_unrolled": at["loop"]["speedup"] / at["unrolled"]["speedup"]})
    return out


def recompute_cost(rows):
    """Per row run with `compare_recompute`: the other mode's throughput over
    the row's own mode's, measured in one child ("measured": the paired
    median of `recompute_pairs`) and simulated (`simulated_speedup` of each
    mode: the replayed forwards on the critical path). Above 1: the other
    mode is faster per step."""
    out = []
    for row in rows:
        for mode, measured in sorted(row.get("result", {}).get("recompute_pairs", {}).items()):
            k, m, schedule = row["num_devices"], row["num_microbatches"], row["schedule"]
            out.append({"num_devices": k, "num_microbatches": m, "schedule": schedule,
                        "execution": _key(row, "execution")[0],
                        "recompute": row["recompute"], "against": mode, "measured": measured,
                        "simulated": (simulated_speedup(schedule, k, m, mode)
                                      / simulated_speedup(schedule, k, m, row["recompute"]))})
    return out


def _key(row, *fields):
    """`row`'s values of `fields`; rows written before a field existed read
    "" (recompute: one mode per file then, in its "timing") or "unrolled"
    (execution)."""
    defaults = {"execution": "unrolled", "recompute": ""}
    return tuple(row.get(f, defaults.get(f)) for f in fields)


def trace_flatness(rows, execution="loop"):
    """`execution`'s trace time at the largest M over the smallest, per K (1.0 = flat)."""
    out = {}
    for k in sorted({r["num_devices"] for r in rows}):
        times = sorted((r["num_microbatches"], r["trace_s"]) for r in rows
                       if r["num_devices"] == k and r["execution"] == execution
                       and r["trace_s"])
        if len(times) >= 2:
            out[str(k)] = times[-1][1] / times[0][1]
    return out


def trace_growth(rows):
    """{execution: {K: trace time at the largest M / at the smallest}}."""
    return {e: trace_flatness(rows, e)
            for e in sorted({r["execution"] for r in rows})}


# -- command line ------------------------------------------------------------------


def main(argv):
    from absl import app  # pylint: disable=import-outside-toplevel
    from absl import flags  # pylint: disable=import-outside-toplevel
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    if f.explain:
        print(explain(f.explain))
        return
    model = {"batch": f.batch, "width": f.width, "layers": f.layers}
    timing = {"repeats": f.repeats, "steps": f.steps, "warmup": f.warmup,
              "timeline": f.timeline,
              "compare_recompute": [r for r in f.compare_recompute.split(",") if r]}
    recomputes = [r for r in f.recompute.split(",") if r]
    start = time.perf_counter()
    info = common.machine()
    print(f"machine: {common.machine_label(info)}; load average {info['load_average_at_start']}")
    rows = speedup_grid(common.parse_ints(f.devices), common.parse_ints(f.microbatches),
                        [s for s in f.schedules.split(",") if s],
                        executions=[e for e in f.executions.split(",") if e],
                        recomputes=recomputes, **model, **timing)
    traces = []
    if f.trace_microbatches:
        traces = trace_grid(common.parse_ints(f.trace_devices),
                            common.parse_ints(f.trace_microbatches),
                            executions=[e for e in f.trace_executions.split(",") if e])
    result = {
        "machine": info, "model": model, "timing": {**timing, "recompute": recomputes},
        "speedup": rows, "trace": traces,
        "goal": goal_summary(rows), "loop_trace_growth": trace_flatness(traces),
        "trace_growth": trace_growth(traces),
        "zero_bubble": zero_bubble_summary(rows), "loop_throughput": loop_throughput(rows),
        "recompute_cost": recompute_cost(rows),
        "wall_s": time.perf_counter() - start,
    }
    out = common.write_json(f.out, result)
    png = plot(rows, traces, pathlib.Path(f.out).with_suffix(".png"),
               title=common.machine_label(info))
    print(speedup_table(rows))
    if traces:
        print(trace_table(traces))
    print(f"goal (K=2, M>=8, measured/ideal >= {GOAL}): {result['goal']}")
    print(f"trace time, largest M / smallest M: {result['trace_growth']}")
    for entry in result["zero_bubble"] + result["loop_throughput"] + result["recompute_cost"]:
        print(", ".join(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
                        for key, value in entry.items()))
    print(f"wrote {out} and {png} in {result['wall_s']:.0f} s")


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_string("devices", "2,4", "Pipeline device counts K.")
    flags.DEFINE_string("microbatches", "1,2,4,8,16", "Micro-batch counts M.")
    flags.DEFINE_string("schedules", ",".join(SCHEDULES), "Schedules to run.")
    flags.DEFINE_integer("batch", DEFAULT_MODEL["batch"], "Rows per step.")
    flags.DEFINE_integer("width", DEFAULT_MODEL["width"], "Dense layer width.")
    flags.DEFINE_integer("layers", DEFAULT_MODEL["layers"],
                         "Dense layers in all (a multiple of every stage count).")
    flags.DEFINE_string("recompute", "never",
                        "Recompute modes of the speed-up runs, comma-separated (one row "
                        "each, each in its own child).")
    flags.DEFINE_string("compare_recompute", "",
                        "Recompute modes timed beside each row's pipeline in its child "
                        "(comma-separated); `recompute_cost` gives their throughput over "
                        "the row's.")
    flags.DEFINE_string("executions", "unrolled",
                        "Executions of the speed-up runs (unrolled, stage_functions, loop: "
                        "runs only under recompute 'always').")
    flags.DEFINE_integer("repeats", 5, "Timed runs per model; the median is reported.")
    flags.DEFINE_integer("steps", 3, "Steps per timed run.")
    flags.DEFINE_integer("warmup", 2, "Untimed calls per model (the first traces).")
    flags.DEFINE_bool("timeline", False,
                      "Also record one step per row (tfpipe.profile.record_step) and "
                      "simulate its schedule on the recorded costs.")
    flags.DEFINE_string("trace_devices", "2", "K for the trace-time runs.")
    flags.DEFINE_string("trace_executions", "unrolled,stage_functions,loop",
                        "Executions of the trace-time runs.")
    flags.DEFINE_string("trace_microbatches", "1,2,4,8,16,32",
                        "M for the trace-time runs (empty: skip them).")
    flags.DEFINE_string("out", str(common.RESULTS_DIR / "schedules.json"),
                        "JSON output; the PNG goes beside it.")
    flags.DEFINE_string("explain", None,
                        "Run nothing: print the measured/ideal factors (busy, rest = work "
                        "* span) of this results file's --timeline rows.")


if __name__ == "__main__":
    from absl import app as _app
    _define_flags()
    _app.run(main)
