"""One prepared check of tfpipe on a machine with an NVIDIA GPU (under 5 minutes).

    python -m benchmarks.gpu_check --output=/tmp/gpu_check.json
    python -m benchmarks.gpu_check --cpu_dry_run --output=/tmp/dry.json   # logic, on CPUs

The one physical GPU is split into 4 logical GPUs (`tf.config.set_logical_device_configuration`
with `--memory_limit_mib` each) before TensorFlow starts; K = 2 runs on the
first two, K = 4 on all four. It measures:

  exactness   weights after `--steps` Adam steps, pipelined (K = 2 and 4, M = 4,
              GPipe and 1F1B) against plain Keras on logical GPU 0: max |dw|;
  placement   every stage's variables and Adam slots on its stage's device;
  speed-up    step time of K = 2 at M in {1, 4, 8} against the same model on
              one logical GPU, beside the ideal K*M / (M + K - 1) and the
              simulator's (`benchmarks.schedules.simulated_speedup`). Logical
              GPUs share one chip, so this measures tfpipe's overhead and
              overlap on one chip, not a two-GPU speed-up;
  memory      peak bytes per logical GPU (`tf.config.experimental.get_memory_info`
              after `reset_memory_stats`) for each recompute mode, K = 2, M = 8.

It writes one JSON object to `--output` and prints a table. Without a GPU it
prints why and exits with status 0, writing `{"ran": false, "reason": ...}`;
`--cpu_dry_run` runs every check on 4 logical CPUs with a small model (memory
figures are then None: CPU devices report none), so the script's logic is
tested on machines without a GPU (`tfpipe_tests/test_benchmarks.py`).
"""

import argparse
import json
import os
import sys
import time

NUM_LOGICAL = 4


def _flags(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, help="Path of the JSON results.")
    parser.add_argument("--cpu_dry_run", action="store_true",
                        help="Run every check on 4 logical CPUs with a small model.")
    parser.add_argument("--memory_limit_mib", type=int, default=8192,
                        help="Memory of each of the 4 logical GPUs.")
    parser.add_argument("--steps", type=int, default=3, help="Adam steps per exactness run.")
    parser.add_argument("--repeats", type=int, default=10, help="Timed steps per speed-up row.")
    return parser.parse_args(argv)


def _no_gpu_before_tensorflow():
    """Why there is surely no GPU, found without starting TensorFlow (which
    takes seconds), or None."""
    import glob  # pylint: disable=import-outside-toplevel
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return "CUDA_VISIBLE_DEVICES hides every GPU; unset it, or pass --cpu_dry_run"
    if not glob.glob("/dev/nvidia[0-9]*"):
        return ("no NVIDIA device on this machine (no /dev/nvidia0); run on a machine with "
                "an NVIDIA GPU, or pass --cpu_dry_run")
    return None


def _devices(cpu_dry_run, memory_limit_mib):
    """Makes the logical devices; returns (kind, names) or (None, reason)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if cpu_dry_run:
        import tfpipe  # pylint: disable=import-outside-toplevel
        tfpipe.testing.use_logical_cpus(NUM_LOGICAL)
        return "CPU", [d.name for d in tf.config.list_logical_devices("CPU")]
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None, ("no GPU visible to TensorFlow (tf.config.list_physical_devices('GPU') "
                      "is empty); run on a machine with an NVIDIA GPU and a CUDA build of "
                      "TensorFlow (pip install 'tensorflow[and-cuda]'), or pass --cpu_dry_run")
    tf.config.set_logical_device_configuration(
        gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mib)
                  for _ in range(NUM_LOGICAL)])
    return "GPU", [d.name for d in tf.config.list_logical_devices("GPU")]


def _model_size(cpu_dry_run):
    # GPU: 8 Dense(2048) layers, batch 512 (big enough to keep a chip busy);
    # dry run: tiny.
    return dict(layers=8, width=32, batch=32) if cpu_dry_run else \
        dict(layers=8, width=2048, batch=512)


def _reference(size, seed=0):
    import keras  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(size["width"], activation="tanh")
              for _ in range(size["layers"] - 1)] + [keras.layers.Dense(size["width"])]
    return keras.Sequential([keras.Input((size["width"],))] + layers)


def _data(size, batches, seed=0):
    import numpy as np  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(seed)
    n = size["batch"] * batches
    x = rng.normal(size=(n, size["width"])).astype("float32")
    y = np.tanh(x[:, ::-1]).astype("float32")
    return x, y


def _pipelined(ref, devices, m, schedule="gpipe", recompute="never"):
    import keras  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    copy = keras.models.clone_model(ref)
    copy.set_weights(ref.get_weights())
    strategy = tfpipe.PipelineStrategy(devices=devices, num_microbatches=m, schedule=schedule,
                                       recompute=recompute)
    with strategy.scope():
        model = tfpipe.PipelinedModel.from_model(copy)
        model.compile(optimizer="adam", loss="mse")
    return model


def check_exactness(devices, size, steps):
    """Rows of (K, schedule, max |dw| against plain Keras on devices[0])."""
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    x, y = _data(size, steps)
    rows = []
    for k in (2, 4):
        for schedule in ("gpipe", "1f1b"):
            ref = _reference(size)
            with tf.device(devices[0]):
                plain = keras.models.clone_model(ref)
                plain.set_weights(ref.get_weights())
                plain.compile(optimizer="adam", loss="mse")
                plain.fit(x, y, batch_size=size["batch"], shuffle=False, verbose=0)
            model = _pipelined(ref, devices[:k], 4, schedule)
            model.fit(x, y, batch_size=size["batch"], shuffle=False, verbose=0)
            diff = max(float(np.max(np.abs(a - b))) for a, b in
                       zip(plain.get_weights(), model.source_model.get_weights()))
            rows.append(dict(stages=k, schedule=schedule, microbatches=4, max_abs_diff=diff,
                             exact=diff < 1e-5))
    return rows


def check_placement(devices, size):
    """Per stage: its device and the variables or slots not on it (K = 4)."""
    from tfpipe import placement  # pylint: disable=import-outside-toplevel
    model = _pipelined(_reference(size), devices[:4], 4)
    x, y = _data(size, 1)
    model.fit(x, y, batch_size=size["batch"], verbose=0)
    rows = []
    for k, (stage, device) in enumerate(zip(model.stages, model.stage_devices)):
        own = list(stage.trainable_variables)
        names = [v.path.replace("/", "_") for v in own]
        slots = [s for s in model.optimizer.variables  # Adam: momentum and velocity
                 if any(s.path.endswith(f"{n}_momentum") or s.path.endswith(f"{n}_velocity")
                        for n in names)]
        bad = placement.misplaced_variables(own + slots, device)
        rows.append(dict(stage=k, device=device, variables=len(own), slots=len(slots),
                         misplaced=bad, placed=not bad and len(slots) == 2 * len(own)))
    return rows


def _step_ms(model, x, y, repeats):
    """Median ms of one `train_on_batch` after two warm-up steps."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    for _ in range(2):
        model.train_on_batch(x, y)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def check_speedup(devices, size, repeats):
    """K = 2, M in {1, 4, 8}: step ms, one-device ms, measured and ideal speed-ups."""
    from benchmarks import schedules as sched  # pylint: disable=import-outside-toplevel
    x, y = _data(size, 1)
    ref = _reference(size)
    single = _step_ms(_pipelined(ref, devices[:1], 1), x, y, repeats)
    rows = []
    for m in (1, 4, 8):
        step = _step_ms(_pipelined(ref, devices[:2], m), x, y, repeats)
        rows.append(dict(stages=2, microbatches=m, step_ms=step, one_device_ms=single,
                         speedup=single / step, ideal=sched.ideal_speedup(2, m),
                         simulated=sched.simulated_speedup("gpipe", 2, m)))
    return rows


