"""What the benchmarks share: fresh child processes, the machine label, peak RSS, tables.

Every measured configuration runs in its own child process (`run_child`), so
that the thread-pool sizes and the number of logical CPU devices are set
before TensorFlow initialises, and so that each child's peak memory is its own.
A child is this module run as a script:

    python -m benchmarks.common '{"target": "benchmarks.schedules:measure_step",
                                  "intra_op": 1, "inter_op": 2, "devices": 2,
                                  "kwargs": {...}}'

It sets the threads and devices, imports the target function, calls it with
`kwargs` and prints its dict as one JSON line after `RESULT_MARKER`; the parent
reads that line. A child that raises, dies or runs over its time or memory
limit comes back as a dict with an "error" key instead, so a suite keeps going.

Also here: `machine()` (the label every absolute time carries), `peak_rss_mib()`
(VmHWM from /proc/self/status), the plain MLP used by the benchmarks,
`markdown_table` and `replace_section` (rewrites BUILD.md between markers).
"""

import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import threading
import time
import traceback

RESULT_MARKER = "@@tfpipe-benchmark-result@@ "
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
BEGIN_MARKER = "<!-- benchmarks:begin -->"
END_MARKER = "<!-- benchmarks:end -->"


# -- the machine ----------------------------------------------------------------


def _cpu_model():
    name = platform.processor()
    if name and name != platform.machine():
        return name
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name or platform.machine() or "unknown CPU"


def usable_cores():
    """CPU cores this process may run on (affinity), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine():
    """The label for absolute numbers: CPU, core counts, versions, date."""
    versions = {"python": platform.python_version()}
    for name in ("tensorflow", "keras"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = module.__version__
        else:
            try:
                from importlib import metadata  # pylint: disable=import-outside-toplevel
                dist = "tensorflow-cpu" if name == "tensorflow" else name
                versions[name] = metadata.version(dist)
            except Exception:  # pylint: disable=broad-except
                pass
    return {
        "processor": _cpu_model(),
        "platform_processor": platform.processor(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "system": platform.system(),
        "versions": versions,
        "date": datetime.date.today().isoformat(),
        "load_average_at_start": _loadavg(),
    }


def machine_label(info=None):
    """One line: e.g. "AMD EPYC (x86_64), 2 cores, TF 2.21.0, Keras 3.15.1"."""
    info = info or machine()
    v = info.get("versions", {})
    return (f"{info['processor']} ({info['machine']}), {info['usable_cores']} usable of "
            f"{info['cpu_count']} cores, TF {v.get('tensorflow', '?')}, "
            f"Keras {v.get('keras', '?')}")


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


# -- memory -------------------------------------------------------------------------


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
    """This process's peak resident set (VmHWM), MiB; ru_maxrss where no /proc."""
    value = _status_mib("VmHWM")
    if value is None:
        import resource  # pylint: disable=import-outside-toplevel
        value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return value


def rss_mib():
    """This process's current resident set (VmRSS), MiB."""
    return _status_mib("VmRSS")


# -- tfpipe.schedules without TensorFlow -------------------------------------------


def schedules_module():
    """`tfpipe.schedules` (pure Python), without importing TensorFlow here.

    `import tfpipe.schedules` runs `tfpipe/__init__`, which imports TensorFlow;
    the parent of the child processes only needs the schedule arithmetic, so
    where TensorFlow is not loaded yet the module is loaded from its file.
    """
    if "tfpipe" in sys.modules or "tensorflow" in sys.modules:
        import tfpipe.schedules  # pylint: disable=import-outside-toplevel
        return tfpipe.schedules
    name = "_tfpipe_schedules_standalone"
    if name not in sys.modules:
        import importlib.util  # pylint: disable=import-outside-toplevel
        spec = importlib.util.spec_from_file_location(
            name, REPO_ROOT / "tfpipe" / "schedules.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# -- child processes -------------------------------------------------------------


def error_line(result):
    """The last line of a child's "error" (its exception's message), or None
    where the child succeeded."""
    if "error" not in result:
        return None
    lines = str(result["error"]).strip().splitlines()
    return lines[-1] if lines else ""


def run_child(target, kwargs=None, *, intra_op=1, inter_op=1, devices=1, timeout=1200,
              rss_limit_mib=None, env=None):
    """Runs `target(**kwargs)` in a fresh Python process; returns its dict.

    Args:
      target: "module:function", e.g. "benchmarks.schedules:measure_step".
      kwargs: JSON-serialisable keyword arguments.
      intra_op, inter_op: TensorFlow thread-pool sizes, set before it initialises.
      devices: logical CPU devices (`tfpipe.testing.use_logical_cpus`).
      timeout: seconds before the child is killed.
      rss_limit_mib: if given, the child is killed once its resident set
        exceeds this (polled every 50 ms); the result then has
        "error": "rss_limit" and "rss_limit_mib".
      env: extra environment variables for the child.
    Returns:
      The child's result dict with "child_wall_s" added, or
      {"error": ..., "stderr_tail": ...} when the child failed.
    """
    payload = {"target": target, "kwargs": kwargs or {}, "intra_op": intra_op,
               "inter_op": inter_op, "devices": devices}
    env = dict(os.environ, **(env or {}))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join(
        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []) + [str(REPO_ROOT)])
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
                    killed["rss_mib"] = rss
                    proc.kill()
                    return
                time.sleep(0.05)
        threading.Thread(target=watch, daemon=True).start()
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        killed["timeout_s"] = timeout
    wall = time.perf_counter() - start
    result = None
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER):])
    if killed.get("rss_mib") is not None:
        return {"error": "rss_limit", "rss_limit_mib": rss_limit_mib,
                "rss_at_kill_mib": killed["rss_mib"], "child_wall_s": wall}
    if killed.get("timeout_s") is not None:
        return {"error": "timeout", "timeout_s": timeout, "child_wall_s": wall,
                "stderr_tail": stderr[-2000:]}
    if result is None or proc.returncode:
        result = dict(result or {})
        result.setdefault("error", f"child exited with {proc.returncode}")
        result["stderr_tail"] = stderr[-3000:]
    result["child_wall_s"] = wall
    return result


