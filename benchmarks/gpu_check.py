"""One prepared check of tfpipe on a machine with an NVIDIA GPU (under 5 minutes).

    python -m benchmarks.gpu_check                       # writes benchmarks/results/gpu_check.json
    python -m benchmarks.gpu_check --cpu_dry_run --output=/tmp/dry.json   # logic, on CPUs

The one physical GPU is split into 4 logical GPUs (`--memory_limit_mib` each)
before TensorFlow starts; K = 2 runs on the first two, K = 4 on all four:

  exactness   weights after `--steps` Adam steps, pipelined (K = 2 and 4, M = 4,
              GPipe and 1F1B) against plain Keras on logical GPU 0: max |dw|;
  placement   every stage's variables and Adam slots on its stage's device (K = 4);
  speed-up    K = 2 at M in {1, 4, 8} against the same model on one logical GPU
              (median of `--repeats` steps), beside `tfpipe.schedules.simulate`'s
              ideal. Logical GPUs share one chip: this measures overhead and
              overlap on one chip, not a two-GPU speed-up;
  xla         K = 2, M = 4, stage functions: each stage its own XLA program
              (`jit_compile=True`) beside the same without XLA and plain Keras
              with and without XLA on one logical GPU: step ms, max |dw|;
  transformer the repo's LM (`models/transformer_lm.py`) at K = 2, M in {4, 8},
              everything else tfpipe's default (recompute chosen from the
              logical GPUs' memory, execution), against the same model on one
              logical GPU: step ms, speed-up, first call s and its ratio;
  memory      peak bytes per logical GPU of a K = 2, M = 8 step per recompute mode,
              and of tfpipe's default, with the mode it chose, why, and each
              device's memory as TF reports it (`StageDevice.memory()`).

It prints the tables and writes one JSON object to `--output`; exit status 1
if a check fails. Without a GPU it says why, writes {"ran": false, "reason":
...} and exits 0. `--cpu_dry_run` runs every check on 4 logical CPUs with a
small model (memory figures are then None: CPU devices report none), so the
logic is tested without a GPU (`tfpipe_tests/test_gpu_check.py`).
"""

import glob
import os
import platform
import time

from benchmarks import common

NUM_LOGICAL = 4
RECOMPUTE = ("never", "except_last", "always", None)  # None: tfpipe's choice


def _no_gpu():
    """Why there is surely no GPU, found without starting TensorFlow, or None."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
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
        return None, ("no GPU visible to TensorFlow; run on a machine with an NVIDIA GPU and "
                      "a CUDA build of TensorFlow (pip install -e '.[and-cuda,test]'), or "
                      "pass --cpu_dry_run")
    tf.config.set_logical_device_configuration(
        gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mib)
                  for _ in range(NUM_LOGICAL)])
    return "GPU", [d.name for d in tf.config.list_logical_devices("GPU")]


def _reference(size, seed=0):
    import keras  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(size["width"], activation="tanh")
              for _ in range(size["layers"] - 1)] + [keras.layers.Dense(size["width"])]
    return keras.Sequential([keras.Input((size["width"],))] + layers)


def _data(size, batches, seed=0):
    import numpy as np  # pylint: disable=import-outside-toplevel
    x = np.random.default_rng(seed).normal(
        size=(size["batch"] * batches, size["width"])).astype("float32")
    return x, np.tanh(x[:, ::-1]).astype("float32")


def _pipelined(ref, devices, m, schedule="gpipe", recompute="never", execution=None,
               jit_compile=False):
    import tfpipe  # pylint: disable=import-outside-toplevel
    with tfpipe.PipelineStrategy(devices=devices, num_microbatches=m, schedule=schedule,
                                 recompute=recompute, execution=execution).scope():
        model = tfpipe.PipelinedModel.from_model(common.twin(ref))
        model.compile(optimizer="adam", loss="mse", jit_compile=jit_compile)
    return model


def check_exactness(devices, size, steps):
    """Rows: K, schedule, max |dw| against plain Keras on devices[0]."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    x, y = _data(size, steps)
    rows = []
    for k in (2, 4):
        for schedule in ("gpipe", "1f1b"):
            ref = _reference(size)
            with tf.device(devices[0]):
                plain = common.twin(ref)
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
    """Per stage (K = 4): its device, and the variables or Adam slots not on it."""
    from tfpipe import placement  # pylint: disable=import-outside-toplevel
    model = _pipelined(_reference(size), devices[:4], 4)
    model.fit(*_data(size, 1), batch_size=size["batch"], verbose=0)
    rows = []
    for k, (stage, device) in enumerate(zip(model.stages, model.stage_devices)):
        own = list(stage.trainable_variables)
        names = [v.path.replace("/", "_") for v in own]
        slots = [s for s in model.optimizer.variables
                 if any(s.path.endswith((f"{n}_momentum", f"{n}_velocity")) for n in names)]
        bad = placement.misplaced_variables(own + slots, device)
        rows.append(dict(stage=k, device=str(device), variables=len(own), slots=len(slots),
                         misplaced=bad, placed=not bad and len(slots) == 2 * len(own)))
    return rows