def check_memory(devices, kind, size):
    """Peak bytes per device of K = 2, M = 8 training steps, per recompute mode."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    x, y = _data(size, 1)
    rows = []
    for mode in ("never", "except_last", "always"):
        model = _pipelined(_reference(size), devices[:2], 8, recompute=mode)
        model.train_on_batch(x, y)  # build and trace first: count only the step
        peaks = []
        for d in devices[:2]:
            short = d.split("device:")[-1]
            if kind == "GPU":
                tf.config.experimental.reset_memory_stats(short)
        model.train_on_batch(x, y)
        for d in devices[:2]:
            short = d.split("device:")[-1]
            peaks.append(tf.config.experimental.get_memory_info(short)["peak"]
                         if kind == "GPU" else None)
        rows.append(dict(recompute=mode, stages=2, microbatches=8, peak_bytes=peaks))
    return rows


def _table(results):
    lines = [f"tfpipe GPU check on {results['device_kind']} ({results['machine']}), "
             f"{results['seconds']:.0f} s"]
    lines.append("exactness (max |dw| vs plain Keras, M=4):")
    for r in results["exactness"]:
        lines.append(f"  K={r['stages']} {r['schedule']:<5} {r['max_abs_diff']:.2e} "
                     f"{'ok' if r['exact'] else 'NOT EXACT'}")
    lines.append("placement (K=4):")
    for r in results["placement"]:
        lines.append(f"  stage {r['stage']} {r['device']}: {r['variables']} variables, "
                     f"{r['slots']} slots, {'ok' if r['placed'] else r['misplaced']}")
    lines.append("speed-up at K=2 (one chip split in logical GPUs):")
    lines.append(f"  {'M':>3} {'step ms':>9} {'1-dev ms':>9} {'speed-up':>9} {'ideal':>6} "
                 f"{'sim':>6}")
    for r in results["speedup"]:
        lines.append(f"  {r['microbatches']:>3} {r['step_ms']:>9.2f} {r['one_device_ms']:>9.2f} "
                     f"{r['speedup']:>9.2f} {r['ideal']:>6.2f} {r['simulated']:>6.2f}")
    lines.append("peak memory per device, K=2, M=8 (MiB):")
    for r in results["memory"]:
        peaks = ", ".join("n/a" if p is None else f"{p / 2**20:.1f}" for p in r["peak_bytes"])
        lines.append(f"  {r['recompute']:<12} {peaks}")
    return "\n".join(lines)


def main(argv=None):
    args = _flags(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    start = time.perf_counter()
    absent = None if args.cpu_dry_run else _no_gpu_before_tensorflow()
    kind, devices = (None, absent) if absent else _devices(args.cpu_dry_run,
                                                          args.memory_limit_mib)
    if kind is None:
        print(f"gpu_check: not run: {devices}.")
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump({"ran": False, "reason": devices}, f, indent=1)
        return 0
    import platform  # pylint: disable=import-outside-toplevel
    size = _model_size(args.cpu_dry_run)
    results = dict(ran=True, device_kind=kind, devices=devices, model=size,
                   machine=platform.node())
    results["exactness"] = check_exactness(devices, size, args.steps)
    results["placement"] = check_placement(devices, size)
    results["speedup"] = check_speedup(devices, size, args.repeats)
    results["memory"] = check_memory(devices, kind, size)
    results["seconds"] = time.perf_counter() - start
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    print(_table(results))
    ok = all(r["exact"] for r in results["exactness"]) and \
        all(r["placed"] for r in results["placement"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