def _child_main(payload):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    # Before any op initialises the runtime: thread pools, then devices.
    tf.config.threading.set_intra_op_parallelism_threads(payload["intra_op"])
    tf.config.threading.set_inter_op_parallelism_threads(payload["inter_op"])
    import tfpipe  # pylint: disable=import-outside-toplevel
    tfpipe.testing.use_logical_cpus(payload["devices"])
    module_name, function_name = payload["target"].split(":")
    import importlib  # pylint: disable=import-outside-toplevel
    function = getattr(importlib.import_module(module_name), function_name)
    try:
        result = function(**payload["kwargs"])
    except Exception:  # pylint: disable=broad-except
        result = {"error": traceback.format_exc()[-3000:]}
        print(RESULT_MARKER + json.dumps(result), flush=True)
        sys.exit(1)
    result.setdefault("threads", {"intra_op": payload["intra_op"],
                                  "inter_op": payload["inter_op"]})
    print(RESULT_MARKER + json.dumps(result), flush=True)


# -- the model ---------------------------------------------------------------------


def mlp_layers(count, width, activation="relu"):
    """`count` Dense(width) layers: equal cost, so any equal cut gives equal stages."""
    import keras  # pylint: disable=import-outside-toplevel
    return [keras.layers.Dense(width, activation=activation) for _ in range(count)]


def random_batch(batch, width, seed=0):
    """(x, y): float32 (batch, width) inputs and regression targets."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    gen = tf.random.Generator.from_seed(seed)
    return gen.normal((batch, width)), gen.normal((batch, width))


def count_ops(concrete):
    """(ops in the step's graph, ops including every nested function body)."""
    graph_def = concrete.graph.as_graph_def()
    nested = sum(len(f.node_def) for f in graph_def.library.function)
    return len(graph_def.node), len(graph_def.node) + nested


# -- tables and BUILD.md ---------------------------------------------------------


def fmt(value, digits=2):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers, rows):
    """A GitHub markdown table; cells are formatted with `fmt`."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in row) + " |")
    return "\n".join(lines)


def replace_section(text, body, begin=BEGIN_MARKER, end=END_MARKER):
    """`text` with what lies between the markers replaced by `body`.

    The markers themselves stay. Raises ValueError if they are missing, out
    of order or there twice.
    """
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"Expected exactly one {begin!r} and one {end!r}; found "
                         f"{text.count(begin)} and {text.count(end)}.")
    head, rest = text.split(begin)
    middle, tail = rest.split(end) if end in rest else (None, None)
    if middle is None:
        raise ValueError(f"{end!r} comes before {begin!r}.")
    return head + begin + "\n" + body.strip("\n") + "\n" + end + tail


def rewrite_build_md(path, body):
    path = pathlib.Path(path)
    path.write_text(replace_section(path.read_text(), body))


def write_json(path, data):
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def parse_ints(text):
    """"1,2,4" -> [1, 2, 4]."""
    return [int(part) for part in str(text).split(",") if part.strip()]


def median(values):
    import statistics  # pylint: disable=import-outside-toplevel
    return statistics.median(values) if values else None


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
