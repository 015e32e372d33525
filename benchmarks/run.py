"""All benchmarks in one run: `python -m benchmarks.run --suite=quick|full`.

Five tables, each measured in fresh child processes (`benchmarks.common.run_child`)
by the functions of the other benchmark modules, so the numbers mean the same
as there:

  1. memory      `benchmarks.memory.memory_grid`: peak memory of one training
                 step for a deep MLP at a fixed batch, recompute
                 never / except_last / always, M in {1, 4, 16}, against a
                 baseline child that builds the model but does not step.
  2. capacity    `benchmarks.memory.capacity`: the most layers trainable under
                 a fixed resident-set budget with recompute "never" vs
                 "always" (GPipe's 82M -> 318M parameters per accelerator).
  3. throughput  `benchmarks.schedules.speedup_grid` (GPipe schedule): step-time
                 speed-up over the plain Keras model on one device, K in
                 {1, 2, 4}, M up to 32, beside K*M/(M+K-1).
  4. overhead    `benchmarks.overhead.benchmark`: tfpipe at K=1, M=1 vs plain
                 Keras, in one child with 1 intra-op and 1 inter-op thread.
  5. trace       `benchmarks.schedules.trace_grid`: trace and first-call time and
                 graph size vs M and K, execution "unrolled" vs "loop".

Every figure is a ratio measured within one child (so machine drift cancels)
or a peak read from the OS; absolute times carry the machine label. The JSON
(`benchmarks/results/suite_<suite>.json`, every child's raw numbers) and PNGs
(`suite_<suite>_*.png`) go under `--out_dir`; the tables also replace the part
of `--build_md` between `<!-- benchmarks:begin -->` and `<!-- benchmarks:end -->`.

The quick suite (fewer configurations and repeats) takes about 6 minutes on 2
quiet cores; the full suite about 15 minutes.

    python -m benchmarks.run --suite=quick
    python -m benchmarks.run --suite=full
    python -m benchmarks.run --suite=quick --only=memory,overhead --build_md=
"""

import os
import pathlib
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads

from absl import app
from absl import flags

from benchmarks import common
from benchmarks import memory
from benchmarks import schedules

SECTIONS = ("memory", "capacity", "throughput", "overhead", "trace")

SUITES = {
    "quick": {
        "memory": dict(memory.QUICK_MODEL, microbatches=(1, 4, 16), steps=2, parallel=2),
        "capacity": dict(memory.CAPACITY_MODEL, budget_mib=192),
        "throughput": dict(devices=(1, 2, 4), microbatches=(1, 4, 16), repeats=2, steps=2,
                           warmup=2),
        "overhead": dict(steps=20, batch_size=256, repeats=3, examples=4096),
        "trace": dict(devices=(2,), microbatches=(1, 4, 16, 32)),
    },
    "full": {
        "memory": dict(memory.MODEL, microbatches=(1, 4, 16), steps=3, parallel=2),
        "capacity": dict(memory.CAPACITY_MODEL, budget_mib=384),
        "throughput": dict(devices=(1, 2, 4), microbatches=(1, 2, 4, 8, 16, 32), repeats=5,
                           steps=3, warmup=2),
        "overhead": dict(steps=50, batch_size=256, repeats=5, examples=4096),
        "trace": dict(devices=(1, 2, 4), microbatches=(1, 2, 4, 8, 16, 32)),
    },
}


# -- the sections --------------------------------------------------------------------


def run_memory(config, log=print):
    config = dict(config)
    return memory.memory_grid(config.pop("layers"), config.pop("width"), config.pop("batch"),
                              log=log, **config)


def run_capacity(config, log=print):
    return memory.capacity(log=log, **config)


def run_throughput(config, log=print):
    config = dict(config)
    devices, microbatches = config.pop("devices"), config.pop("microbatches")
    model = {key: config.pop(key, value) for key, value in schedules.DEFAULT_MODEL.items()}
    rows = schedules.speedup_grid(devices, microbatches, schedules=("gpipe",), log=log,
                                  **model, **config)
    return {"model": model, "recompute": config.get("recompute", "never"), "rows": rows,
            "timing": config}


def run_overhead(config, log=print):
    result = common.run_child("benchmarks.overhead:benchmark", config, intra_op=1,
                              inter_op=1, devices=1)
    if "error" not in result:
        log(f"plain {result['plain_step_ms']:.3f} ms, tfpipe {result['tfpipe_step_ms']:.3f} ms,"
            f" ratio {result['ratio']:.3f}")
    else:
        log(f"overhead ERROR {common.error_line(result)}")
    return result


