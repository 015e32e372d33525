"""The settings of one `launch.train` run, and every check on them.

Nothing here imports TensorFlow: `launch.train` registers these checks as
absl flag validators, so a bad flag is one line and exit code 1 within a
fraction of a second, before TensorFlow starts (which takes 5-8 s). The rules
that are the library's are asked of it (`tfpipe.config` and
`tfpipe.schedules` are pure Python), in our flags' words (`FLAGS`). The same
checks run again when `train(TrainConfig(...))` is called directly, then as
a `RunError`.

The errors a run ends with, and their exit codes, are in `launch.errors`.
"""

import dataclasses
import glob
import json
import math
import os
import re

from launch import data as data_lib
from launch import outputs
from launch.errors import RunError
from tfpipe import actions
from tfpipe import config as tfpipe_config
from tfpipe import schedules


@dataclasses.dataclass
class TrainConfig:
    """Everything one training run needs; the flags of `launch.train` map onto it."""

    model: str = "mlp"
    depth: int = 0  # hidden layers / residual blocks / Transformer blocks; 0: 4 (>= stages)
    dataset: str = "auto"  # auto: the model's default data set (MODEL_DATA[model])
    data_dir: str | None = None  # TFDS data directory, for dataset="tfds:NAME"
    max_examples: int = 0  # if > 0, use at most this many examples of each split
    stages: int = 4
    microbatches: int = 4
    schedule: str = "auto"  # auto: tfpipe.config.default_schedule (ZB-H1 for 2 <= M < 8)
    recompute: str = "auto"  # auto: tfpipe's default for the execution
    execution: str = "auto"  # auto: tfpipe.config.default_execution (unrolled below M=8)
    timeline: bool = True  # record one step's pipeline timeline at the end
    batch_size: int = 64
    epochs: int = 3
    steps_per_epoch: int = 0  # 0: one pass over the training data
    logical_cpus: int = 4
    model_dir: str = "/tmp/tfpipe_run"
    checkpoint_every: int = 100  # steps; 0: none by count (epoch ends and the end still save)
    checkpoint_every_secs: float = 0.0  # seconds; > 0: also save when this long since the last
    resume: bool = False
    overwrite: bool = False  # a fresh run may replace the outputs of a previous run
    reshard: bool = False  # with resume: the checkpoint may come from another --stages
    learning_rate: float = 1e-3
    seed: int = 0
    verbose: int | None = None  # None: 1 (progress bar) on a tty, else 2 (a line per epoch)
    cluster: str = ""  # "": this process's devices; "local:N": N worker processes; "tf_config"
    step_timeout: float = 0.0  # seconds; > 0: tfpipe.StepWatchdog (needs --cluster)
    replicas: str = "1"  # "N": N data-parallel pipelines here; "tf_config": one per worker process
    tpu: str = ""  # "": no TPU; "local": this TPU VM's; NAME: a TPU node (TPUClusterResolver)


# model name -> (the kind of data it takes, its default data set)
MODEL_DATA = {
    "mlp": ("image", "digits"),
    "resnet": ("image", "digits"),
    "transformer": ("text", "pydoc_topics"),
    "unet": ("segmentation", "digits_masks"),
}
RECOMPUTE_MODES = ("auto",) + actions.RECOMPUTE_MODES  # auto: tfpipe's default
EXECUTIONS = ("auto",) + tuple(tfpipe_config.EXECUTIONS)  # auto: tfpipe's choice


KEEP_CHECKPOINTS = 3  # the newest this many committed checkpoints are kept
MAX_SEED = 2**32 - 1  # numpy's legacy seeding (keras.utils.set_random_seed) takes < 2**32
MAX_BATCH = 2**31 - 1  # rows of a batch: TensorFlow's int32 shapes


# How tfpipe's own checks name the settings in their messages: as our flags.
FLAGS = actions.Spelling(flags={"num_stages": "stages", "num_microbatches": "microbatches"},
                           unset="auto")


