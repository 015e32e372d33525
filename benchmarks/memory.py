"""Memory per recompute mode, with capacity: `python -m benchmarks.memory`.

The model: inputs of width 64 -> L x Dense(`--width`, relu) -> Dense(16),
Adam, MSE, one fixed random batch of `--batch` rows, cut into K equal stages
(plain Keras: the same layers as one `keras.Sequential`). The batch is large
next to the width, so activations (batch x width per layer) dominate the
parameters, and input and head are narrow, so the hidden layers hold the memory.

Every figure is read from the OS in a fresh child process with one intra-op and
one inter-op thread (ops run one at a time), TensorFlow's oneDNN pool
allocator off and glibc's mmap threshold fixed at 64 KiB (`CHILD_ENV`): every
tensor is its own mapping, returned to the OS when freed, so the resident set
follows live memory instead of a pool's high-water mark.

Step memory, per mode and K in `--devices`, with `--layers` layers and M =
`--microbatches`; the "default" row is tfpipe's own choice of recompute mode
(`tfpipe.recompute_choice`) for devices it is told have `--device_mib` each
(`PipelineStrategy(device_memory_bytes=...)`): "never" where its predicted peak
is within half of that, else "except_last" (*mode run* says which), under the
schedule tfpipe chooses (ZB-H1 at 2 <= M < 8); the modes' rows run GPipe:

  step MiB       the child's peak resident set minus its peak once model and
                 data were built (what a child that never steps peaks at):
                 everything one step costs, tracing and graph optimisation included
  execution MiB  the peak of a later step above the resident set just before it
                 (VmHWM reset through /proc/self/clear_refs, freed heap trimmed):
                 activations, gradients and temporaries of one step
  predicted / measured
                 `tfpipe.plan`'s prediction (`host_peak_bytes`: parameters,
                 optimizer state, gradients and the largest sum of live
                 activations of the simulated step, all K devices in this one
                 process, plus the batch) over what building the model and
                 one later step add to the started runtime (the traced
                 program, which the planner does not predict, left out)

Capacity, per mode at K=1 and the same M: the most layers whose child's peak
resident set stays within `--budget_mib` above the runtime (the peak of a child
that only starts TensorFlow; a probe that passes it is killed early), found by a
search over layer counts, a fresh child per probe (the modes' searches
`--parallel` at once); then its parameters and
their ratio to plain Keras': GPipe's 82M -> 318M parameters on one accelerator
with re-materialisation.

    python -m benchmarks.memory                                   # ~10 min on 2 cores
    python -m benchmarks.memory --budget_mib=0                    # step memory only
"""

import gc
import pathlib

from benchmarks import common

# "plain": Keras, no tfpipe; "default": tfpipe's choice, told each device has `device_mib`.
MODES = ("plain", "never", "except_last", "always", "default")
IN_WIDTH, OUT_WIDTH = 64, 16
MODEL = {"layers": 16, "width": 256, "batch": 8192, "num_microbatches": 4, "device_mib": 256}
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536",
             "TF_ENABLE_ONEDNN_OPTS": "0"}


def params(layers, width):
    """Parameters of 64 -> layers x Dense(width) -> Dense(16)."""
    return ((IN_WIDTH + 1) * width + (layers - 1) * (width + 1) * width
            + (width + 1) * OUT_WIDTH) if layers else 0


# -- in the child ---------------------------------------------------------------------


