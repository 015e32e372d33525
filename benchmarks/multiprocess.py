"""Stages on worker processes vs on local logical CPUs: `python -m benchmarks.multiprocess`.

The same 2-stage pipeline is trained twice over, in two child processes that
run side by side and take turns:

  remote  the client of a `tfpipe.cluster.LocalCluster(2)`: stage k on
          `/job:worker/task:k/device:CPU:0`, a worker process each
          (`launch.train --cluster=local:2`)
  local   one process with 2 logical CPUs: stage k on `/CPU:k`
          (`launch.train --logical_cpus=2`)

Model: `--layers` Dense(`--width`, relu) layers cut into 2 equal stages, input
width `--width`, MSE against random targets, Adam(1e-4), one batch of
`--batch` rows repeated; GPipe, unrolled, `recompute="never"`; one row per M
in `--microbatches`. Defaults are issue 12's size: width 1024, batch 256,
M = 1 and 4.

Method. Each child builds one model per M and warms it up with `--warmup`
steps of `fit` (tracing, first RPCs), then waits. The parent sends "run M
steps" to one child at a time, alternating which side goes first each round,
so both sides see the same machine load; `--repeats` rounds. A callback times
every step from on_train_batch_begin to on_train_batch_end (the client's
view, Keras' `fit` and its tf.data input included); a run's time is the mean
of its steps and the reported time the median over runs. The ratio is
remote / local; goal <= 1.3.

Where the remote run spends its extra time, two ways:
- CPU: each run also reports the CPU milliseconds per step of every process
  (the local process; the client and both workers), from the first step's
  begin to the last step's end, and of it those of gRPC's `event_engine`
  threads, which send, receive and (de)serialise tensors between processes
  ("cpu_ms_per_step"; /proc counts in 10 ms ticks, so few steps read coarse).
- Placement: before its runs the remote child traces the step as `fit` does
  (`strategy.run(train_step)`), logs the placer's decisions for one call
  (`tf.debugging.set_log_device_placement`), counts the ops placed on the
  client (`/job:localhost`) by type and by the code that made them
  ("client_ops"), and puts the weights and optimizer state back. An op with
  no device in the traced graph is not necessarily on the client: the placer
  puts a variable read next to its variable, so only its log says what runs
  where.

Processes. Every worker binds a port picked on 127.0.0.1 (TensorFlow's server
itself listens on all interfaces; see BUILD.md, "Several hosts"). Each child
runs in its own session; it exits when its stdin closes (the parent gone), and
its workers when it is gone or their time limit passes. The parent waits for
every answer at most `--timeout_s`, kills both children's process groups at
the end whatever happened, and reports any worker process still alive
("workers_left", which must be empty).

    python -m benchmarks.multiprocess                             # ~2 min on 2 cores
    python -m benchmarks.multiprocess --quick --out=/tmp/m.json   # a smoke run, ~40 s
"""

import collections
import ctypes
import json
import os
import pathlib
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads: quieter logs

from absl import app
from absl import flags

from benchmarks import common

FLAGS = flags.FLAGS
flags.DEFINE_string("microbatches", "1,4", "Micro-batch counts M, one row each.")
flags.DEFINE_integer("width", 1024, "Dense layer width (and input width).")
flags.DEFINE_integer("batch", 256, "Rows per step.")
flags.DEFINE_integer("layers", 4, "Dense layers, cut into 2 equal stages (even).")
flags.DEFINE_integer("steps", 20, "Timed steps per run.")
flags.DEFINE_integer("repeats", 5, "Runs per side and M, alternating which side goes first.")
flags.DEFINE_integer("warmup", 3, "Untimed steps per model before the runs (the first traces).")
flags.DEFINE_bool("count_ops", True, "Count the train step's client-placed ops (remote side).")
flags.DEFINE_bool("quick", False,
                  "A smoke run: width 64, batch 32, 2 layers, M=1,2, 3 steps, 2 repeats, "
                  "1 warm-up step (overrides those flags).")
flags.DEFINE_float("timeout_s", 600.0,
                   "Seconds to wait for any one answer of a child (start-up included); "
                   "past it the children are killed and the run fails.")
