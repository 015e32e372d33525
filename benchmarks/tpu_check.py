"""One prepared check of tfpipe on a Cloud TPU VM (about 10 minutes on a v3-8 or v5e-8).

    python -m benchmarks.tpu_check                   # on the TPU VM: writes results/tpu_check.json
    python -m benchmarks.tpu_check --tpu=my-tpu      # from a VM beside a TPU node
    python -m benchmarks.tpu_check --cpu_dry_run --output=/tmp/dry.json   # logic, on CPU

It connects with `TPUClusterResolver` and `initialize_tpu_system`, then for K cores
per replica (one stage per core) under `tf.distribute.TPUStrategy`:

  exactness   weights after `--steps` AdamW steps (K = 2 and 4, M = 4; GPipe, 1F1B
              and the loop execution) against plain Keras on the host CPU: max |dw|;
  placement   every stage's variables and AdamW slots on its core in every replica
              (K = 4), read from the variables themselves;
  program     the traced replica program (`benchmarks.tpu_trace`): each stage's
              variables, slots and matmuls on its core, nothing left off-core;
  speed       K in {1, 2, 4} x M in {1, 4, 8}: median step ms over `--repeats`
              steps, speed-up over K = 1, beside `tfpipe.schedules.simulate`'s ideal;
  profile     one K = 4, M = 8 GPipe step under `tf.profiler`, written to
              `--profile_dir`: open its trace viewer to see whether each core's
              order follows the schedule after XLA (the question only hardware answers).

It prints the tables (paste them into BUILD.md) and writes one JSON object to
`--output`; exit status 1 if a check fails. Without a TPU it says why, writes
{"ran": false, "reason": ...} and exits 0. `--cpu_dry_run` makes the same
strategies over TPU cores that do not exist (`tfpipe.testing.tpu_strategy`,
v3-8): "program" is checked in full; exactness and speed, which must run, run
the same pipelines under a `PipelineStrategy` on 4 logical CPUs; placement
and profile say "traced only" (`tfpipe_tests/test_tpu_check.py`).
"""

import glob
import os
import platform
import time

from benchmarks import common

EXACT = [(2, "gpipe", "unrolled"), (2, "1f1b", "unrolled"), (4, "gpipe", "loop"),
         (4, "1f1b", "unrolled")]


def _no_tpu(tpu):
    """Why there is surely no TPU, found without starting TensorFlow, or None."""
    if tpu is None and not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*"):
        return ("no TPU on this machine (no /dev/accel* or /dev/vfio/N); run on a Cloud TPU "
                "VM, pass --tpu=NAME for a TPU node, or pass --cpu_dry_run")
    return None