def check_speedup(devices, size, repeats):
    """K = 2, M in {1, 4, 8}: step ms, one-device ms, speed-up, simulated ideal."""
    import tfpipe  # pylint: disable=import-outside-toplevel
    x, y = _data(size, 1)
    ref = _reference(size)
    single = common.step_ms(_pipelined(ref, devices[:1], 1), x, y, repeats)
    rows = []
    for m in (1, 4, 8):
        step = common.step_ms(_pipelined(ref, devices[:2], m), x, y, repeats)
        ideal = 6.0 * m / tfpipe.schedules.simulate("gpipe", m, 2, 1.0, 2.0).makespan
        rows.append(dict(stages=2, microbatches=m, step_ms=step, one_device_ms=single,
                         speedup=single / step, ideal=ideal))
    return rows


def check_transformer(devices, size, repeats):
    """K = 2, M in {4, 8}, tfpipe's defaults: the repo's LM against one device."""
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    from models import transformer_lm  # pylint: disable=import-outside-toplevel
    gen = tf.random.Generator.from_seed(0)
    x, y = (gen.uniform((size["batch"], size["seq_len"]), 0, 256, tf.int32) for _ in range(2))

    def built(devices_, m):
        keras.utils.set_random_seed(0)
        scope = (tfpipe.PipelineStrategy(devices=devices_, num_microbatches=m).scope() if m
                 else tf.device(devices_[0]))
        with scope:
            model = transformer_lm.transformer_lm(
                num_layers=size["layers"], width=size["width"], num_heads=size["heads"],
                seq_len=size["seq_len"])
            if m:
                model = tfpipe.PipelinedModel.from_model(
                    model, balance=transformer_lm.stage_balance(model, len(devices_)))
            model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True))
        start = time.perf_counter()
        model.train_on_batch(x, y)
        return model, time.perf_counter() - start

    plain, plain_first = built(devices[:1], None)
    single = common.step_ms(plain, x, y, repeats)
    rows = []
    for m in (4, 8):
        model, first = built(devices[:2], m)
        step = common.step_ms(model, x, y, repeats)
        sim = tfpipe.schedules.simulate("gpipe", m, 2, 1.0, 2.0, recompute=model.recompute)
        rows.append(dict(stages=2, microbatches=m, recompute=model.recompute,
                         execution=model.execution, step_ms=step, one_device_ms=single,
                         speedup=single / step, ideal=6.0 * m / sim.makespan,
                         first_call_s=first, first_call_ratio=first / plain_first))
    return rows