flags.DEFINE_float("time_limit_s", 1800.0,
                   "Seconds after which the workers exit by themselves (a bound should "
                   "everything else fail; they also exit when their client is gone).")
flags.DEFINE_string("out", str(common.RESULTS_DIR / "multiprocess.json"),
                    "Where to write the result as JSON; a markdown table goes next to it "
                    "(.md).")
flags.DEFINE_string("note", "",
                    "Recorded in the result: what the code under test is, if not the "
                    "commit (e.g. an uncommitted change being measured).")
flags.DEFINE_enum("child", None, ["remote", "local"], "Internal: run as one side's child.")
flags.DEFINE_string("config", None, "Internal: the child's configuration as JSON.")

GOAL = 1.3
SIDES = ("local", "remote")
QUICK = {"width": 64, "batch": 32, "layers": 2, "microbatches": [1, 2], "steps": 3,
         "repeats": 2, "warmup": 1}
CLIENT = "/job:localhost/"  # the client's device prefix on a connected process


# -- the child: one side, its models, timed on request ------------------------------------


def _build(devices, num_microbatches, layers, width, seed=0):
    import keras  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(seed)
    strategy = tfpipe.PipelineStrategy(devices=devices, num_microbatches=num_microbatches,
                                       recompute="never")
    with strategy.scope():
        model = tfpipe.PipelinedModel(
            [keras.Sequential(common.mlp_layers(layers // 2, width), name=f"stage_{k}")
             for k in range(2)], input_shape=(None, width))
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model


def _step_timer(steps, processes):
    """A Keras callback that records each step's seconds (batch begin to end)
    and the CPU seconds of `processes` ({name: pid}) from the first step's
    begin to the last step's end (`cpu_seconds` snapshots, taken outside the
    timed spans; fit's own set-up before the first step is left out)."""
    import keras  # pylint: disable=import-outside-toplevel

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self._start, self.cpu_first, self.cpu_last = [], None, None, None

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                self.cpu_first = {n: cpu_seconds(p) for n, p in processes.items()}
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self._start)
            if batch == steps - 1:
                self.cpu_last = {n: cpu_seconds(p) for n, p in processes.items()}

    return StepTimer()


class _Side:
    """The models of one side (one per M) and their data."""

    def __init__(self, devices, config):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        x, y = common.random_batch(config["batch"], config["width"])
        self.dataset = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(2)
        self.x, self.y = x, y
        self.models = {m: _build(devices, m, config["layers"], config["width"])
                       for m in config["microbatches"]}
        for model in self.models.values():
            self.run(model, config["warmup"], {})

    def run(self, model, steps, processes):
        """(mean step ms, last loss, CPU ms per step of each of `processes`
        ({name: pid}), {name: {"total": ms, "grpc": ms}}) of one `fit` of
        `steps` steps."""
        timer = _step_timer(steps, processes)
        history = model.fit(self.dataset, steps_per_epoch=steps, epochs=1, verbose=0,
                            callbacks=[timer], shuffle=False)
        cpu = {name: {part: 1000.0 * (spent - timer.cpu_first[name][part]) / steps
                      for part, spent in timer.cpu_last[name].items()}
               for name in processes}
        return (1000.0 * statistics.fmean(timer.times), float(history.history["loss"][-1]),
                cpu)


def cpu_seconds(pid):
    """{"total": CPU seconds (user + system) of process `pid` so far, "grpc":
    those of its gRPC threads (named event_engine*: sending, receiving and
    (de)serialising tensors)}."""
    total = grpc = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        total += seconds
        if name.startswith("event_engine"):
            grpc += seconds
    return {"total": total, "grpc": grpc}


class PlacementLog:
    """The placer's decisions, which TensorFlow prints with printf on file
    descriptor 1 once `tf.debugging.set_log_device_placement(True)` is on.

    That switch must be on before the first function of the process is
    placed (set later, it is ignored), so `start()` turns it on and diverts
    descriptor 1 to a temporary file for the rest of the process; `out` is a
    text stream on the original stdout, for the child's answers. C stdio
    buffers the file, so `read_since` flushes it first.
    """

    def __init__(self):
        self.file = tempfile.TemporaryFile("w+")
        sys.stdout.flush()
        self.out = os.fdopen(os.dup(1), "w")
        os.dup2(self.file.fileno(), 1)

    @staticmethod
    def start():
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        tf.debugging.set_log_device_placement(True)

    def offset(self):
        ctypes.CDLL(None).fflush(None)
        return os.fstat(self.file.fileno()).st_size

    def read_since(self, offset):
        ctypes.CDLL(None).fflush(None)
        with open(f"/proc/self/fd/{self.file.fileno()}") as f:
            f.seek(offset)
            return f.read()


def client_ops(model, x, y, log):
    """Where the ops of one traced `train_step` run, from the placer's own log.

    Returns {"total": ops placed, "client": ops on /job:localhost,
    "client_by_type": {op type: count}, "client_by_origin": {name scope's
    first part: count}, "client_names": [op name, ...]}. Arguments (_Arg,
    _Retval) are left out: they are the function's interface, not work.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    # As Keras' fit calls it: inside the strategy's replica context, where the
    # optimizer's gradient all-reduce runs.
    fn = tf.function(lambda a, b: model.distribute_strategy.run(model.train_step,
                                                                args=((a, b),)))
    concrete = fn.get_concrete_function(tf.TensorSpec(x.shape, x.dtype),
                                        tf.TensorSpec(y.shape, y.dtype))
    # The call trains one step; put the weights and the optimizer's state back,
    # so both sides still train the same steps (their losses stay comparable).
    state = model.weights + model.optimizer.variables
    saved = [v.numpy() for v in state]
    start = log.offset()
    concrete(x, y)  # placed at its first call
    text = log.read_since(start)
    for v, value in zip(state, saved):
        v.assign(value)
    placed = {}
    for match in re.finditer(r"^(\S+): \((\w+)\): (\S+)$", text, re.M):
        name, kind, device = match.groups()
        if kind not in ("_Arg", "_Retval"):
            placed[name] = (kind, device)
    on_client = {n: k for n, (k, d) in placed.items() if d.startswith(CLIENT)}
    origins = collections.Counter(_origin(n) for n in on_client)
    return {
        "total": len(placed), "client": len(on_client),
        "client_by_type": dict(collections.Counter(on_client.values()).most_common()),
        "client_by_origin": dict(origins.most_common()),
        "client_names": sorted(on_client),
    }


def _origin(name):
    """The code that made an op, from its name: its first name scope, or, for a
    top-level op, its name without the numeric suffix ("strided_slice_3" ->
    "strided_slice")."""
    head = name.split("/", 1)[0]
    return head if "/" in name else re.sub(r"_\d+$", "", head)


def _child(side, config):
    """One side: builds, warms up, says READY, then answers "run M STEPS" lines
    on stdin with "TIME ms loss" until "quit" or the end of stdin."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    from tfpipe import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
    import contextlib  # pylint: disable=import-outside-toplevel
    log = PlacementLog() if side == "remote" and config["count_ops"] else None
    out = log.out if log else sys.stdout
    with contextlib.ExitStack() as stack:
        if side == "remote":
            local = stack.enter_context(
                cluster_lib.LocalCluster(2, time_limit_s=config["time_limit_s"]))
            print("WORKERS " + json.dumps(local.pids), file=out, flush=True)
            cluster_lib.connect(local)
            if log:
                log.start()
            devices = local.worker_devices()
            processes = {"client": os.getpid(), "task0": local.pids[0],
                         "task1": local.pids[1]}
        else:
            tfpipe.testing.use_logical_cpus(2)
            devices = ["/CPU:0", "/CPU:1"]
            processes = {"process": os.getpid()}
        start = time.perf_counter()
        built = _Side(devices, config)
        ready = {"devices": [str(d) for d in built.models[config["microbatches"][0]]
                             .stage_devices],
                 "build_and_warmup_s": time.perf_counter() - start,
                 "tensorflow": tf.__version__}
        if side == "remote" and config["count_ops"]:
            ready["client_ops"] = {str(m): client_ops(model, built.x, built.y, log)
                                   for m, model in built.models.items()}
            tf.debugging.set_log_device_placement(False)  # eager ops: no more log lines
        print("READY " + json.dumps(ready), file=out, flush=True)
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            m, steps = int(words[1]), int(words[2])
            ms, loss, cpu = built.run(built.models[m], steps, processes)
            print(f"TIME {json.dumps([ms, loss, cpu])}", file=out, flush=True)


# -- the parent: two children in turn ---------------------------------------------------


class _Child:
    """A child process of one side, its output lines read on a thread."""

    def __init__(self, side, config):
        self.side, self.lines, self.worker_pids = side, queue.Queue(), []
        self.err = []
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(common.REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.multiprocess", f"--child={side}",
             f"--config={json.dumps(config)}"],
            cwd=common.REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("WORKERS "):
                self.worker_pids = json.loads(line[len("WORKERS "):])
            self.lines.put(line)
        self.lines.put(None)  # end of output

    def expect(self, word, timeout_s):
        """The rest of the next line starting with `word`; RuntimeError with the
        child's stderr if it ends or takes longer than `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
                why = f"gave no {word} line within {timeout_s:g} s"
            else:
                why = f"ended (exit code {self.proc.poll()}) before a {word} line"
            if line is None:
                raise RuntimeError(f"The {self.side} child {why}. Its stderr:\n"
                                   f"{''.join(self.err)[-3000:]}")
            if line.startswith(word + " "):
                return line[len(word) + 1:].strip()

    def send(self, text):
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self, timeout_s=30.0):
        """Asks it to quit, then kills its process group whatever happened."""
        try:
            self.send("quit")
            self.proc.stdin.close()
            self.proc.wait(timeout=timeout_s)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def alive(pid):
    """Whether process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _median_cpu(runs):
    """{process: {part: median over runs}} of per-run CPU ms per step."""
    return {name: {part: statistics.median(run[name][part] for run in runs)
                   for part in runs[0][name]}
            for name in runs[0]}


def _git_head():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=common.REPO_ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None


def benchmark(config, timeout_s, note=""):
    """Runs both children in turn; returns the result dict (see the docstring)."""
    info = common.machine()
    children = {side: _Child(side, config) for side in SIDES}
    worker_pids = []
    try:
        ready = {side: json.loads(child.expect("READY", timeout_s))
                 for side, child in children.items()}
        worker_pids = children["remote"].worker_pids
        runs = {m: {side: [] for side in SIDES} for m in config["microbatches"]}
        cpus = {m: {side: [] for side in SIDES} for m in config["microbatches"]}
        losses = {m: {} for m in config["microbatches"]}
        for r in range(config["repeats"]):
            for m in config["microbatches"]:
                for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                    children[side].send(f"run {m} {config['steps']}")
                    ms, loss, cpu = json.loads(children[side].expect("TIME", timeout_s))
                    runs[m][side].append(ms)
                    cpus[m][side].append(cpu)
                    losses[m][side] = loss
    finally:
        for child in children.values():
            child.close()
        time.sleep(1.0)  # a worker whose parent went away exits within 0.5 s
        left = [p for p in worker_pids or children["remote"].worker_pids if alive(p)]
        for p in left:  # report them, and still never leave one behind
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    rows = []
    for m in config["microbatches"]:
        local_ms = statistics.median(runs[m]["local"])
        remote_ms = statistics.median(runs[m]["remote"])
        client = ready["remote"].get("client_ops", {}).get(str(m))
        rows.append({
            "microbatches": m, "local_step_ms": local_ms, "remote_step_ms": remote_ms,
            "ratio": remote_ms / local_ms, "meets_goal": remote_ms / local_ms <= GOAL,
            "runs_ms": runs[m], "last_loss": losses[m],
            "cpu_ms_per_step": {side: _median_cpu(cpus[m][side]) for side in SIDES},
            "client_ops": client,
        })
    return {
        "rows": rows, "goal": GOAL, "workers_left": left,
        "worker_pids": worker_pids,
        "child_pids": {side: child.proc.pid for side, child in children.items()},
        "code": {"git_head": _git_head(), "note": note},
        "devices": {side: ready[side]["devices"] for side in SIDES},
        "build_and_warmup_s": {side: ready[side]["build_and_warmup_s"] for side in SIDES},
        "config": dict(config, model=f"{config['layers']} x Dense({config['width']}, relu), "
                                     f"2 stages, MSE, Adam(1e-4), GPipe, unrolled, "
                                     f"recompute=never"),
        "machine": info, "load_average_at_end": common.machine()["load_average_at_start"],
    }


def markdown(result):
    """The result as a small markdown table (what BUILD.md quotes)."""
    rows = []
    for r in result["rows"]:
        local, remote = r["cpu_ms_per_step"]["local"], r["cpu_ms_per_step"]["remote"]
        client = r["client_ops"]
        rows.append([
            str(r["microbatches"]), f"{r['local_step_ms']:.1f} ms",
            f"{r['remote_step_ms']:.1f} ms", f"{r['ratio']:.2f}",
            f"{local['process']['total']:.0f} ms",
            " + ".join(f"{remote[p]['total']:.0f}" for p in ("client", "task0", "task1"))
            + " ms",
            " + ".join(f"{remote[p]['grpc']:.0f}" for p in ("client", "task0", "task1"))
            + " ms",
            "-" if not client else f"{client['client']} / {client['total']}"])
    table = common.markdown_table(
        ["M", "local step (2 logical CPUs)", "remote step (2 workers)",
         f"ratio (goal <= {GOAL})", "CPU per step, local", "CPU per step, client + task0 "
         "+ task1", "of which gRPC threads", "ops on the client / placed"], rows)
    c = result["config"]
    code = result["code"]
    head = f" Commit {code['git_head'][:7]}." if code["git_head"] else ""
    note = f" Code: {code['note']}." if code["note"] else ""
    return (f"{result['machine']['date']}, {common.machine_label(result['machine'])}."
            f"{head}{note} {c['model']}, batch "
            f"{c['batch']}; median of {c['repeats']} runs x {c['steps']} steps per side, "
            f"sides alternating; load average {result['machine']['load_average_at_start']} "
            f"at the start, {result['load_average_at_end']} at the end (1, 5, 15 min).\n\n"
            f"{table}\n")


def _config():
    config = {"microbatches": common.parse_ints(FLAGS.microbatches), "width": FLAGS.width,
              "batch": FLAGS.batch, "layers": FLAGS.layers, "steps": FLAGS.steps,
              "repeats": FLAGS.repeats, "warmup": FLAGS.warmup, "count_ops": FLAGS.count_ops}
    if FLAGS.quick:
        config.update(QUICK)
    if config["layers"] < 2 or config["layers"] % 2:
        raise app.UsageError(f"--layers must be even and >= 2 (2 equal stages), got "
                             f"{config['layers']}.")
    if not config["microbatches"] or min(config["microbatches"]) < 1:
        raise app.UsageError(f"--microbatches must list counts >= 1, got "
                             f"{FLAGS.microbatches!r}.")
    if min(config["steps"], config["repeats"]) < 1 or config["warmup"] < 1:
        raise app.UsageError("--steps, --repeats and --warmup must be >= 1.")
    config["time_limit_s"] = FLAGS.time_limit_s
    return config


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if FLAGS.child:
        _child(FLAGS.child, json.loads(FLAGS.config))
        return
    result = benchmark(_config(), FLAGS.timeout_s, FLAGS.note)
    out = common.write_json(FLAGS.out, result)
    md = pathlib.Path(out).with_suffix(".md")
    md.write_text(markdown(result))
    print(markdown(result))
    for row in result["rows"]:
        if row["client_ops"]:
            print(f"M={row['microbatches']}: ops on the client by origin: "
                  f"{row['client_ops']['client_by_origin']}")
    print(f"workers left: {result['workers_left']}; wrote {out} and {md}")


if __name__ == "__main__":
    app.run(main)