def run_trace(config, log=print):
    config = dict(config)
    devices, microbatches = config.pop("devices"), config.pop("microbatches")
    model = {key: config.pop(key, value) for key, value in schedules.TRACE_MODEL.items()}
    rows = schedules.trace_grid(devices, microbatches, log=log, **model, **config)
    return {"model": model, "rows": rows,
            "loop_trace_growth": schedules.trace_flatness(rows),
            "trace_growth": schedules.trace_growth(rows)}


RUNNERS = {"memory": run_memory, "capacity": run_capacity, "throughput": run_throughput,
           "overhead": run_overhead, "trace": run_trace}


# -- markdown -------------------------------------------------------------------------


def throughput_table(rows):
    headers = ["K", "M", "plain ms", "tfpipe ms", "speed-up", "ideal K*M/(M+K-1)",
               "measured / ideal", "tfpipe cpu/wall", "speed-up vs plain (K threads)"]
    body = []
    for row in rows:
        r = row["result"]
        if "error" in r:
            body.append([str(row["num_devices"]), str(row["num_microbatches"]), "error", "-",
                         "-", row["ideal"], "-", "-", "-"])
            continue
        body.append([str(row["num_devices"]), str(row["num_microbatches"]),
                     common.fmt(r["plain"]["step_ms"], 1), common.fmt(r["tfpipe"]["step_ms"], 1),
                     row["speedup"], row["ideal"], row["ratio_to_ideal"],
                     r["tfpipe"]["cpu_per_wall"], row["speedup_vs_threaded"]])
    return common.markdown_table(headers, body)


def overhead_table(result):
    if "error" in result:
        return f"overhead run failed: {common.error_line(result)}"
    return common.markdown_table(
        ["plain step", "tfpipe step", "ratio tfpipe / plain", "goal"],
        [[f"{result['plain_step_ms']:.2f} ms", f"{result['tfpipe_step_ms']:.2f} ms",
          result["ratio"], f"<= {result['goal']}"]])


def markdown(results, info, suite, wall_s, out_dir=common.RESULTS_DIR):
    """The generated section of BUILD.md."""
    out_dir = pathlib.Path(out_dir).resolve()
    try:
        where = out_dir.relative_to(common.REPO_ROOT)
    except ValueError:
        where = out_dir
    parts = [
        f"Generated by `python -m benchmarks.run --suite={suite}` on {info['date']} in "
        f"{wall_s / 60:.1f} min. Machine: {common.machine_label(info)}; load average at "
        f"start {info['load_average_at_start']}. Raw numbers: "
        f"`{where}/suite_{suite}.json`; plots `suite_{suite}_*.png`. Each figure "
        f"is a ratio measured inside one child process or a peak read from the OS; absolute "
        f"times hold for this machine only.",
    ]
    if "memory" in results:
        grid = results["memory"]
        m = grid["model"]
        parts += [
            "#### Memory of one training step (`benchmarks/memory.py`)",
            f"{m['description']}: {m['params']:,} parameters ({m['param_mib']:.1f} MiB), "
            f"{m['activation_mib_per_layer']:.0f} MiB per layer activation (whole batch). "
            f"A fresh child per row (1 intra-op, 1 inter-op thread). *Step* is the child's "
            f"peak RSS minus a baseline child that builds the model and data without "
            f"stepping (it includes tracing and graph optimisation); *execution* is the "
            f"peak of a later step above the RSS just before it (activations, gradients, "
            f"temporaries). The GPipe model is boundary activations "
            f"({m['boundary_mib']:.1f} MiB) + the never, M=1 execution peak / M.",
            memory.memory_table(grid),
        ]
    if "capacity" in results:
        cap = results["capacity"]
        parts += ["#### Largest model under a memory budget (`benchmarks/memory.py`)"]
        if "error" in cap:
            parts.append(memory.capacity_table(cap))
        else:
            parts += [
                f"{cap['model']['description']}. Budget: {cap['budget_mib']} MiB of peak RSS "
                f"above a child that only starts TensorFlow ({cap['runtime_mib']:.0f} MiB); "
                f"a search over layer counts, a fresh child per probe (GPipe, Table 1: 82M "
                f"-> 318M parameters on one accelerator with re-materialisation).",
                memory.capacity_table(cap),
            ]
    if "throughput" in results:
        rows = results["throughput"]["rows"]
        model = results["throughput"]["model"]
        parts += [
            "#### Throughput, GPipe schedule (`benchmarks/schedules.py`)",
            f"{model['layers']} x Dense({model['width']}, relu), Adam, MSE, batch "
            f"{model['batch']}, recompute={results['throughput']['recompute']}, equal "
            f"stages. Each row is one child with K logical CPUs, 1 intra-op and K inter-op threads; *plain* is the Keras model "
            f"in the same child under the single-threaded executor (one op at a time: one "
            f"device); the last column compares with plain Keras given the same K "
            f"inter-op threads. Each pipeline device runs its ops one at a time in trace "
            f"order (`serialize_ops`: one stream per device, as on an accelerator), so "
            f"the speed-up comes only from devices overlapping; cpu/wall shows how many "
            f"cores were busy. K=4 on 2 cores is bounded by the cores.",
            throughput_table(rows),
        ]
    if "overhead" in results:
        parts += ["#### Overhead: tfpipe at K=1, M=1 vs plain Keras (`benchmarks/overhead.py`)",
                  overhead_table(results["overhead"])]
    if "trace" in results:
        trace = results["trace"]
        parts += [
            "#### Trace and first-call time (`benchmarks/schedules.py`)",
            f"{trace['model']['layers']} x Dense({trace['model']['width']}), batch "
            f"{trace['model']['batch']}, recompute=always, GPipe schedule. *Trace* is "
            f"`get_concrete_function` of the train step; *first call* adds graph "
            f"optimisation and one step; ops count the step's graph including nested "
            f"function bodies (the loop's while body and branches). Each cell: trace s / "
            f"first call s / ops. Trace time, largest M / smallest M: "
            + "; ".join(f"{e} " + ", ".join(f"K={k}: {v:.2f}" for k, v in g.items())
                        for e, g in trace.get("trace_growth", {
                            "loop": trace["loop_trace_growth"]}).items())
            + ".",
            schedules.trace_pivot_table(trace["rows"]),
        ]
    return "\n\n".join(parts) + "\n"