def placing_schedule(schedule):
    """The schedule whose stage placement --schedule=`schedule` has: its own,
    or for auto GPipe's, since tfpipe chooses among schedules of one stage per
    device (`tfpipe.config.default_schedule`: ZB-H1 or GPipe)."""
    return "gpipe" if schedule == "auto" else schedule


def schedule_setting(config):
    """--schedule as `tfpipe.PipelineStrategy(schedule=...)` takes it (auto: None)."""
    return None if config.schedule == "auto" else config.schedule


def num_devices(config):
    """Devices the pipeline needs: one per stage, or stages / v when interleaved."""
    return schedules.devices_needed(placing_schedule(config.schedule), config.stages)


# -- one setting at a time: value -> None (fine) or what is wrong -----------------


def _int_at_least(low, what):
    def check(value):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            bound = "a positive integer" if low == 1 else f"an integer >= {low}"
            return f"must be {bound} ({what}), got {value!r}"
        return None
    return check


def _batch_size(value):
    message = _int_at_least(1, "rows per training step")(value)
    if message is None and value > MAX_BATCH:
        return f"must be at most 2**31 - 1 (rows per training step), got {value!r}"
    return message


def _check_model(value):
    if value not in MODEL_DATA:
        return f"unknown model {value!r}; valid choices: {', '.join(sorted(MODEL_DATA))}"
    return None


def _check_dataset(value):
    if not isinstance(value, str):
        return f"must be a string, got {value!r}"
    if value.startswith(data_lib.TFDS_PREFIX):
        if not value[len(data_lib.TFDS_PREFIX):]:
            return "'tfds:' needs a TFDS name, e.g. tfds:mnist"
        return None
    if value != "auto" and value not in data_lib.BUILTIN:
        return (f"unknown dataset {value!r}; valid choices: auto, "
                f"{', '.join(sorted(data_lib.BUILTIN))}, or tfds:NAME (a TensorFlow "
                f"Datasets data set prepared under --data_dir)")
    return None


def _check_schedule(value):
    if value == "auto":
        return None
    match = isinstance(value, str) and re.fullmatch(r"interleaved:([0-9]+)", value.lower())
    if match and int(match.group(1)) < 1:
        return f"interleaved:V needs V >= 1 stages per device, got {value!r}"
    try:
        schedules.get(value)
    except ValueError:
        return (f"unknown schedule {value!r}; valid choices: auto, gpipe, 1f1b, interleaved "
                f"(2 stages per device), interleaved:V (V stages per device, V >= 1), "
                f"zbh1, zbv (2 stages per device, in a V), or NAME/segments=N (each "
                f"stage recomputed in N pieces)")
    return None


def _check_choice(choices):
    def check(value):
        if value not in choices:
            return f"unknown value {value!r}; valid choices: {', '.join(choices)}"
        return None
    return check