def check_xla(devices, size, repeats, steps):
    """K = 2, M = 4, stage functions: each stage its own XLA program
    (`jit_compile=True`) against the same without XLA and against plain Keras
    with and without XLA on devices[0]: step ms, and max |dw| against plain
    Keras without XLA after `steps` Adam steps."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    x, y = _data(size, steps)
    batch = (x[:size["batch"]], y[:size["batch"]])
    ref = _reference(size)
    with tf.device(devices[0]):
        plain = common.twin(ref)
        plain.compile(optimizer="adam", loss="mse", jit_compile=False)
        plain.fit(x, y, batch_size=size["batch"], shuffle=False, verbose=0)
    rows = []
    for name, jit, pipelined in (("plain Keras", False, False), ("plain Keras", True, False),
                                 ("tfpipe K=2", False, True), ("tfpipe K=2", True, True)):
        if pipelined:
            model = _pipelined(ref, devices[:2], 4, execution="stage_functions", jit_compile=jit)
            weights = lambda m: m.source_model.get_weights()  # noqa: E731
        else:
            with tf.device(devices[0]):
                model = common.twin(ref)
                model.compile(optimizer="adam", loss="mse", jit_compile=jit)
            weights = lambda m: m.get_weights()  # noqa: E731
        model.fit(x, y, batch_size=size["batch"], shuffle=False, verbose=0)
        diff = max(float(np.max(np.abs(a - b)))
                   for a, b in zip(plain.get_weights(), weights(model)))
        rows.append(dict(model=name, xla="per stage" if jit and pipelined else
                         ("whole step" if jit else "off"), max_abs_diff=diff,
                         step_ms=common.step_ms(model, *batch, repeats)))
    off = {r["model"]: r["step_ms"] for r in rows if r["xla"] == "off"}
    for r in rows:
        r["vs_no_xla"] = off[r["model"]] / r["step_ms"]
    return rows


def check_memory(devices, kind, size):
    """Peak MiB per device of a K = 2, M = 8 step, per recompute mode (None on
    CPUs); the default's row says what tfpipe chose, why, from what memory."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    x, y = _data(size, 1)
    names = [d.split("device:")[-1] for d in devices[:2]]
    rows = []
    for mode in RECOMPUTE:
        model = _pipelined(_reference(size), devices[:2], 8, recompute=mode)
        model.train_on_batch(x, y)  # build and trace first: count only the step
        if kind == "GPU":
            for name in names:
                tf.config.experimental.reset_memory_stats(name)
        model.train_on_batch(x, y)
        peaks = [tf.config.experimental.get_memory_info(name)["peak"] / 2**20
                 if kind == "GPU" else None for name in names]
        rows.append(dict(recompute=mode or f"default: {model.recompute}", stages=2,
                         microbatches=8, peak_mib=peaks,
                         reason=model.pipeline_config.recompute_reason,
                         reported=[tfpipe.devices.as_stage_device(d).memory()
                                   for d in devices[:2]]))
    return rows