def _connect(tpu, cpu_dry_run):
    """(kind, make_strategy(k), make_run(k)) or (None, reason, None).
    make_strategy: a TPUStrategy of K cores per replica (half the host's
    cores in replicas); make_run: where a step can run (the same on a TPU, a
    PipelineStrategy on K logical CPUs in a dry run)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    if cpu_dry_run:
        tfpipe.testing.use_logical_cpus(4)
        cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
        return ("CPU dry run (v3-8 traced)",
                lambda k: tfpipe.testing.tpu_strategy("v3-8", k, 8 // k // 2 or 1),
                lambda k: tfpipe.PipelineStrategy(devices=cpus[:k]))
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu or "local")
        tf.config.experimental_connect_to_cluster(resolver)
        topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as err:
        return None, (f"no TPU reachable ({type(err).__name__}: {str(err).splitlines()[0]}); "
                      f"run on a Cloud TPU VM, pass --tpu=NAME, or pass --cpu_dry_run"), None

    def make(k):
        cores = topology.num_tasks * topology.num_tpus_per_task
        assignment = tfpipe.tpu.device_assignment(topology, k, max(1, cores // k // 2))
        return tf.distribute.TPUStrategy(resolver, experimental_device_assignment=assignment)
    return "TPU", make, make


def _reference(width, layers, seed=0):
    import keras  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((width,))
    h = inputs
    for i in range(layers - 1):
        h = keras.layers.Dense(width, activation="tanh", name=f"dense_{i}")(h)
    outputs = keras.layers.Dense(10, activation="softmax", name="head")(h)
    return keras.Model(inputs, outputs)


def _data(size, rows, seed=0):
    import numpy as np  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(rows, size["width"])).astype("float32"),
            rng.integers(0, 10, rows).astype("int32"))


def _pipelined(ref, strategy, **settings):
    """A copy of `ref` cut into one stage per core (device) of `strategy`."""
    import keras  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    with strategy.scope():
        model = tfpipe.PipelinedModel.from_model(common.twin(ref), **settings)
        model.compile(optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.01),
                      loss="sparse_categorical_crossentropy")
    return model


def check_exactness(make_run, size, steps, tolerance):
    """Rows: K, schedule, execution, max |dw| against plain Keras on the host CPU."""
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    rows = []
    for k, schedule, execution in EXACT:
        strategy = make_run(k)
        x, y = _data(size, size["batch"] * steps)
        ref = _reference(size["width"], size["layers"])
        with tf.device("/CPU:0"):
            plain = common.twin(ref)
            plain.compile(optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.01),
                          loss="sparse_categorical_crossentropy")
            plain.fit(x, y, batch_size=size["batch"], shuffle=False, verbose=0)
        model = _pipelined(ref, strategy, num_microbatches=4, schedule=schedule,
                           execution=execution)
        model.fit(x, y, batch_size=size["batch"], shuffle=False, verbose=0)
        diff = max(float(np.max(np.abs(a - b))) for a, b in
                   zip(plain.get_weights(), model.source_model.get_weights()))
        rows.append(dict(stages=k, schedule=schedule, execution=execution, microbatches=4,
                         max_abs_diff=diff, exact=diff < tolerance))
    return rows


def check_program(make_strategy, size):
    """Rows per K in {2, 4}: the traced replica program's placement."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from benchmarks import tpu_trace  # pylint: disable=import-outside-toplevel
    rows = []
    for k in (2, 4):
        strategy = make_strategy(k)
        model = _pipelined(_reference(size["width"], size["layers"]), strategy,
                           num_microbatches=4)
        batch = size["batch"] * strategy.num_replicas_in_sync
        placed = tpu_trace.read(tpu_trace.trace_train_step(
            model, tf.TensorSpec((batch, size["width"])), tf.TensorSpec((batch,), tf.int32)))
        # Each stage variable's handle and its two AdamW slots', on its core.
        handles = {v.path: (i, placed.variable_handles(v.path))
                   for i, stage in enumerate(model.stages) for v in stage.trainable_weights}
        wrong = [name for home, found in handles.values()
                 for name, cores in found.items() if cores != [home]]
        wrong += [f"{path} (found {len(found)} of 3 handles)"
                  for path, (_, found) in handles.items() if len(found) != 3]
        rows.append(dict(stages=k, replicas=placed.num_replicas,
                         cores_per_replica=placed.cores_per_replica,
                         matmuls_per_core=[placed.matmuls[c] for c in range(k)],
                         off_core_matmuls=placed.matmuls[None], wrong_handles=wrong,
                         unplaced_work=placed.unplaced_work,
                         placed=not wrong and not placed.unplaced_work
                         and placed.matmuls[None] == 0))
    return rows


def check_placement(make_strategy, size, on_tpu):
    """Per stage (K = 4): variables and slots whose copies are not on its core."""
    from tfpipe import placement  # pylint: disable=import-outside-toplevel
    model = _pipelined(_reference(size["width"], size["layers"]), make_strategy(4),
                       num_microbatches=4)
    rows = []
    for k, (stage, core) in enumerate(zip(model.stages, model.stage_devices)):
        own = list(stage.trainable_variables)
        names = [v.path.replace("/", "_") for v in own]
        slots = [s for s in model.optimizer.variables
                 if any(s.path.endswith((f"{n}_momentum", f"{n}_velocity")) for n in names)]
        bad = placement.misplaced_variables(own + slots, core.replica_devices()) \
            if on_tpu else None
        rows.append(dict(stage=k, core=str(core), variables=len(own), slots=len(slots),
                         misplaced=bad, placed=(not bad) if on_tpu else "traced only"))
    return rows


def check_speed(make_run, size, repeats):
    """K in {1, 2, 4} x M in {1, 4, 8}: median step ms, speed-up over K = 1, ideal."""
    import tfpipe  # pylint: disable=import-outside-toplevel
    rows, base = [], None
    for k in (1, 2, 4):
        for m in (1, 4, 8):
            strategy = make_run(k)
            model = _pipelined(_reference(size["width"], size["layers"]), strategy,
                               num_microbatches=m)
            step = common.step_ms(
                model, *_data(size, size["batch"] * strategy.num_replicas_in_sync), repeats)
            base = step if k == 1 and m == 1 else base
            ideal = (k * 3.0 * m / tfpipe.schedules.simulate("gpipe", m, k, 1.0, 2.0).makespan
                     if k > 1 else 1.0)
            rows.append(dict(stages=k, microbatches=m, step_ms=step, speedup=base / step,
                             ideal=ideal))
    return rows