def _check_learning_rate(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        return f"must be a finite number > 0, got {value!r}"
    return None


def _check_seed(value):
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        return f"must be an integer from 0 to 2**32 - 1, got {value!r}"
    return None


def _check_model_dir(value):
    if not isinstance(value, str) or not value:
        return "must name a directory"
    if os.path.exists(value) and not os.path.isdir(value):
        return f"{value} exists and is not a directory"
    problems_found = outputs.path_problems(value)
    return problems_found[0] if problems_found else None


_LOCAL_CLUSTER = re.compile(r"local:([0-9]+)")


def _check_cluster(value):
    if not isinstance(value, str):
        return f"must be a string, got {value!r}"
    match = _LOCAL_CLUSTER.fullmatch(value)
    if value in ("", "tf_config") or (match and int(match.group(1)) >= 1):
        return None
    return (f"unknown cluster {value!r}; valid choices: local:N (N >= 1 worker processes on "
            f"this machine), tf_config (the workers in the TF_CONFIG environment variable), "
            f"or empty (this process's own devices)")


_REPLICA_COUNT = re.compile(r"[1-9][0-9]*")


def _check_replicas(value):
    if isinstance(value, str) and (value == "tf_config" or _REPLICA_COUNT.fullmatch(value)):
        return None
    return (f"unknown replicas {value!r}; valid choices: N >= 1 (N data-parallel copies "
            f"of the pipeline in this process, on N x the pipeline's devices), or "
            f"tf_config (this process is one replica of the TF_CONFIG cluster; every "
            f"worker runs the same command)")


def _check_tpu(value):
    if not isinstance(value, str) or any(c.isspace() for c in value):
        return (f"must be a TPU name, grpc://address or local (this Cloud TPU VM's), or "
                f"empty (no TPU), got {value!r}")
    return None


def chief_or_worker(config):
    """None for a process that writes its --model_dir itself; for a worker of a
    --replicas=tf_config cluster, ("chief", 0), or ("worker", k) for one that
    is not the chief (TF_CONFIG's "chief" task, else worker 0), which writes
    in a scratch folder (read without TensorFlow)."""
    if config.replicas != "tf_config":
        return None
    spec = json.loads(os.environ.get("TF_CONFIG") or "{}")
    task = spec.get("task", {})
    kind, index = task.get("type", "worker"), int(task.get("index", 0))
    chief = kind == "chief" or (index == 0 and "chief" not in spec.get("cluster", {}))
    return ("chief", 0) if chief else (kind, index)


DEFAULT_PEER_TIMEOUT = 300.0  # seconds: a tf_config worker's bound on waiting for its peers


def peer_timeout(config):
    """How long a --replicas=tf_config worker waits for its peers (at start-up,
    in a collective, for a stop): --step_timeout, else `DEFAULT_PEER_TIMEOUT`."""
    return float(config.step_timeout or DEFAULT_PEER_TIMEOUT)


def replica_count(replicas):
    """N of --replicas=N; 1 for tf_config (each process holds one pipeline)."""
    return 1 if replicas == "tf_config" else int(replicas)


def _check_step_timeout(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        return f"must be a number of seconds >= 0 (0: no watchdog), got {value!r}"
    return None


def cluster_workers(cluster):
    """How many workers `cluster` ("local:N" or "tf_config") has, read without
    TensorFlow, or a string saying why TF_CONFIG names none."""
    match = _LOCAL_CLUSTER.fullmatch(cluster)
    if match:
        return int(match.group(1))
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return ("--cluster=tf_config reads the workers from the TF_CONFIG environment "
                "variable, which is not set. Set TF_CONFIG='{\"cluster\": {\"worker\": "
                "[\"host0:port\", \"host1:port\"]}}' and on each of those "
                "hosts run a worker: python -m tfpipe.cluster --worker --task=k.")
    try:
        workers = json.loads(raw).get("cluster", {}).get("worker")
    except (ValueError, AttributeError) as err:
        return f"--cluster=tf_config: TF_CONFIG is not a JSON object ({err})."
    if not workers:
        return ("--cluster=tf_config: TF_CONFIG names no \"worker\" job in \"cluster\"; "
                "stage k runs on /job:worker/task:k.")
    return len(workers)


def _check_verbose(value):
    if value not in (None, 0, 1, 2):
        return f"must be None, 0, 1 or 2, got {value!r}"
    return None


def _check_seconds(value):
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < 0):
        return f"must be a number of seconds >= 0 (0: off), got {value!r}"
    return None


def _check_bool(value):
    if not isinstance(value, bool):
        return f"must be True or False, got {value!r}"
    return None


FIELD_CHECKS = {
    "model": _check_model,
    "depth": _int_at_least(0, "0: 4"),
    "dataset": _check_dataset,
    "max_examples": _int_at_least(0, "0: all"),
    "stages": _int_at_least(1, "pipeline stages"),
    "microbatches": _int_at_least(1, "micro-batches per training batch"),
    "schedule": _check_schedule,
    "recompute": _check_choice(RECOMPUTE_MODES),
    "execution": _check_choice(EXECUTIONS),
    "batch_size": _batch_size,
    "epochs": _int_at_least(1, "training epochs"),
    "steps_per_epoch": _int_at_least(0, "0: one pass over the training data"),
    "logical_cpus": _int_at_least(1, "logical CPU devices"),
    "model_dir": _check_model_dir,
    "checkpoint_every": _int_at_least(0, "steps; 0: only at epoch ends and the end"),
    "checkpoint_every_secs": _check_seconds,
    "resume": _check_bool,
    "overwrite": _check_bool,
    "reshard": _check_bool,
    "learning_rate": _check_learning_rate,
    "seed": _check_seed,
    "verbose": _check_verbose,
    "cluster": _check_cluster,
    "step_timeout": _check_step_timeout,
    "replicas": _check_replicas,
    "tpu": _check_tpu,
}


# -- settings that must agree: dict of those settings -> None or what is wrong ----


def _microbatches_fit_the_batch(s):
    m, b = s["microbatches"], s["batch_size"]
    if m > b:
        return (f"--microbatches={m} is more than the training batch (--batch_size={b}): "
                f"{m - b} of the {m} micro-batches of every training step would be empty. "
                f"Use --microbatches <= {b}, or --batch_size >= {m}.")
    return None


def _model_takes_the_dataset(s):
    kind, _ = MODEL_DATA[s["model"]]
    dataset = s["dataset"]
    data_kind = data_lib.BUILTIN_KINDS.get(dataset)
    if data_kind is not None and data_kind != kind:
        models = sorted(n for n, (k, _) in MODEL_DATA.items() if k == data_kind)
        return (f"--model={s['model']} trains on {kind} data, but --dataset={dataset} is "
                f"{data_kind} data (models for it: {', '.join(models)}).")
    return None


def _stages_fit_the_schedule(s):
    try:
        schedules.devices_needed(placing_schedule(s["schedule"]), s["stages"],
                                 s["microbatches"], FLAGS)
    except ValueError as err:
        return str(err)
    return None


def _loop_recomputes(s):
    if s["execution"] == "auto":
        return None
    try:
        tfpipe_config.resolve_recompute(None if s["recompute"] == "auto" else s["recompute"],
                                        s["execution"], FLAGS)
    except ValueError as err:
        return str(err)
    return None


def _reshard_resumes(s):
    if s["reshard"] and not s["resume"]:
        return ("--reshard changes the stage layout of a resumed run; it needs --resume "
                "(a fresh run takes any --stages without it).")
    return None


def _overwrite_or_resume(s):
    if s["overwrite"] and s["resume"]:
        return ("--overwrite starts afresh, deleting the previous run's outputs, and "
                "--resume continues that run: pass one of them.")
    return None


def _cluster_holds_the_stages(s):
    if not s["cluster"]:
        return None
    workers = cluster_workers(s["cluster"])
    if isinstance(workers, str):
        return workers
    needed = schedules.devices_needed(placing_schedule(s["schedule"]), s["stages"])
    if workers < needed:
        fix = (f"--cluster=local:{needed}" if s["cluster"] != "tf_config"
               else f"{needed} workers in TF_CONFIG")
        return (f"--cluster={s['cluster']} has {workers} worker(s), but --stages="
                f"{s['stages']} with --schedule={s['schedule']} needs {needed} (stage k on "
                f"/job:worker/task:k). Use {fix}, or fewer --stages.")
    return None


def _replicas_are_local(s):
    if s["replicas"] != "1" and s["cluster"]:
        return (f"--replicas={s['replicas']} with --cluster={s['cluster']}: data "
                f"parallelism over stages on remote workers is not built. Use --cluster "
                f"(one pipeline over the workers) or --replicas (pipelines here, or one "
                f"per TF_CONFIG worker process), not both.")
    if s["replicas"] == "tf_config":
        raw = os.environ.get("TF_CONFIG")
        try:
            task = json.loads(raw).get("task", {}) if raw else None
        except (ValueError, AttributeError):
            task = None
        if not task or "index" not in task:
            return ("--replicas=tf_config: every worker process runs this command with "
                    "its own TF_CONFIG, which must name the cluster and this process's "
                    "task, e.g. TF_CONFIG='{\"cluster\": {\"worker\": [\"host0:port\", "
                    "\"host1:port\"]}, \"task\": {\"type\": \"worker\", \"index\": 0}}'.")
    return None


def gpus_may_exist():
    """Whether TensorFlow may find a GPU here, read without TensorFlow: an
    NVIDIA (or ROCm) device file, and CUDA_VISIBLE_DEVICES not hiding them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))


def _tpu_holds_the_pipelines(s):
    if not s["tpu"]:
        return None
    if s["cluster"] or s["replicas"] == "tf_config":
        given = f"--cluster={s['cluster']}" if s["cluster"] else "--replicas=tf_config"
        return (f"--tpu={s['tpu']} with {given}: a TPU's replicas are its own cores, "
                f"placed by TPUStrategy. Use --tpu alone (--replicas=N for N pipelines on "
                f"the TPU's cores), or {given} without --tpu.")
    m, r = s["microbatches"], replica_count(s["replicas"])
    if s["batch_size"] % (m * r):
        return (f"--tpu={s['tpu']} compiles one program per replica, so every micro-batch "
                f"has one static size: --batch_size={s['batch_size']} must be a multiple of "
                f"--microbatches x --replicas = {m} x {r} = {m * r}.")
    return None


def _devices_exist(s):
    if s["cluster"] or s["tpu"]:
        return None  # the workers' devices: _cluster_holds_the_stages; a TPU's: when connected
    try:
        needed = schedules.devices_needed(placing_schedule(s["schedule"]), s["stages"])
    except ValueError:
        return None  # _stages_fit_the_schedule says why
    needed *= replica_count(s["replicas"])
    if needed > s["logical_cpus"] and not gpus_may_exist():
        replicas = (f" and --replicas={s['replicas']}" if s["replicas"] not in ("1", "tf_config")
                    else "")
        return (f"--stages={s['stages']} with --schedule={s['schedule']}{replicas} needs "
                f"{needed} devices, but --logical_cpus={s['logical_cpus']} (and there is no "
                f"GPU). Use --logical_cpus={needed}.")
    return None


def _watchdog_watches_a_cluster(s):
    if s["step_timeout"] and not s["cluster"] and s["replicas"] != "tf_config":
        return (f"--step_timeout={s['step_timeout']:g} watches the workers of --cluster or "
                f"--replicas=tf_config, and there are none: use it with --cluster=local:N, "
                f"--cluster=tf_config or --replicas=tf_config.")
    return None


# (settings it reads, check); each runs only when every single setting it reads is fine.
CROSS_CHECKS = [
    (("reshard", "resume"), _reshard_resumes),
    (("overwrite", "resume"), _overwrite_or_resume),
    (("microbatches", "batch_size"), _microbatches_fit_the_batch),
    (("model", "dataset"), _model_takes_the_dataset),
    (("stages", "schedule", "microbatches"), _stages_fit_the_schedule),
    (("execution", "recompute"), _loop_recomputes),
    (("cluster", "stages", "schedule"), _cluster_holds_the_stages),
    (("step_timeout", "cluster", "replicas"), _watchdog_watches_a_cluster),
    (("replicas", "cluster"), _replicas_are_local),
    (("tpu", "cluster", "replicas", "microbatches", "batch_size"), _tpu_holds_the_pipelines),
    (("stages", "schedule", "replicas", "logical_cpus", "cluster", "tpu"), _devices_exist),
]


def problems(config):
    """What is wrong with a `TrainConfig`, as a list of one-line messages (empty: fine)."""
    out = []
    bad = set()
    for name, check in FIELD_CHECKS.items():
        message = check(getattr(config, name))
        if message:
            bad.add(name)
            out.append(f"{name}={getattr(config, name)!r}: {message}")
    settings = dataclasses.asdict(config)
    for names, check in CROSS_CHECKS:
        if not bad.intersection(names):
            message = check(settings)
            if message:
                out.append(message)
    return out


def check(config):
    """Raises `RunError` with the first problem of `config` (see `problems`)."""
    found = problems(config)
    if found:
        raise RunError(found[0])
