"""Peak memory of a training step per recompute mode, and the largest model that fits.

`python -m benchmarks.memory` runs both; `benchmarks.run` calls the same
functions for its memory and capacity tables.

The model: inputs of width 64 -> `layers` x Dense(`width`, relu) -> Dense(16),
Adam, MSE, one fixed random batch of `batch` rows, on K=1 device by default
(GPipe's per-accelerator view; `num_devices` cuts it into K equal stages). The
batch is large next to the width, so activations (batch x width per layer)
dominate the parameters (width^2 per layer), and input and head are narrow,
so the hidden layers hold the memory.

Step memory. Each (recompute, M) runs in a fresh child process with one
intra-op and one inter-op thread (ops run one at a time), and with
TensorFlow's oneDNN pool allocator off and glibc's mmap threshold fixed at
64 KiB (`CHILD_ENV`): every tensor is then its own mapping, returned to the
OS when freed, so the resident set follows live memory instead of a pool's
high-water mark. Reported per child, all read from the OS (/proc, getrusage):

  step_mib   the child's peak resident set (ru_maxrss) minus that of a
             baseline child that builds the same model, optimizer and data
             but never traces or steps: everything one step costs, graph
             building and first-call graph optimisation included
  run_mib    the peak of a later step above the resident set just before it
             (VmHWM reset through /proc/self/clear_refs, freed heap trimmed):
             activations, gradients and temporaries of one step
  trace_mib  resident set after `get_concrete_function` minus before: the
             Python graph, which grows with M
  tensor_peak_mib  the peak of live tensors in TensorFlow's CPU allocator
             over the steps (None unless the allocator keeps statistics:
             `CHILD_ENVS["tensors"]`)

GPipe's prediction: with recompute="never" each layer's activations for the
whole batch stay until the backward pass; with recompute a stage keeps only
its input per micro-batch (the boundary activations, whole batch) and replays
one micro-batch at a time, so the execution peak falls to about
boundary + never / M ("GPipe model" column, scaled from the measured
never, M=1 run).

Largest model that fits. For recompute "never" and "always" at the same M, a
search over layer counts (a fresh child per probe) finds the largest count
whose child stays within `budget_mib`, held by one of two measures
(`MEASURES`): "process", the child's peak resident set above runtime, the
peak of a child that only starts TensorFlow (a probe that passes the cap is
killed early); or "tensors", the peak of live tensors in TensorFlow's CPU
allocator: what an accelerator would hold, without the host's graph.
Reported: layers, parameters, and the always / never parameter ratio: the
analogue of GPipe's 82M -> 318M parameters on one accelerator with
re-materialisation. `--capacity_execution` steps every probe in another
execution.

Host floor (after a process search; `--host_floor_ratio`): the smallest model
with that many times never's parameters, stepped on 64 rows, for plain Keras
and each recompute mode: what the host pays for the model before its batch
holds anything. Above the budget, no re-materialisation fits that model under
the process measure.

    python -m benchmarks.memory                              # ~3-6 min on 2 cores
    python -m benchmarks.memory --microbatches= --capacity_measure=tensors
    python -m benchmarks.memory --layers=4 --width=64 --batch=1024 --budget_mib=0
"""

import contextlib
import gc
import os
import pathlib
import resource
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads

from benchmarks import common

RECOMPUTE = ("never", "except_last", "always")
IN_WIDTH, OUT_WIDTH = 64, 16
MODEL = {"layers": 16, "width": 256, "batch": 8192}
QUICK_MODEL = {"layers": 8, "width": 256, "batch": 8192}
CAPACITY_MODEL = {"width": 128, "batch": 16384, "num_microbatches": 4}
# Rows per step of `host_floor`: activations are then negligible (64 x width x 4 B
# per layer) and every micro-batch count up to 64 cuts them evenly.
HOST_FLOOR_BATCH = 64
# The loop form takes recompute="always" only, so it has no "never" row.
HOST_FLOOR_EXECUTIONS = ("unrolled", "stage_functions")