# -- main -------------------------------------------------------------------------------


def run_suite(suite, only=SECTIONS, out_dir=common.RESULTS_DIR, build_md=None,
              suites=None, log=print):
    """Runs the sections of `suite`; writes JSON, PNGs and (optionally) BUILD.md."""
    config = (suites or SUITES)[suite]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        raise ValueError(f"Unknown sections {unknown}; choose from {list(SECTIONS)}.")
    info = common.machine()
    log(f"suite {suite} on {common.machine_label(info)}; load average "
        f"{info['load_average_at_start']}")
    start = time.perf_counter()
    results, walls = {}, {}
    for section in SECTIONS:
        if section not in only:
            continue
        log(f"== {section}")
        t0 = time.perf_counter()
        results[section] = RUNNERS[section](config[section], log=log)
        walls[section] = time.perf_counter() - t0
        log(f"   {section}: {walls[section]:.0f} s")
    wall = time.perf_counter() - start
    out_dir = pathlib.Path(out_dir)
    data = {"suite": suite, "machine": info, "config": config, "results": results,
            "wall_s": wall, "section_wall_s": walls}
    paths = [common.write_json(out_dir / f"suite_{suite}.json", data)]
    label = common.machine_label(info)
    if "memory" in results:
        paths.append(memory.plot_memory(results["memory"],
                                        out_dir / f"suite_{suite}_memory.png", label))
    if "throughput" in results or "trace" in results:
        paths.append(schedules.plot(
            results.get("throughput", {}).get("rows", []),
            results.get("trace", {}).get("rows", []),
            out_dir / f"suite_{suite}_throughput_trace.png", label))
    text = markdown(results, info, suite, wall, out_dir)
    if build_md:
        common.rewrite_build_md(build_md, text)
        paths.append(pathlib.Path(build_md))
    log(text)
    log("wrote " + ", ".join(str(p) for p in paths) + f" in {wall / 60:.1f} min")
    return data


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    run_suite(f.suite, f.only, f.out_dir, f.build_md or None)


def _define_flags():
    # Defined only when run as a script, so that importing this module (tests)
    # adds no flags to the importer's absl FLAGS.
    flags.DEFINE_enum("suite", "quick", list(SUITES), "Which configuration set to run.")
    flags.DEFINE_list("only", list(SECTIONS), f"Sections to run, from {list(SECTIONS)}.")
    flags.DEFINE_string("out_dir", str(common.RESULTS_DIR), "Where JSON and PNG files go.")
    flags.DEFINE_string("build_md", str(common.REPO_ROOT / "BUILD.md"),
                        "Markdown file whose marked section gets the tables (empty: none).")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