def profile_step(make_strategy, size, profile_dir):
    """One traced and profiled K = 4, M = 8 step; returns the profile's directory."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    strategy = make_strategy(4)
    model = _pipelined(_reference(size["width"], size["layers"]), strategy,
                       num_microbatches=8)
    batch = size["batch"] * strategy.num_replicas_in_sync
    x, y = _data(size, batch)
    model.train_on_batch(x, y)
    tf.profiler.experimental.start(profile_dir)
    model.train_on_batch(x, y)
    tf.profiler.experimental.stop()
    return profile_dir


def tables(results):
    """The checks' markdown tables, headed by the machine."""
    return "\n\n".join([
        f"tfpipe TPU check on {results['device_kind']} ({results['machine']}), "
        f"{results['seconds']:.0f} s",
        "exactness (max abs dw vs plain Keras on the host CPU, M=4, AdamW):\n"
        + common.markdown_table(
            [("K", "stages", 0), ("schedule", "schedule", 0), ("execution", "execution", 0),
             ("max abs dw", "max_abs_diff", ".2e"), ("exact", "exact", 0)],
            results["exactness"]),
        "replica program (traced):\n" + common.markdown_table(
            [("K", "stages", 0), ("R", "replicas", 0), ("matmuls per core", "matmuls_per_core", 0),
             ("off-core matmuls", "off_core_matmuls", 0), ("placed", "placed", 0)],
            results["program"]),
        "variables and slots per core (K=4):\n" + common.markdown_table(
            [("stage", "stage", 0), ("core", "core", 0), ("variables", "variables", 0),
             ("slots", "slots", 0), ("placed", "placed", 0)], results["placement"]),
        "speed (GPipe; speed-up over K=1, M=1):\n" + common.markdown_table(
            [("K", "stages", 0), ("M", "microbatches", 0), ("step ms", "step_ms", 2),
             ("speed-up", "speedup", 2), ("ideal (simulated)", "ideal", 2)], results["speed"]),
        f"profile of one K=4, M=8 step: {results['profile']}"])


def main(argv):
    from absl import app  # pylint: disable=import-outside-toplevel
    from absl import flags  # pylint: disable=import-outside-toplevel
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    start = time.perf_counter()
    absent = None if f.cpu_dry_run else _no_tpu(f.tpu)
    kind, make_strategy, make_run = (None, absent, None) if absent else \
        _connect(f.tpu, f.cpu_dry_run)
    if kind is None:
        return common.not_run("tpu_check", f.output, make_strategy)
    on_tpu = not f.cpu_dry_run
    size = dict(layers=4, width=32, batch=16) if f.cpu_dry_run else \
        dict(layers=8, width=2048, batch=1024)
    results = dict(ran=True, device_kind=kind, model=size, machine=platform.node(),
                   exactness=check_exactness(make_run, size, f.steps, f.tolerance),
                   program=check_program(make_strategy, size),
                   placement=check_placement(make_strategy, size, on_tpu),
                   speed=check_speed(make_run, size, f.repeats),
                   profile=profile_step(make_strategy, size, f.profile_dir) if on_tpu
                   else "traced only (no TPU to profile)")
    results["seconds"] = time.perf_counter() - start
    common.write_json(f.output, results)
    print(tables(results))
    ok = all(r["exact"] for r in results["exactness"]) and all(
        r["placed"] for r in results["program"]) and all(
        r["placed"] in (True, "traced only") for r in results["placement"])
    return 0 if ok else 1


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_string("output", str(common.RESULTS_DIR / "tpu_check.json"), "JSON output.")
    flags.DEFINE_string("tpu", None, "TPUClusterResolver's tpu (default: the local TPU VM).")
    flags.DEFINE_bool("cpu_dry_run", False, "Trace on CPU; run what must run on logical CPUs.")
    flags.DEFINE_string("profile_dir", "/tmp/tfpipe_tpu_profile", "Where the profile goes.")
    flags.DEFINE_integer("steps", 3, "AdamW steps per exactness run.", lower_bound=1)
    flags.DEFINE_integer("repeats", 10, "Timed steps per speed row.", lower_bound=1)
    flags.DEFINE_float("tolerance", 1e-5, "Largest max |dw| counted exact (float32).")


if __name__ == "__main__":
    from absl import app as _app
    _define_flags()
    _app.run(main)