# Every tensor over 64 KiB is its own mmap, unmapped when freed (glibc would
# otherwise raise the threshold after the first large free and keep freed
# tensors in its heap), and oneDNN's pool allocator, which keeps what it
# once held, is off: the resident set then follows live memory.
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536",
             "TF_ENABLE_ONEDNN_OPTS": "0"}
# What the capacity search holds under the budget. "process": the child's peak
# resident set above the runtime's (tensors, the Python graph and its
# optimisation, allocator slack: everything a host pays). "tensors": the peak
# bytes of live tensors in TensorFlow's CPU allocator (variables, optimizer
# slots, the batch, activations, gradients, temporaries): what an accelerator
# holds, since graph and Python live on the host. With oneDNN off TensorFlow
# keeps allocator statistics only for its BFC allocator, which pools memory, so
# a "tensors" child's resident set no longer follows live memory.
MEASURES = ("process", "tensors")
CHILD_ENVS = {"process": CHILD_ENV,
              "tensors": dict(CHILD_ENV, TF_CPU_ALLOCATOR_USE_BFC="true")}
MIB = 2.0**20


def _reset_peak():
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where unsupported."""
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _trim():
    """Collects garbage and hands freed heap memory back to the OS (glibc)."""
    gc.collect()
    try:
        import ctypes  # pylint: disable=import-outside-toplevel
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _check_measure(measure):
    if measure not in MEASURES:
        raise ValueError(f"measure={measure!r}: expected one of {MEASURES}.")


def _tensor_mib(key):
    """TensorFlow's CPU allocator: "current" or "peak" bytes of live tensors, MiB.

    The analogue of an accelerator's memory: tensors only, without the
    Python graph, the runtime or the allocator's unused pages. None where
    TensorFlow keeps no statistics for the device.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    try:
        return tf.config.experimental.get_memory_info("CPU:0")[key] / MIB
    except (ValueError, RuntimeError):
        return None


def _reset_tensor_peak():
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
    except (ValueError, RuntimeError):
        pass


def _max_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # kB on Linux


def params(layers, width):
    """Parameters of the model: 64 -> layers x Dense(width) -> Dense(16)."""
    if layers < 1:
        return 0
    return ((IN_WIDTH + 1) * width + (layers - 1) * (width + 1) * width
            + (width + 1) * OUT_WIDTH)


