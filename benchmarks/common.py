"""What the benchmarks share: child processes, other trees, the machine label, tables.

Every measured configuration runs in its own child process (`run_child`), so
that the thread-pool sizes and the number of logical CPU devices are set
before TensorFlow initialises, and so that each child's peak memory is its own.
A child is this module run as a script:

    python -m benchmarks.common '{"target": "benchmarks.speedup:measure",
                                  "intra_op": 1, "inter_op": 2, "devices": 2,
                                  "tree": null, "kwargs": {...}}'

It sets the threads, puts "tree" (another checkout of the repository, for a
before/after comparison) first on sys.path so that `tfpipe` is imported from
there, makes the devices, calls the target with `kwargs` and prints its dict as
one JSON line after `RESULT_MARKER`. A child that raises, dies or runs over its
time or memory limit comes back as a dict with an "error" key (the exception's
last line) instead, so a run keeps going.

Older trees spell two things differently; `call_scope` and `serialize_ops` take
either spelling, so the same measurement runs against both.
"""

import contextlib
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback

RESULT_MARKER = "@@tfpipe-benchmark-result@@ "
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


# -- the machine ----------------------------------------------------------------------


def machine():
    """The label every absolute number carries: CPU, cores, versions, date, load."""
    from importlib import metadata  # pylint: disable=import-outside-toplevel
    processor = platform.processor()
    try:
        processor = next(line.split(":", 1)[1].strip() for line in
                         pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                         if line.lower().startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = {"python": platform.python_version()}
    for name, dists in (("tensorflow", ("tensorflow", "tensorflow-cpu")), ("keras", ("keras",))):
        for dist in dists:
            with contextlib.suppress(metadata.PackageNotFoundError):
                versions[name] = metadata.version(dist)
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"processor": processor or platform.machine(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "versions": versions, "date": datetime.date.today().isoformat(),
            "load_average_at_start": load}


def machine_label(info):
    """One line, e.g. "AMD EPYC (x86_64), 2 usable of 2 cores, TF 2.21.0, Keras 3.15.1"."""
    v = info["versions"]
    return (f"{info['processor']} ({info['machine']}), {info['usable_cores']} usable of "
            f"{info['cpu_count']} cores, TF {v.get('tensorflow', '?')}, "
            f"Keras {v.get('keras', '?')}; load average {info['load_average_at_start']}")


# -- memory -------------------------------------------------------------------------------


def _status_mib(field, pid="self"):
    """A `Vm*` field of /proc/<pid>/status in MiB, or None where there is none."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        return None
    return None


def peak_rss_mib():
    """This process's peak resident set since start or the last reset (VmHWM), MiB."""
    return _status_mib("VmHWM")


def rss_mib():
    """This process's current resident set (VmRSS), MiB."""
    return _status_mib("VmRSS")


# -- other trees ----------------------------------------------------------------------


def parse_trees(values, current="new"):
    """`--tree` values ("LABEL=PATH" or "PATH", each possibly comma-separated)
    -> [(label, path)], the current checkout first as (current, None).

    Raises ValueError naming a value that is no checkout of tfpipe, or a label
    used twice.
    """
    trees = [(current, None)]
    for item in (part.strip() for value in values for part in value.split(",")):
        if not item:
            continue
        label, _, path = item.rpartition("=")
        path = pathlib.Path(path).expanduser().resolve()
        label = label or path.name
        if not (path / "tfpipe" / "__init__.py").is_file():
            raise ValueError(f"--tree={item!r}: {path} holds no tfpipe/__init__.py; pass a "
                             f"checkout of the repository, e.g. --tree=old=/work/base")
        if label in dict(trees):
            raise ValueError(f"--tree={item!r}: the label {label!r} is taken; name it, "
                             f"e.g. --tree=old={path}")
        trees.append((label, str(path)))
    return trees


def interleave(configs, trees):
    """[(config, (label, path))]: every tree per configuration, the tree that
    goes first alternating by configuration (A, B, B, A, A, B, ...), so drift
    over the run and any advantage of going first fall on both alike (with A
    always first, A's steps measured 2-4% slower than B's on identical graphs:
    `speedup_*_vs_9248c88*.json`)."""
    return [(config, tree) for n, config in enumerate(configs)
            for tree in (trees if n % 2 == 0 else trees[::-1])]


def add_tree_ratios(rows, key, fields):
    """Each row of another tree than the first row's gets, per field, the first
    tree's value over its own at the same `key(row)`: "<field>_vs_tree"."""
    current = rows[0]["tree"] if rows else None
    mine = {key(r): r for r in rows if r["tree"] == current and "error" not in r}
    for row in rows:
        base = mine.get(key(row))
        if row["tree"] != current and base and "error" not in row:
            row.update({f"{f}_vs_tree": base[f] / row[f] for f in fields})
    return rows


def tree_table(columns, rows, ratios):
    """`markdown_table`, with a tree column and `ratios` ((header, field) of
    `add_tree_ratios`) where the rows come from several trees."""
    if len({r["tree"] for r in rows}) > 1:
        current = rows[0]["tree"]
        columns = [("tree", "tree", 0)] + columns + [
            (f"{current}/tree {header}", f"{field}_vs_tree", 3) for header, field in ratios]
    return markdown_table(columns, rows)


def call_scope(model):
    """The context a step of `model` is traced and called in, as Keras' fit
    does: tfpipe's call scope for a pipelined model (`tfpipe.stage.call_scope(
    traits)`; older trees: `tfpipe.runtime.call_scope(execution)`), none for
    plain Keras."""
    import tfpipe  # pylint: disable=import-outside-toplevel
    if not isinstance(model, tfpipe.PipelinedModel):
        return contextlib.nullcontext()
    if hasattr(getattr(tfpipe, "stage", None), "call_scope"):
        return tfpipe.stage.call_scope(model.pipeline_config.traits)
    return tfpipe.runtime.call_scope(model.execution)


def serialize_ops(model):
    """Each device of `model` runs its ops one at a time in trace order: one
    stream per device, as on an accelerator (older trees: an engine attribute)."""
    if hasattr(model, "set_trace_options"):
        model.set_trace_options(serialize_ops=True)
    else:
        model.pipeline.serialize_ops = True


def step_function(model):
    """`model`'s training step as Keras' fit traces it: a tf.function without
    AutoGraph (it would convert tfpipe's own Python, which fit never does);
    trace and call it inside `call_scope(model)`."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return tf.function(lambda x, y: model.train_step((x, y)), autograph=False)


# -- child processes ------------------------------------------------------------------


def error_line(result):
    """The last line of a child's "error" (its exception), or None where it succeeded."""
    if "error" not in result:
        return None
    lines = str(result["error"]).strip().splitlines()
    return lines[-1] if lines else ""


def run_child(target, kwargs=None, *, intra_op=1, inter_op=1, devices=1, tree=None,
              timeout=1800, rss_limit_mib=None, env=None):
    """Runs `target(**kwargs)` in a fresh Python process; returns its dict.

    Args:
      target: "module:function" of this repository, e.g. "benchmarks.speedup:measure".
      kwargs: JSON-serialisable keyword arguments.
      intra_op, inter_op: TensorFlow thread-pool sizes, set before it initialises.
      devices: logical CPU devices (`tfpipe.testing.use_logical_cpus`).
      tree: another checkout to import `tfpipe` from (None: this one).
      timeout: seconds before the child is killed.
      rss_limit_mib: the child is killed once its resident set exceeds this
        (polled every 50 ms); the result is then {"error": "rss_limit", ...}.
      env: extra environment variables.
    Returns:
      The child's dict with "child_wall_s", or {"error": ..., "stderr_tail": ...}.
    """
    payload = {"target": target, "kwargs": kwargs or {}, "intra_op": intra_op,
               "inter_op": inter_op, "devices": devices, "tree": tree}
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.common", json.dumps(payload)],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    killed = {}
    if rss_limit_mib is not None:
        def watch():
            while proc.poll() is None:
                rss = _status_mib("VmRSS", proc.pid)
                if rss is not None and rss > rss_limit_mib:
                    killed["error"] = "rss_limit"
                    proc.kill()
                    return
                time.sleep(0.05)
        threading.Thread(target=watch, daemon=True).start()
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        killed["error"] = f"timeout after {timeout} s"
    result = {}
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER):])
    if killed:
        result = dict(killed, rss_limit_mib=rss_limit_mib)
    elif not result or proc.returncode:
        result.setdefault("error", f"child exited with {proc.returncode}")
        result["stderr_tail"] = stderr[-3000:]
    result["child_wall_s"] = time.perf_counter() - start
    return result