def tables(results):
    """The checks' markdown tables, headed by the machine."""
    memory = [dict(r, **{f"peak_{i}": p for i, p in enumerate(r["peak_mib"])})
              for r in results["memory"]]
    return "\n\n".join([
        f"tfpipe GPU check on {results['device_kind']} ({results['machine']}), "
        f"{results['seconds']:.0f} s",
        "exactness (max abs dw vs plain Keras, M=4):\n" + common.markdown_table(
            [("K", "stages", 0), ("schedule", "schedule", 0), ("max abs dw", "max_abs_diff", ".2e"),
             ("exact", "exact", 0)], results["exactness"]),
        "placement (K=4):\n" + common.markdown_table(
            [("stage", "stage", 0), ("device", "device", 0), ("variables", "variables", 0),
             ("slots", "slots", 0), ("placed", "placed", 0), ("misplaced", "misplaced", 0)],
            results["placement"]),
        "speed-up at K=2 (one chip split in logical GPUs):\n" + common.markdown_table(
            [("M", "microbatches", 0), ("step ms", "step_ms", 2),
             ("1-device ms", "one_device_ms", 2), ("speed-up", "speedup", 2),
             ("ideal (simulated)", "ideal", 2)], results["speedup"]),
        "XLA, K=2, M=4, stage functions (speed-up over the same without XLA):\n"
        + common.markdown_table(
            [("model", "model", 0), ("XLA", "xla", 0), ("step ms", "step_ms", 2),
             ("vs no XLA", "vs_no_xla", 2), ("max abs dw", "max_abs_diff", ".2e")],
            results["xla"]),
        "transformer LM, K=2, tfpipe's defaults (one chip split in logical GPUs):\n"
        + common.markdown_table(
            [("M", "microbatches", 0), ("recompute", "recompute", 0),
             ("execution", "execution", 0), ("step ms", "step_ms", 2),
             ("1-device ms", "one_device_ms", 2), ("speed-up", "speedup", 2),
             ("ideal (simulated)", "ideal", 2), ("first call s", "first_call_s", 2),
             ("first call / 1-device", "first_call_ratio", 2)], results["transformer"]),
        "peak memory per device, K=2, M=8 (MiB):\n" + common.markdown_table(
            [("recompute", "recompute", 0), ("device 0", "peak_0", 1),
             ("device 1", "peak_1", 1)], memory)
        + "\n" + "\n".join(f"{r['recompute']}: {r['reason']}" for r in results["memory"]
                            if r["reason"])])


def main(argv):
    from absl import app  # pylint: disable=import-outside-toplevel
    from absl import flags  # pylint: disable=import-outside-toplevel
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    start = time.perf_counter()
    absent = None if f.cpu_dry_run else _no_gpu()
    kind, devices = (None, absent) if absent else _devices(f.cpu_dry_run, f.memory_limit_mib)
    if kind is None:
        return common.not_run("gpu_check", f.output, devices)
    size = dict(layers=8, width=32, batch=32) if f.cpu_dry_run else \
        dict(layers=8, width=2048, batch=512)  # big enough to keep a chip busy
    lm = dict(layers=2, width=16, heads=2, seq_len=8, batch=8) if f.cpu_dry_run else \
        dict(layers=8, width=512, heads=8, seq_len=256, batch=32)
    results = dict(ran=True, device_kind=kind, devices=devices, model=size,
                   machine=platform.node(), exactness=check_exactness(devices, size, f.steps),
                   placement=check_placement(devices, size),
                   speedup=check_speedup(devices, size, f.repeats),
                   transformer=check_transformer(devices, lm, f.repeats),
                   xla=check_xla(devices, size, f.repeats, f.steps),
                   memory=check_memory(devices, kind, size))
    results["seconds"] = time.perf_counter() - start
    common.write_json(f.output, results)
    print(tables(results))
    from tfpipe import recompute_choice  # pylint: disable=import-outside-toplevel
    default = results["memory"][-1]  # within the budget tfpipe chose it by
    within = all(p is None or not memory or p * 2**20 <= recompute_choice.FRACTION * memory[1]
                 for p, memory in zip(default["peak_mib"], default["reported"]))
    ok = within and all(r["exact"] for r in results["exactness"]) and all(
        r["placed"] for r in results["placement"]) and all(
        r["max_abs_diff"] < 1e-5 for r in results["xla"] if r["xla"] == "per stage")
    return 0 if ok else 1


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_string("output", str(common.RESULTS_DIR / "gpu_check.json"), "JSON output.")
    flags.DEFINE_bool("cpu_dry_run", False, "Run every check on 4 logical CPUs, small model.")
    flags.DEFINE_integer("memory_limit_mib", 8192, "Memory of each of the 4 logical GPUs.",
                         lower_bound=1)
    flags.DEFINE_integer("steps", 3, "Adam steps per exactness run.", lower_bound=1)
    flags.DEFINE_integer("repeats", 10, "Timed steps per speed-up row.", lower_bound=1)


if __name__ == "__main__":
    from absl import app as _app
    _define_flags()
    _app.run(main)