def _trim():
    """Collects garbage and hands freed heap memory back to the OS (glibc)."""
    gc.collect()
    try:
        import ctypes  # pylint: disable=import-outside-toplevel
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _model(mode, layers, width, num_microbatches, num_devices, device_mib):
    import keras  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    if mode == "plain":
        model = keras.Sequential([keras.Input((IN_WIDTH,))] + common.mlp_layers(layers, width)
                                 + [keras.layers.Dense(OUT_WIDTH)])
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
        return model
    if layers % num_devices:
        raise ValueError(f"{layers} layers do not cut into {num_devices} equal stages")
    default = mode == "default"
    # The modes' rows run GPipe (the schedule of the tables in BUILD.md); the
    # default row everything tfpipe chooses, the schedule too.
    strategy = tfpipe.PipelineStrategy(devices=[f"/CPU:{i}" for i in range(num_devices)],
                                       num_microbatches=num_microbatches,
                                       schedule=None if default else "gpipe",
                                       recompute=None if default else mode,
                                       device_memory_bytes=device_mib * 2**20 if default else None)
    with strategy.scope():
        stages = [common.mlp_layers(layers // num_devices, width) for _ in range(num_devices)]
        stages[-1].append(keras.layers.Dense(OUT_WIDTH))
        model = tfpipe.PipelinedModel([keras.Sequential(s) for s in stages],
                                      input_shape=(None, IN_WIDTH))
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model


def measure(mode, layers, width, batch, num_microbatches, num_devices=1, steps=2, seed=0,
            device_mib=MODEL["device_mib"]):
    """Builds the model and steps it `steps` times in this child; MiB figures."""
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(seed)
    tf.constant(0.0).numpy()  # the runtime is up before anything is counted
    started = common.rss_mib()
    model = _model(mode, layers, width, num_microbatches, num_devices, device_mib)
    gen = tf.random.Generator.from_seed(seed)
    x, y = gen.normal((batch, IN_WIDTH)), gen.normal((batch, OUT_WIDTH))
    built = common.peak_rss_mib()  # what a child that never steps would peak at
    fn, runs = common.step_function(model), []
    with common.call_scope(model):
        float(fn(x, y)["loss"])  # trace, graph optimisation, first allocations
        peak = common.peak_rss_mib()
        for _ in range(steps - 1):
            _trim()
            before = common.rss_mib()
            pathlib.Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            float(fn(x, y)["loss"])
            runs.append(common.peak_rss_mib() - before)
    peak = max(peak, common.peak_rss_mib())
    out = {"params": model.count_params(), "execution": getattr(model, "execution", None),
           "recompute_used": getattr(model, "recompute", None),
           "peak_mib": peak, "step_mib": peak - built, "run_mib": max(runs) if runs else None}
    if mode != "plain" and runs:  # the planner's prediction, made after every measurement
        import tfpipe  # pylint: disable=import-outside-toplevel
        plan = tfpipe.plan(model, batch, num_microbatches, optimizer="adam",
                           measure_time=False, recommend=False)
        batch_mib = batch * (IN_WIDTH + OUT_WIDTH) * 4 / 2**20
        out["predicted_mib"] = plan.host_peak_bytes / 2**20 + batch_mib
        out["plan_ratio"] = out["predicted_mib"] / (built - started + out["run_mib"])
    return out


def runtime_only():
    """A child's peak with TensorFlow, Keras and tfpipe started, no model."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.constant(0.0).numpy()
    return {"peak_mib": common.peak_rss_mib()}


# -- in the parent ------------------------------------------------------------------------


def _child(rss_limit_mib=None, **kwargs):
    return common.run_child("benchmarks.memory:measure", kwargs,
                            devices=kwargs.get("num_devices", 1), env=CHILD_ENV,
                            rss_limit_mib=rss_limit_mib)


def _map(fn, items, parallel):
    from concurrent import futures  # pylint: disable=import-outside-toplevel
    with futures.ThreadPoolExecutor(max(1, parallel)) as pool:
        return list(pool.map(fn, items))


def step_memory(modes, devices, model, budget_mib, parallel=1, log=print):
    """({mode: {K: fields}}, the runtime child's result): a child per (mode, K)
    (plain Keras: K=1) and, for the budget, one that only starts TensorFlow;
    `parallel` at once (peaks are per process)."""
    runs = [(mode, k) for mode in modes for k in devices if mode != "plain" or k == 1]
    results = _map(lambda job: _child(mode=job[0], num_devices=job[1], **model) if job else
                   common.run_child("benchmarks.memory:runtime_only", env=CHILD_ENV),
                   runs + ([None] if budget_mib else []), parallel)
    out = {mode: {} for mode in modes}
    for (mode, k), result in zip(runs, results):
        error = common.error_line(result)
        out[mode][k] = {"error": error} if error else {
            f: result.get(f) for f in ("step_mib", "run_mib", "peak_mib", "execution",
                                       "predicted_mib", "plan_ratio", "recompute_used")}
        log(f"{mode:<12} K={k}: " + (f"ERROR {error}" if error else
                                    f"step {result['step_mib']:7.1f} MiB  execution "
                                    f"{common.fmt(result['run_mib'], 1):>7} MiB"))
    return out, (results[-1] if budget_mib else {})


def largest_model(mode, cap_mib, width, batch, num_microbatches, max_layers=512, log=print,
                  device_mib=MODEL["device_mib"]):
    """The most layers (<= max_layers) whose child's peak stays <= `cap_mib`.

    Probes 4 and 8 layers, then guesses from a straight line through the two
    peaks nearest the cap (secant), clamped inside the bracket (largest
    fitting, smallest failing count) so that every probe narrows it, until the
    two are 1 apart; without two peaks, or within 8 layers, it doubles or
    bisects. A probe that errs or passes the cap (killed) does not fit.
    """
    points, probes = {}, []
    lo, hi = 0, max_layers + 1

    def probe(layers):
        result = _child(mode=mode, layers=layers, width=width, batch=batch,
                        num_microbatches=num_microbatches, steps=1, rss_limit_mib=cap_mib,
                        device_mib=device_mib)
        fits = "error" not in result and result["peak_mib"] <= cap_mib
        if "error" not in result:
            points[layers] = result["peak_mib"]
        probes.append({"layers": layers, "fits": fits, "peak_mib": result.get("peak_mib"),
                       "error": common.error_line(result)})
        log(f"  capacity {mode:<12} {layers:>4} layers: peak "
            f"{common.fmt(result.get('peak_mib'), 1)} MiB (cap {cap_mib:.0f}) -> "
            f"{'fits' if fits else 'does not fit'} {probes[-1]['error'] or ''}")
        return fits

    for layers in (4, 8):
        if lo < layers < hi:
            lo, hi = (layers, hi) if probe(layers) else (lo, layers)
    while hi - lo > 1 and lo < max_layers:
        guess = None
        if len(points) >= 2 and hi - lo > 8:
            (l1, p1), (l2, p2) = sorted(points.items(), key=lambda kv: abs(kv[1] - cap_mib))[:2]
            if p1 != p2 and (p2 - p1) / (l2 - l1) > 0:
                guess = int(l1 + (cap_mib - p1) * (l2 - l1) / (p2 - p1))
        if guess is None:
            guess = (lo + hi) // 2 if hi <= max_layers else min(2 * max(lo, 1), max_layers)
        guess = min(max(guess, lo + 1), hi - 1)
        lo, hi = (guess, hi) if probe(guess) else (lo, guess)
    return {"layers": lo, "params": params(lo, width), "at_search_limit": lo >= max_layers,
            "peak_mib": points.get(lo), "probes": probes}


def run(modes=MODES, devices=(1, 2), layers=MODEL["layers"], width=MODEL["width"],
        batch=MODEL["batch"], num_microbatches=MODEL["num_microbatches"], budget_mib=384,
        max_layers=512, parallel=1, log=print, device_mib=MODEL["device_mib"]):
    """The table's rows (one per mode) and the runtime peak the budget sits on."""
    steps, runtime = step_memory(modes, devices, dict(
        layers=layers, width=width, batch=batch, num_microbatches=num_microbatches,
        device_mib=device_mib), budget_mib, parallel, log)
    capacity = {}
    if budget_mib and "error" not in runtime:  # a search per mode, `parallel` at once
        capacity = dict(zip(modes, _map(lambda mode: largest_model(
            mode, runtime["peak_mib"] + budget_mib, width, batch, num_microbatches,
            max_layers, log, device_mib), modes, parallel)))
    rows = []
    for mode in modes:
        row = {"mode": mode}
        for k, fields in steps[mode].items():
            row.update({f"{key}_k{k}": value for key, value in fields.items()})
        errors = [f"K={k}: {v['error']}" for k, v in steps[mode].items() if v.get("error")]
        if budget_mib and "error" in runtime:
            errors.append(f"runtime child: {common.error_line(runtime)}")
        if mode in capacity:
            row.update(capacity=capacity[mode], layers=capacity[mode]["layers"],
                       params=capacity[mode]["params"])
        if errors:
            row["error"] = "; ".join(errors)
        rows.append(row)
    plain = next((r.get("params") for r in rows if r["mode"] == "plain"), None)
    for row in rows:
        if plain and row.get("params") is not None:
            row["params_ratio"] = row["params"] / plain
    return rows, runtime.get("peak_mib")


def table(rows, devices):
    columns = [("mode", "mode", 0)]
    for k in devices:
        columns += [(f"K={k} mode run", f"recompute_used_k{k}", 0),
                    (f"K={k} step MiB", f"step_mib_k{k}", 1),
                    (f"K={k} execution MiB", f"run_mib_k{k}", 1),
                    (f"K={k} predicted / measured", f"plan_ratio_k{k}", 2)]
    columns += [("largest model (layers)", "layers", 0), ("parameters", "params", 0),
                ("parameters / plain Keras", "params_ratio", 2)]
    return common.markdown_table(columns, rows)


def main(argv):
    from absl import flags  # pylint: disable=import-outside-toplevel
    f = flags.FLAGS
    info, start = common.begin(argv)
    devices = [int(k) for k in f.devices]
    model = {"layers": f.layers, "width": f.width, "batch": f.batch,
             "num_microbatches": f.microbatches, "device_mib": f.device_mib}
    rows, runtime = run(f.modes, devices, budget_mib=f.budget_mib, max_layers=f.max_layers,
                        parallel=f.parallel, **model)
    common.finish(f.out, info, start, rows, f"{IN_WIDTH} -> {f.layers} x Dense({f.width}, "
                  f"relu) -> Dense({OUT_WIDTH}), Adam, batch {f.batch}, M={f.microbatches}; "
                  f"capacity: the most layers whose peak stays within {f.budget_mib} MiB above "
                  f"the runtime ({common.fmt(runtime, 0)} MiB), K=1; default: tfpipe's "
                  f"choice for devices of {f.device_mib} MiB each", table(rows, devices),
                  model=model, devices=devices, budget_mib=f.budget_mib, runtime_mib=runtime)


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_list("modes", list(MODES), f"Rows, of {', '.join(MODES)} (plain: Keras).")
    flags.DEFINE_list("devices", ["1", "2"], "K of the step-memory columns.")
    flags.DEFINE_integer("layers", MODEL["layers"], "Hidden layers of the step-memory runs.",
                         lower_bound=1)
    flags.DEFINE_integer("width", MODEL["width"], "Hidden width.", lower_bound=1)
    flags.DEFINE_integer("batch", MODEL["batch"], "Rows per step.", lower_bound=1)
    flags.DEFINE_integer("microbatches", MODEL["num_microbatches"], "M of every run.",
                         lower_bound=1)
    flags.DEFINE_integer("budget_mib", 384, "Capacity: MiB above the runtime (0: skip).",
                         lower_bound=0)
    flags.DEFINE_integer("device_mib", MODEL["device_mib"], "The memory of each device "
                         "the default row tells tfpipe (device_memory_bytes), MiB.",
                         lower_bound=1)
    flags.DEFINE_integer("max_layers", 512, "Capacity: the most layers probed.", lower_bound=1)
    flags.DEFINE_integer("parallel", 2, "Children at once (peaks are per process).",
                         lower_bound=1)
    flags.DEFINE_string("out", str(common.RESULTS_DIR / "memory.json"), "JSON output.")
    common.one_of("modes", MODES)
    common.positive_ints("devices")


if __name__ == "__main__":
    from absl import app as _app
    _define_flags()
    _app.run(main)