def _child_main(payload):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    # Before any op initialises the runtime: thread pools, then devices.
    tf.config.threading.set_intra_op_parallelism_threads(payload["intra_op"])
    tf.config.threading.set_inter_op_parallelism_threads(payload["inter_op"])
    tree = payload.get("tree")
    if tree:
        sys.path.insert(0, tree)  # before the editable install's finder
    import tfpipe  # pylint: disable=import-outside-toplevel
    try:
        if tree and not pathlib.Path(tfpipe.__file__).resolve().is_relative_to(tree):
            raise RuntimeError(f"tfpipe came from {tfpipe.__file__}, not from {tree}")
        tfpipe.testing.use_logical_cpus(payload["devices"])
        module_name, function_name = payload["target"].split(":")
        import importlib  # pylint: disable=import-outside-toplevel
        function = getattr(importlib.import_module(module_name), function_name)
        result = function(**payload["kwargs"])
    except Exception:  # pylint: disable=broad-except
        print(RESULT_MARKER + json.dumps({"error": traceback.format_exc()[-3000:]}), flush=True)
        sys.exit(1)
    result["tfpipe_file"] = tfpipe.__file__
    print(RESULT_MARKER + json.dumps(result), flush=True)


# -- models, timing ---------------------------------------------------------------------


def mlp_layers(count, width):
    """`count` Dense(width, relu) layers: equal cost, so an equal cut gives equal stages."""
    import keras  # pylint: disable=import-outside-toplevel
    return [keras.layers.Dense(width, activation="relu") for _ in range(count)]