def _pipelined_model(layers, width, num_microbatches, recompute, num_devices, execution,
                     segment_layers):
    """The benchmark's model as K equal stages, in segments of `segment_layers`;
    compiled."""
    import keras  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    if layers % num_devices:
        raise ValueError(f"{layers} layers do not cut into {num_devices} equal stages.")
    per_device = layers // num_devices
    segments = max(1, -(-per_device // segment_layers)) if segment_layers else 1
    schedule = tfpipe.schedules.Segmented("gpipe", segments) if segments > 1 else "gpipe"
    strategy = tfpipe.PipelineStrategy(
        devices=[f"/CPU:{i}" for i in range(num_devices)], num_microbatches=num_microbatches,
        recompute=recompute, execution=execution, schedule=schedule)
    with strategy.scope():
        stages = []
        for _ in range(num_devices):
            sizes = [segment_layers] * (segments - 1)
            sizes.append(per_device - sum(sizes))
            stages += [common.mlp_layers(n, width) for n in sizes]
        stages[-1].append(keras.layers.Dense(OUT_WIDTH))
        model = tfpipe.PipelinedModel([keras.Sequential(s) for s in stages],
                                      input_shape=(None, IN_WIDTH))
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model


def measure_memory(layers, width, batch, num_microbatches=1, recompute="never",
                   num_devices=1, execution="unrolled", step=True, steps=2, seed=0,
                   segment_layers=0, plain=False):
    """Builds the model (and steps it `steps` times if `step`); MiB figures.

    Runs in a child with `num_devices` logical CPUs (see `run_memory`).
    `segment_layers` > 0: each device's stage is re-materialised in segments
    of that many layers (`tfpipe.schedules.Segmented`). `plain`: the same
    layers as one plain `keras.Sequential` (no tfpipe; the pipeline
    arguments are not used).
    """
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(seed)
    tf.constant(0.0).numpy()  # the runtime is up before anything is counted
    _trim()
    runtime_mib = common.rss_mib()  # before the model: what building it adds is built - this
    if plain:
        model = keras.Sequential(common.mlp_layers(layers, width)
                                 + [keras.layers.Dense(OUT_WIDTH)])
        model.build((None, IN_WIDTH))
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    else:
        model = _pipelined_model(layers, width, num_microbatches, recompute, num_devices,
                                 execution, segment_layers)
    gen = tf.random.Generator.from_seed(seed)
    x, y = gen.normal((batch, IN_WIDTH)), gen.normal((batch, OUT_WIDTH))
    result = {
        "config": {"layers": layers, "width": width, "batch": batch,
                   "num_microbatches": num_microbatches, "recompute": recompute,
                   "num_devices": num_devices, "execution": execution, "step": step,
                   "segment_layers": segment_layers, "plain": plain,
                   "steps": steps, "optimizer": "Adam(1e-4)",
                   "model": f"{IN_WIDTH} -> {layers} x Dense({width}, relu) -> "
                            f"Dense({OUT_WIDTH})"},
        "params": model.count_params(),
        "runtime_mib": runtime_mib,
        "built_mib": common.rss_mib(),
    }
    if step:
        # As fit calls it: a step of stage functions, and its trace, run with
        # grappler's function optimiser off (`tfpipe.stage.call_scope`).
        with (contextlib.nullcontext() if plain
              else tfpipe.stage.call_scope(model.pipeline_config.traits)):
            # As Keras' fit traces it: without AutoGraph (it would convert tfpipe's
            # own Python, which fit never does, and inflate the trace time).
            fn = tf.function(lambda a, b: model.train_step((a, b)), autograph=False)
            _trim()
            before_trace = common.rss_mib()
            concrete = fn.get_concrete_function(tf.TensorSpec(x.shape, x.dtype),
                                                tf.TensorSpec(y.shape, y.dtype))
            _trim()
            traced = common.rss_mib()
            result["trace_mib"] = traced - before_trace
            held_mib = _tensor_mib("current")  # variables, optimizer slots, the batch
            _reset_tensor_peak()
            start = time.perf_counter()
            loss = float(concrete(x, y)["loss"])  # graph optimisation, first allocations
            result["first_step_s"] = time.perf_counter() - start
            runs = []
            for _ in range(steps - 1):
                _trim()
                before = common.rss_mib()
                reset = _reset_peak()
                loss = float(concrete(x, y)["loss"])
                runs.append(common.peak_rss_mib() - before if reset else None)
            result["loss"] = loss
            result["tensor_held_mib"] = held_mib
            result["tensor_peak_mib"] = _tensor_mib("peak")
            result["runs_mib"] = runs
            result["run_mib"] = max(runs) if runs and None not in runs else None
    result["peak_mib"] = _max_rss_mib()
    return result


def run_memory(timeout=1800, rss_limit_mib=None, measure="process", **kwargs):
    """`measure_memory` in a fresh child (1 intra-op, 1 inter-op thread), with
    the environment of `measure` (`CHILD_ENVS`)."""
    return common.run_child("benchmarks.memory:measure_memory", kwargs, intra_op=1,
                            inter_op=1, devices=kwargs.get("num_devices", 1),
                            timeout=timeout, rss_limit_mib=rss_limit_mib,
                            env=CHILD_ENVS[measure])


def runtime_only():
    """A child's footprint with TensorFlow, Keras and tfpipe started, no model."""
    import keras  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.constant(0.0).numpy()
    return {"peak_mib": _max_rss_mib()}


def _map(fn, items, parallel):
    if parallel <= 1:
        return [fn(item) for item in items]
    from concurrent import futures  # pylint: disable=import-outside-toplevel
    with futures.ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(fn, items))


# -- step memory per recompute mode ---------------------------------------------------


def memory_grid(layers, width, batch, microbatches=(1, 4, 16), recompute=RECOMPUTE,
                num_devices=1, steps=2, parallel=1, log=print):
    """Step memory per (recompute, M), a fresh child each, and a baseline child.

    `parallel` children may run at once: a peak resident set is per process,
    so that changes the wall time, not the figures. Returns a dict with
    "model", "baseline" and one row per configuration.
    """
    model = {"layers": layers, "width": width, "batch": batch, "num_devices": num_devices}
    configs = [dict(model, num_microbatches=m, recompute=r, steps=steps)
               for r in recompute for m in microbatches]
    results = _map(lambda c: run_memory(**c), [dict(model, step=False)] + configs, parallel)
    baseline, results = results[0], results[1:]
    never_m1 = next((r for c, r in zip(configs, results)
                     if c["recompute"] == "never" and c["num_microbatches"] == 1
                     and r.get("run_mib") is not None), None)
    # Stage inputs, whole batch: what recompute keeps (GPipe's boundary activations).
    boundary = batch * (IN_WIDTH + (num_devices - 1) * width) * 4 / MIB
    rows = []
    for config, result in zip(configs, results):
        ok = "error" not in result and "error" not in baseline
        m = config["num_microbatches"]
        row = {"recompute": config["recompute"], "num_microbatches": m,
               "peak_mib": result.get("peak_mib"),
               "step_mib": result["peak_mib"] - baseline["peak_mib"] if ok else None,
               "run_mib": result.get("run_mib"), "trace_mib": result.get("trace_mib"),
               "predicted_run_mib": None, "result": result}
        if ok and never_m1:
            row["predicted_run_mib"] = (never_m1["run_mib"] if config["recompute"] == "never"
                                        else boundary + never_m1["run_mib"] / m)
        rows.append(row)
        log(_memory_line(row))
    return {"model": dict(model, params=params(layers, width),
                          activation_mib_per_layer=batch * width * 4 / MIB,
                          param_mib=params(layers, width) * 4 / MIB,
                          boundary_mib=boundary,
                          description=f"{IN_WIDTH} -> {layers} x Dense({width}, relu) -> "
                                      f"Dense({OUT_WIDTH}), Adam, batch {batch}, "
                                      f"K={num_devices}"),
            "baseline": baseline, "rows": rows}


def _memory_line(row):
    if row["step_mib"] is None:
        return (f"recompute={row['recompute']:<12} M={row['num_microbatches']:<3} ERROR "
                f"{common.error_line(row['result'])}")
    return (f"recompute={row['recompute']:<12} M={row['num_microbatches']:<3} step "
            f"{row['step_mib']:7.1f} MiB  execution {common.fmt(row['run_mib'], 1):>7} MiB "
            f"(GPipe model {common.fmt(row['predicted_run_mib'], 1)})  trace "
            f"{common.fmt(row['trace_mib'], 1)} MiB")


def memory_table(grid):
    never = {r["num_microbatches"]: r["run_mib"] for r in grid["rows"]
             if r["recompute"] == "never"}
    body = []
    for r in grid["rows"]:
        base = never.get(r["num_microbatches"])
        body.append([r["recompute"], str(r["num_microbatches"]), common.fmt(r["step_mib"], 1),
                     common.fmt(r["run_mib"], 1), common.fmt(r["predicted_run_mib"], 1),
                     (r["run_mib"] / base) if base and r["run_mib"] is not None else None,
                     common.fmt(r["trace_mib"], 1)])
    return common.markdown_table(
        ["recompute", "M", "step MiB (peak - baseline child)", "execution peak MiB",
         "GPipe model MiB", "execution / never (same M)", "trace MiB"], body)


def plot_memory(grid, path, title=""):
    """Execution peak vs M per recompute mode, beside the GPipe model."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, style in zip(RECOMPUTE, (":", "-.", "--")):
        rows = [r for r in grid["rows"] if r["recompute"] == mode and r["run_mib"] is not None]
        if not rows:
            continue
        ms = [r["num_microbatches"] for r in rows]
        line, = ax.plot(ms, [r["run_mib"] for r in rows], "o-", label=f"{mode} (measured)")
        if any(r["predicted_run_mib"] for r in rows):
            ax.plot(ms, [r["predicted_run_mib"] for r in rows], style, color=line.get_color(),
                    label=f"{mode} (GPipe model)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("execution peak of one step (MiB)")
    ax.set_title(grid["model"]["description"], fontsize=8)
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=7)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- the largest model under a memory cap ------------------------------------------


def largest_model(recompute, budget_mib, runtime_mib, width, batch, num_microbatches,
                  start=(4, 8), max_layers=512, steps=1, log=print, segment_layers=0,
                  measure="process", execution="unrolled"):
    """The most layers whose child peak stays <= the cap.

    measure "process": the child's peak resident set against runtime_mib +
    budget_mib (a probe whose resident set passes the cap is killed early);
    "tensors": its allocator's peak of live tensors against budget_mib
    (runtime_mib is not used). See `MEASURES`.

    Probes the `start` layer counts, then guesses from a straight line through
    the two measured peaks nearest the cap (secant), clamped inside the
    bracket (largest fitting, smallest failing count) so that every probe
    narrows it, until the two are 1 apart; without two measured points, or
    once the bracket is 8 layers or fewer, it doubles or bisects. A probe
    that errs counts as failing.
    """
    _check_measure(measure)
    cap = runtime_mib + budget_mib if measure == "process" else budget_mib
    peak_key = "peak_mib" if measure == "process" else "tensor_peak_mib"
    points, probes = {}, []
    lo, hi = 0, max_layers + 1

    def probe(layers):
        result = run_memory(layers=layers, width=width, batch=batch,
                            num_microbatches=num_microbatches, recompute=recompute,
                            steps=steps, segment_layers=segment_layers, measure=measure,
                            execution=execution,
                            rss_limit_mib=cap if measure == "process" else None)
        if "error" not in result and result.get(peak_key) is None:
            result = {"error": f"the child reported no {peak_key} (allocator statistics "
                               f"off?)"}
        fits = "error" not in result and result[peak_key] <= cap
        if "error" not in result:
            points[layers] = result[peak_key]
        probes.append({"layers": layers, "fits": fits, "peak_mib": result.get(peak_key),
                       "process_peak_mib": result.get("peak_mib"),
                       "error": common.error_line(result),
                       "child_wall_s": result.get("child_wall_s")})
        log(f"  {measure}: {execution} recompute={recompute:<6} "
            f"segments of {segment_layers or 'all'} "
            f"layers={layers:<4} peak "
            f"{common.fmt(result.get(peak_key), 1)} MiB (cap {cap:.0f}) -> "
            f"{'fits' if fits else 'does not fit'}"
            + (f" ({probes[-1]['error']})" if probes[-1]["error"] else ""))
        return fits

    for layers in start:
        if lo < layers < hi:
            if probe(layers):
                lo = layers
            else:
                hi = layers
    while hi - lo > 1 and lo < max_layers:
        guess = None
        # Within a few layers of the boundary the peaks' noise (~1 MiB) steers
        # the secant one layer at a time; bisection ends it in log2 probes.
        if len(points) >= 2 and hi - lo > 8:
            (l1, p1), (l2, p2) = sorted(points.items(), key=lambda kv: abs(kv[1] - cap))[:2]
            if p1 != p2 and (p2 - p1) / (l2 - l1) > 0:
                guess = int(l1 + (cap - p1) * (l2 - l1) / (p2 - p1))
        if guess is None:
            guess = (lo + hi) // 2 if hi <= max_layers else min(2 * max(lo, 1), max_layers)
        guess = min(max(guess, lo + 1), hi - 1)  # inside the bracket: it always narrows
        if probe(guess):
            lo = guess
        else:
            hi = guess
    return {"recompute": recompute, "segment_layers": segment_layers, "measure": measure,
            "execution": execution, "layers": lo, "params": params(lo, width),
            "at_search_limit": lo >= max_layers,  # then `layers` is a lower bound
            "cap_mib": cap, "budget_mib": budget_mib, "probes": probes,
            "peak_mib_at_layers": points.get(lo)}


def capacity(budget_mib, width, batch, num_microbatches, steps=1, log=print,
             segment_layers=(), measure="process", execution="unrolled",
             host_floor_ratio=0, host_floor_executions=("unrolled",), **kwargs):
    """`largest_model` for recompute "never", "always" and "always" in
    segments of each of `segment_layers` layers, under `measure`'s budget;
    parameter ratios to never. Every probe runs `execution`.

    `host_floor_ratio` > 0 (measure "process" only): also `host_floor` of
    the smallest model with that many times never's parameters (the goal's
    model), in `host_floor_executions`, under "host_floor"."""
    _check_measure(measure)
    runtime = {"peak_mib": 0.0}  # "tensors": the budget is absolute
    if measure == "process":
        runtime = common.run_child("benchmarks.memory:runtime_only", {}, intra_op=1,
                                   inter_op=1, env=CHILD_ENV)
        if "error" in runtime:
            return {"error": runtime["error"], "runtime": runtime}
    modes = [("never", "never", 0), ("always", "always", 0)] + [
        (f"always/segments of {n}", "always", n) for n in segment_layers]
    found = {name: largest_model(r, budget_mib, runtime["peak_mib"], width, batch,
                                 num_microbatches, steps=steps, log=log, segment_layers=n,
                                 measure=measure, execution=execution, **kwargs)
             for name, r, n in modes}
    never, always = found["never"]["params"], found["always"]["params"]
    ratios = {name: found[name]["params"] / never if never else None for name, _, _ in modes}
    floor = None
    if measure == "process" and host_floor_ratio and never:
        floor = host_floor(layers_for_params(host_floor_ratio * never, width), width,
                           num_microbatches, runtime["peak_mib"], budget_mib,
                           segment_layers=segment_layers, executions=host_floor_executions,
                           log=log)
        floor["ratio"] = host_floor_ratio
    return {"budget_mib": budget_mib, "runtime_mib": runtime["peak_mib"], "measure": measure,
            "model": {"width": width, "batch": batch, "num_microbatches": num_microbatches,
                      "num_devices": 1, "steps": steps,
                      "execution": execution,
                      "description": f"{IN_WIDTH} -> L x Dense({width}, relu) -> "
                                     f"Dense({OUT_WIDTH}), Adam, batch {batch}, "
                                     f"M={num_microbatches}, K=1"},
            "never": found["never"], "always": found["always"], "modes": found,
            "ratios": ratios, "ratio": always / never if never else None,
            "host_floor": floor}


# -- what the host pays before any activation ---------------------------------------


def layers_for_params(target, width):
    """The fewest layers whose model (`params`) has at least `target` parameters."""
    layers = 1
    while params(layers, width) < target:
        layers += 1
    return layers


def host_floor(layers, width, num_microbatches, runtime_mib, budget_mib, segment_layers=(),
               executions=("unrolled",), batch=HOST_FLOOR_BATCH, log=print):
    """The process peak above the runtime of a `layers`-layer model stepped
    on `batch` rows, for plain Keras and for each recompute mode of the
    capacity search in each of `executions`: one fresh child per row.

    At 64 rows a layer's activations are 64 x width x 4 B (32 KiB at width
    128), so the peak is what the host pays for the model itself: Keras'
    layers and variables, Adam's slots and per-variable update ops, the
    traced graph, its optimisation and the executor. Where that exceeds
    `budget_mib`, no re-materialisation fits the model under the process
    measure, whatever the batch. Rows: name, execution, peak_mib (above
    `runtime_mib`), fits (<= budget_mib).
    """
    configs = [("plain Keras", None, dict(plain=True))]
    for execution in executions:
        configs += [("never", execution, dict(recompute="never")),
                    ("always", execution, dict(recompute="always"))]
        configs += [(f"always/segments of {n}", execution,
                     dict(recompute="always", segment_layers=n)) for n in segment_layers]
    rows = []
    for name, execution, kwargs in configs:
        result = run_memory(layers=layers, width=width, batch=batch,
                            num_microbatches=num_microbatches, steps=1,
                            **(dict(execution=execution) if execution else {}), **kwargs)
        peak = None if "error" in result else result["peak_mib"] - runtime_mib
        rows.append({"name": name, "execution": execution, "peak_mib": peak,
                     "fits": peak is not None and peak <= budget_mib,
                     "trace_mib": result.get("trace_mib"),
                     "error": common.error_line(result)})
        log(f"  host floor: {name:<24} {execution or '':<16} L={layers} batch={batch}: "
            f"{common.fmt(peak, 1)} MiB above the runtime (budget {budget_mib})"
            + (f" ({rows[-1]['error']})" if rows[-1]["error"] else ""))
    return {"layers": layers, "params": params(layers, width), "batch": batch,
            "budget_mib": budget_mib, "rows": rows}


def host_floor_table(floor):
    """Markdown: one row per model of `host_floor`."""
    body = [[r["name"], r["execution"] or "-", str(floor["layers"]),
             f"{floor['params'] / 1e6:.3f}M", common.fmt(r["peak_mib"], 1),
             common.fmt(r["trace_mib"], 1),
             ("yes" if r["fits"] else "no") + (f" ({r['error']})" if r["error"] else "")]
            for r in floor["rows"]]
    return common.markdown_table(
        ["model", "execution", "layers", "parameters",
         f"process peak above runtime, batch {floor['batch']} (MiB)", "trace MiB",
         f"within {floor['budget_mib']} MiB"], body)


def capacity_table(result):
    if "error" in result:
        return f"capacity search failed: {result['error']}"
    rows = []
    modes = result.get("modes") or {m: result[m] for m in ("never", "always")}
    for mode, found in modes.items():
        at_limit = found.get("at_search_limit")
        rows.append([mode, (">= " if at_limit else "") + str(found["layers"]),
                     (">= " if at_limit else "") + f"{found['params'] / 1e6:.3f}M",
                     common.fmt(found["peak_mib_at_layers"], 1), f"{found['cap_mib']:.0f}",
                     str(len(found["probes"])),
                     (">= " if at_limit else "") + common.fmt(
                         (result.get("ratios") or {}).get(
                             mode, result.get("ratio") if mode == "always" else 1.0))])
    measure = result.get("measure", "process")
    peak, cap = {"process": ("process peak MiB", "cap MiB (runtime + budget)"),
                 "tensors": ("tensor peak MiB", "cap MiB (budget)")}[measure]
    return common.markdown_table(["recompute", "layers", "parameters", peak, cap, "probes",
                                  "parameters / never"], rows)


# -- command line ------------------------------------------------------------------


def parse_measures(text):
    """--capacity_measure's value, e.g. "process,tensors" -> a list of
    `MEASURES`; a ValueError names any other."""
    measures = [m.strip() for m in str(text).split(",") if m.strip()]
    bad = [m for m in measures if m not in MEASURES]
    if bad:
        raise ValueError(f"--capacity_measure={text!r}: {bad} not in {MEASURES}; pass a "
                         f"comma-separated subset, e.g. --capacity_measure=process,tensors.")
    return measures


def parse_executions(text, flag="--host_floor_executions", most=None):
    """An executions flag's value, e.g. "unrolled,stage_functions" -> a list
    of at most `most`; a ValueError names the flag and the choices."""
    executions = [e.strip() for e in str(text).split(",") if e.strip()]
    bad = [e for e in executions if e not in HOST_FLOOR_EXECUTIONS]
    if bad or not executions or (most and len(executions) > most):
        many = "one" if most == 1 else "a comma-separated subset"
        raise ValueError(f"{flag}={text!r}: expected {many} of {HOST_FLOOR_EXECUTIONS}, "
                         f"e.g. {flag}=" + ("stage_functions." if most == 1 else
                                            "unrolled,stage_functions."))
    return executions


def main(argv):
    from absl import app  # pylint: disable=import-outside-toplevel
    from absl import flags  # pylint: disable=import-outside-toplevel
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    try:
        measures = parse_measures(f.capacity_measure)
        executions = parse_executions(f.host_floor_executions)
        parse_executions(f.capacity_execution, "--capacity_execution", most=1)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    start = time.perf_counter()
    info = common.machine()
    print(f"machine: {common.machine_label(info)}")
    grid, microbatches = None, common.parse_ints(f.microbatches)
    if microbatches:  # empty: the capacity search only
        grid = memory_grid(f.layers, f.width, f.batch, microbatches,
                           num_devices=f.num_devices, parallel=f.parallel)
        print(memory_table(grid))
    caps = {}
    if f.budget_mib:
        for measure in measures:
            caps[measure] = capacity(f.budget_mib, f.capacity_width, f.capacity_batch,
                                     f.capacity_microbatches, measure=measure,
                                     segment_layers=common.parse_ints(f.segment_layers),
                                     host_floor_ratio=f.host_floor_ratio,
                                     host_floor_executions=executions,
                                     execution=f.capacity_execution)
            print(capacity_table(caps[measure]))
            if caps[measure].get("host_floor"):
                print(host_floor_table(caps[measure]["host_floor"]))
    out = common.write_json(f.out, {"machine": info, "memory": grid,
                                    "capacity": caps.get("process"),
                                    "capacity_by_measure": caps,
                                    "wall_s": time.perf_counter() - start})
    if grid:
        png = plot_memory(grid, pathlib.Path(f.out).with_suffix(".png"),
                          common.machine_label(info))
        out = f"{out} and {png}"
    print(f"wrote {out}")


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_integer("layers", MODEL["layers"], "Hidden Dense layers.")
    flags.DEFINE_integer("width", MODEL["width"], "Hidden width.")
    flags.DEFINE_integer("batch", MODEL["batch"], "Rows per step.")
    flags.DEFINE_integer("num_devices", 1, "K: stages / logical devices.")
    flags.DEFINE_string("microbatches", "1,4,16", "Micro-batch counts M (empty: skip the "
                        "step-memory grid).")
    flags.DEFINE_integer("parallel", 2, "Memory children run at once.")
    flags.DEFINE_integer("budget_mib", 384, "Capacity search: MiB above the runtime "
                         "(process) or of live tensors (tensors); 0: skip the search.")
    flags.DEFINE_string("capacity_measure", "process",
                        "Capacity search: what the budget holds, comma-separated "
                        f"subset of {','.join(MEASURES)} (see MEASURES).")
    flags.DEFINE_integer("capacity_width", CAPACITY_MODEL["width"], "Capacity search width.")
    flags.DEFINE_integer("capacity_batch", CAPACITY_MODEL["batch"], "Capacity search batch.")
    flags.DEFINE_integer("capacity_microbatches", CAPACITY_MODEL["num_microbatches"],
                         "Capacity search M (both modes).")
    flags.DEFINE_string("segment_layers", "4,8",
                        "Capacity search: also recompute in segments of these many layers "
                        "(tfpipe.schedules.Segmented; empty: skip).")
    flags.DEFINE_string("capacity_execution", "unrolled",
                        f"Capacity search: the execution of every probe (one of "
                        f"{','.join(HOST_FLOOR_EXECUTIONS)}).")
    flags.DEFINE_float("host_floor_ratio", 4.0,
                       "Process capacity search: also measure what the host pays for the "
                       "model with this many times never's parameters at 64 rows, before "
                       "any activation (0: skip).")
    flags.DEFINE_string("host_floor_executions", "unrolled",
                        f"Executions of the host-floor rows ({','.join(HOST_FLOOR_EXECUTIONS)}).")
    flags.DEFINE_string("out", str(common.RESULTS_DIR / "memory.json"), "JSON output.")


if __name__ == "__main__":
    from absl import app as _app
    _define_flags()
    _app.run(main)