def alternate(runs, repeats):
    """Calls each of `runs` ({name: function returning a time}) `repeats` times,
    rotating which goes first each round; {name: [time, ...]}."""
    names, out = list(runs), {name: [] for name in runs}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(runs[name]())
    return out


def median(values):
    return statistics.median(values) if values else None


# -- the prepared device checks (gpu_check, tpu_check) ------------------------------------


def twin(model):
    """A plain Keras copy of `model` with the same weights."""
    import keras  # pylint: disable=import-outside-toplevel
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    return copy


def step_ms(model, x, y, repeats):
    """Median ms of one `train_on_batch` after two warm-up steps."""
    for _ in range(2):
        model.train_on_batch(x, y)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append((time.perf_counter() - start) * 1e3)
    return median(times)


def not_run(check, output, reason):
    """A device check without its device: says why, writes {"ran": false,
    "reason": ...} to `output`; returns the exit status, 0."""
    print(f"{check}: not run: {reason}.")
    write_json(output, {"ran": False, "reason": reason})
    return 0


# -- tables and files ---------------------------------------------------------------------


def fmt(value, digits=2):
    """A table cell: "-" for None, floats to `digits` places (or a format spec)."""
    if value is None:
        return "-"
    if isinstance(digits, str):
        return format(value, digits)
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(columns, rows):
    """A GitHub markdown table of dict rows; `columns`: (header, key, digits or spec).

    A row with an "error" shows it in place of its missing cells.
    """
    lines = ["| " + " | ".join(c[0] for c in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [fmt(row.get(key), digits) for _, key, digits in columns]
        if row.get("error"):
            cells[-1] = "error: " + row["error"].replace("|", "\\|")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path, data):
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def two_stage_pipeline(model, mlp_layers, **settings):
    """(compiled `PipelinedModel` on /CPU:0 and /CPU:1, (x spec, y spec) of a
    batch of 16): the MLP made of `mlp_layers` (input width 8, mean squared
    error on 4 outputs), or a 2-block transformer (width 16, sequence 8) cut
    [2, 3]. `settings`: the `PipelineStrategy`'s. For the counting and tracing
    benchmarks (`module_changes`, `step_graphs`)."""
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    from models import transformer_lm  # pylint: disable=import-outside-toplevel
    strategy = tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"], **settings)
    with strategy.scope():
        if model == "mlp":
            pipelined = tfpipe.PipelinedModel(mlp_layers, input_shape=(None, 8))
            pipelined.compile(optimizer="adam", loss="mse")
            return pipelined, (tf.TensorSpec([16, 8], tf.float32),
                               tf.TensorSpec([16, 4], tf.float32))
        pipelined = tfpipe.PipelinedModel.from_model(transformer_lm.transformer_lm(
            num_layers=2, width=16, num_heads=2, seq_len=8), balance=[2, 3])
        pipelined.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
    return pipelined, (tf.TensorSpec([16, 8], tf.int32), tf.TensorSpec([16, 8], tf.int32))


def begin(argv):
    """A benchmark's main starts: no stray arguments; prints the machine.
    Returns (the machine, the start time)."""
    from absl import app  # pylint: disable=import-outside-toplevel
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    info = machine()
    print(f"machine: {machine_label(info)}")
    return info, time.perf_counter()


def finish(out, info, start, rows, caption, table, **extra):
    """Writes the run to `out` (JSON: machine, `extra`, rows, wall time) and
    prints the caption, the table and where it went."""
    path = write_json(out, {"machine": info, **extra, "rows": rows,
                            "wall_s": time.perf_counter() - start})
    print(f"\n{caption}; {machine_label(info)}\n\n{table}\n\nwrote {path}")


def list_validator(flag, ok, expected):
    """An absl validator: every item of list flag `flag` passes `ok`; else the
    error names the first that does not ("--flag: 'x' is not <expected>")."""
    from absl import flags  # pylint: disable=import-outside-toplevel

    def check(values):
        bad = [value for value in values if not ok(value)]
        if bad:
            raise flags.ValidationError(f"--{flag}: {bad[0]!r} is not {expected}")
        return True
    flags.register_validator(flag, check)


def positive_ints(flag):
    list_validator(flag, lambda v: v.isdigit() and int(v) >= 1, "an integer >= 1")


def one_of(flag, choices):
    list_validator(flag, choices.__contains__, f"one of {', '.join(choices)}")


def define_tree_flags():
    """`--tree` (another checkout to measure beside this one) and `--label`."""
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_multi_string("tree", [], "Another checkout to run the same measurement "
                              "against, LABEL=PATH or PATH (label: its folder's name); "
                              "repeatable or comma-separated.")
    flags.DEFINE_string("label", "new", "The label of this checkout's rows.")

    def check(values):
        try:
            parse_trees(values["tree"], values["label"])
        except ValueError as e:
            raise flags.ValidationError(str(e)) from None
        return True
    flags.register_multi_flags_validator(["tree", "label"], check)


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
