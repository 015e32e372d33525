"""Trains a model with tfpipe pipeline parallelism: `python -m launch.train`.

The defaults run offline in well under two minutes on a small CPU machine:
the digits MLP cut into 4 stages on 4 logical CPUs, 4 micro-batches, 3 epochs.

    python -m launch.train --stages=2 --microbatches=8 --epochs=5
    python -m launch.train --model=resnet                 # digits, 8x8 images
    python -m launch.train --model=transformer            # Python's help texts, bytes
    python -m launch.train --model=unet                   # digit ink masks, skip connections
    python -m launch.train --schedule=1f1b --execution=loop
    python -m launch.train --dataset=tfds:mnist --data_dir=/data/tfds   # prepared TFDS
    python -m launch.train --checkpoint_every=20 --resume # continue a stopped run

It writes, under --model_dir: TensorBoard logs (tensorboard/), checkpoints
every --checkpoint_every steps (checkpoints/, each verified on restore and
holding the run's history), every step's loss (history.json, a copy) and a
plot of it (loss.png). `--resume` continues from the newest intact checkpoint
with the same batches the uninterrupted run would have seen.

This module imports no TensorFlow until the flags are parsed, checked
(`launch.config`) and the lock on --model_dir is taken (`launch.run_lock`):
a bad flag or a busy directory is one line, at once. Exit codes: 0 done;
1 bad input (flags, settings, data, nothing intact to resume from, a
--model_dir holding a previous run without --resume or --overwrite, a file
system error); 2 --model_dir in use by another run; 3 diverged (a non-finite
loss or weight); 4 a worker of --cluster froze or died (named in the
message); 128 + N stopped by signal N (SIGTERM 143, SIGINT 130, SIGHUP 129)
after finishing the step and saving a checkpoint (`launch.signals`).

    python -m launch.train --cluster=local:2 --stages=2 --step_timeout=60
    TF_CONFIG='{"cluster": {"worker": ["host0:2222", "host1:2222"]}}' \
        python -m launch.train --cluster=tf_config --stages=2
    python -m launch.train --replicas=2 --stages=2 --logical_cpus=4   # 2 x 2 grid
    TF_CONFIG='{"cluster": {"worker": ["h0:2222", "h1:2222"]}, "task": {"type": "worker", "index": K}}' \
        python -m launch.train --replicas=tf_config --stages=2   # on host K, K = 0, 1
    python -m launch.train --tpu=local --stages=4 --replicas=2  # a v3-8 TPU VM's cores

TensorFlow starts quietly: TF_CPP_MIN_LOG_LEVEL is 2 unless the user set it
(errors still show), and the messages TensorFlow's C++ libraries print while
they load, which ignore that level, are filtered by it (`quiet_start_up`).

Tests and other code call `train(TrainConfig(...))` directly, without flags.
"""

import contextlib
import dataclasses
import math
import os
import shutil
import sys
import tempfile

# TensorFlow's C++ log level (0: all, 1: no INFO, 2: no WARNING either, 3: no ERROR
# either), read when TensorFlow loads. 2 unless the user chose: quiet, errors visible.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

from launch import config as config_lib  # noqa: E402
from launch import data as data_lib  # noqa: E402
from launch import outputs  # noqa: E402
from launch import run_lock  # noqa: E402
from launch import signals  # noqa: E402
from launch import supervisor  # noqa: E402
from launch.quiet import quiet_start_up  # noqa: E402
from launch.config import TrainConfig  # noqa: E402
from launch.errors import RunError, Stopped  # noqa: E402

MODEL_NAMES = sorted(config_lib.MODEL_DATA)
DATASETS = data_lib.BUILTIN


def train(config, callbacks=(), scratch=None):
    """Trains `config.model` on `config.dataset` as a tfpipe pipeline.

    Batches are drawn by `launch.data.BatchOrder`, a pure function of the
    global step; checkpoints hold the model, the optimizer, the step and the
    history. With `config.resume` the run restores the newest intact
    checkpoint in `config.model_dir` (after compile, so the optimizer slots
    already exist on the stage devices), skipping damaged ones with a warning
    that names them, and continues with the batches the uninterrupted run
    would have drawn: 2N steps, or N steps + resume + N steps, give the same
    weights and history, bit for bit. Without it, a model_dir holding a
    previous run's outputs is refused, or with `config.overwrite` those
    outputs (and nothing else) are deleted first.

    SIGTERM, SIGINT and SIGHUP (in the main thread) finish the step, save a
    checkpoint and raise `Stopped` (exit code 128 + the signal's number);
    `--resume` continues exactly (`launch.signals`).

    Args:
      config: a `TrainConfig`.
      callbacks: more Keras callbacks for `fit`, after launch.train's own.
      scratch: for a --replicas=tf_config worker that is not the chief, the
        folder it writes in (see `scratch_folder`; None: one of its own,
        removed at the end).

    Returns:
      A dict: "history" (per-epoch lists, as Keras' History.history, over the
      whole run including steps before a resume), "train_loss",
      "train_accuracy", "val_loss", "val_accuracy" (final epoch),
      "step_time_ms" (mean training step of this process, first step left
      out; None if this process trained no step), "steps" (global steps
      done), "start_step" (where this process began), "checkpoint" (latest
      checkpoint path), "loss_plot" (PNG path), "pipeline_summary" (text) and
      "model" (the trained `PipelinedModel`).

    Raises:
      RunError (a ValueError): a bad setting (the same checks as the flags),
        a model/data mismatch, an unprepared TFDS data set, more stages than
        devices, a resume whose settings differ from the checkpointed run's,
        or checkpoint files of which none is intact (nothing is changed).
      ModelDirBusy (a RunError): another run holds `config.model_dir`.
      Diverged (a RunError): a non-finite loss or weight; nothing
        non-finite was saved.
      Stopped (a RunError): a signal stopped the run after it saved.
      ImportError: the tensorboard package is missing.
    """
    config_lib.check(config)
    role = config_lib.chief_or_worker(config)
    if role is not None and role[0] != "chief":
        return _train_beside_the_chief(config, callbacks, scratch)
    return _train(config, callbacks)


def scratch_folder(config):
    """For a --replicas=tf_config worker that is not the chief, a new scratch
    folder to write in (the caller removes it); else None."""
    role = config_lib.chief_or_worker(config)
    if role is None or role[0] == "chief":
        return None
    return tempfile.mkdtemp(prefix=f"launch-train-{role[0]}{role[1]}-")


def _train_beside_the_chief(config, callbacks, scratch):
    """A --replicas=tf_config worker that is not the chief: one --model_dir for
    the cluster means the chief writes it; this worker trains the same steps,
    writing in `scratch` (a folder removed at the end; None: one made here),
    and resumes from the chief's checkpoints (Keras' convention for
    multi-worker callbacks)."""
    if not (config.resume or config.overwrite) and outputs.find(config.model_dir):
        _prepare_model_dir(dataclasses.replace(config, overwrite=False))  # refused as the chief is
    own = scratch is None
    scratch = scratch or scratch_folder(config)
    try:
        result = _train(dataclasses.replace(config, model_dir=scratch, overwrite=False),
                        callbacks, resume_from=os.path.join(config.model_dir,
                                                            outputs.CHECKPOINT_DIR))
    finally:
        if own:
            shutil.rmtree(scratch, ignore_errors=True)
    # What it wrote is gone: the run's files are the chief's.
    return dict(result, loss_plot=os.path.join(config.model_dir, outputs.LOSS_PLOT),
                timeline=None, timeline_summary=None)


def _train(config, callbacks, resume_from=None):
    with signals.StopRequest() as stop:
        started = False
        try:
            # Start-up has nothing to save: a signal abandons it at once.
            with stop.interrupting(), contextlib.ExitStack() as held:
                lock = held.enter_context(run_lock.RunLock(config.model_dir))
                stop.on_hard_exit(lock.release)  # a second signal exits at once: unlocked
                if lock.previous:
                    print(f"launch.train: warning: taking over --model_dir={config.model_dir} "
                          f"from a run that ended without releasing it ({lock.previous}).",
                          file=sys.stderr, flush=True)
                record = _prepare_model_dir(config)
                with quiet_start_up():
                    from launch import trainer  # pylint: disable=import-outside-toplevel
                held = held.pop_all()  # the lock stays held for the run below
            started = True
            with held:
                return trainer.train(config, callbacks, stop, before_save=lock.check,
                                     record=record, resume_from=resume_from)
        except signals.Interrupted as err:
            raise _stopped_before_first_step(err.signum) from None
        except Exception:  # pylint: disable=broad-except
            # An interrupted start-up can come out as another error: a signal
            # handled inside a C extension's initialisation (TensorFlow's) leaves
            # it as that module's SystemError or ImportError (exit 1 in CI once).
            if started or stop.signum is None:
                raise
            raise _stopped_before_first_step(stop.signum) from None


def _stopped_before_first_step(signum):
    return Stopped(f"{signals.Interrupted(signum)} before the first step: nothing was saved "
                   f"(a checkpoint already in --model_dir is as it was).",
                   signals.exit_code(signum))


def _prepare_model_dir(config):
    """Before TensorFlow starts, holding the lock: a fresh run refuses a
    --model_dir that holds a previous run's outputs, unless --overwrite, which
    deletes those and only those (`launch.outputs`). Returns the run's
    `outputs.Record`, its folders made (and recorded where this run made them)."""
    model_dir = config.model_dir
    found = [] if config.resume else outputs.find(model_dir)
    if found and not config.overwrite:
        raise RunError(
            f"--model_dir={model_dir} holds a previous run "
            f"({outputs.describe(found, model_dir)}). Continue it with --resume, "
            f"start afresh with --overwrite (deletes only the files launch.train wrote), or "
            f"pass another --model_dir.")
    if found:
        removed, notes = outputs.remove(model_dir)
        for note in notes:
            print(f"launch.train: warning: --overwrite: {note}.", file=sys.stderr, flush=True)
        print(f"--overwrite: removed the {len(removed)} file(s) the previous run wrote in "
              f"{model_dir}.", flush=True)
    record = outputs.Record(model_dir)
    if config.resume and not record.exists:
        # Written before the record: its files are the trainer's by their manifests.
        for path in outputs.legacy_files(model_dir):
            record.add(path)
    for folder in outputs.run_folders(config.timeline):
        record.make_dir(os.path.join(model_dir, folder))
    return record




# -- command line ---------------------------------------------------------------

_DEFAULTS = TrainConfig()
FLAGS = flags.FLAGS

flags.DEFINE_enum("model", _DEFAULTS.model, MODEL_NAMES,
                  "Model to train (mlp and resnet take images, unet segmentation masks, "
                  "transformer text).")
flags.DEFINE_integer("depth", _DEFAULTS.depth,
                     "Hidden layers (mlp), residual blocks (resnet) or Transformer blocks "
                     "(transformer); 0: 4. Raised to at least --stages (a block per stage).")
flags.DEFINE_string(
    "dataset", _DEFAULTS.dataset,
    f"Data set: auto (the model's default: digits for mlp/resnet, digits_masks for "
    f"unet, pydoc_topics for transformer), one of {sorted(DATASETS)} (built in, no "
    f"download: digits is scikit-learn's 8x8 digits; digits_masks the same at 16x16 "
    f"with per-pixel ink labels; pydoc_topics is the English help text of Python's "
    f"stdlib pydoc_data.topics as bytes), or tfds:NAME for a TensorFlow Datasets data "
    f"set already prepared under --data_dir (image + label, or text; never downloaded).")
flags.DEFINE_string("data_dir", _DEFAULTS.data_dir,
                    "TFDS data directory for --dataset=tfds:NAME (default: TFDS's own, "
                    "~/tensorflow_datasets or $TFDS_DATA_DIR).")
flags.DEFINE_integer("max_examples", _DEFAULTS.max_examples,
                     "If > 0, use at most this many examples of each split.")
flags.DEFINE_integer("stages", _DEFAULTS.stages,
                     "Pipeline stages K; stage k runs on device k (GPU k, else logical CPU "
                     "k), or on device k mod D with --schedule=interleaved[:v] (D = K / v).")
flags.DEFINE_integer("microbatches", _DEFAULTS.microbatches,
                     "Micro-batches M per training batch; at most --batch_size (a divisor "
                     "of it keeps the micro-batches the same size).")
flags.DEFINE_string("schedule", _DEFAULTS.schedule,
                    "Pipeline schedule: auto (tfpipe's choice, measured: zbh1 for "
                    "2 <= --microbatches < 8 unrolled, else gpipe; gpipe where the loss needs "
                    "every forward first), gpipe, 1f1b, interleaved (2 stages per device), "
                    "interleaved:v (v per device), zbh1 (zero-bubble: each backward split "
                    "into input and weight halves), zbv (zero-bubble, 2 stages per device in "
                    "a V) or NAME/segments=N; passed to tfpipe.PipelineStrategy(schedule=...).")
flags.DEFINE_enum("recompute", _DEFAULTS.recompute, list(config_lib.RECOMPUTE_MODES),
                  "Activation recomputation: always, except_last, never, or auto "
                  "(tfpipe's choice from memory, never where it fits; always for "
                  "--execution=loop).")
flags.DEFINE_enum("execution", _DEFAULTS.execution, list(config_lib.EXECUTIONS),
                  "auto: tfpipe's choice (stage_functions from --microbatches=8 on, except "
                  "for zbh1/zbv; else unrolled); unrolled: every action traced (graph grows "
                  "with M); stage_functions: each stage traced once, called per micro-batch; "
                  "loop: a tf.while_loop over clock ticks (graph independent of M; recompute "
                  "always).")
flags.DEFINE_bool("timeline", _DEFAULTS.timeline,
                  "At the end, time one step per stage and write a Chrome trace and a PNG "
                  "Gantt chart to --model_dir/timeline (and TensorBoard's Images).")
flags.DEFINE_integer("batch_size", _DEFAULTS.batch_size, "Mini-batch size (rows per step).")
flags.DEFINE_integer("epochs", _DEFAULTS.epochs, "Training epochs (>= 1).")
flags.DEFINE_integer("steps_per_epoch", _DEFAULTS.steps_per_epoch,
                     "Steps per epoch; 0: one pass over the training data. Batches are "
                     "drawn in seeded passes, so epochs need not align with passes.")
flags.DEFINE_integer("logical_cpus", _DEFAULTS.logical_cpus,
                     "Logical CPU devices to split the CPU into (>= the pipeline's devices: "
                     "--stages, or --stages / v when interleaved).")
flags.DEFINE_string("model_dir", _DEFAULTS.model_dir,
                    "Output folder: tensorboard/ (logs), checkpoints/, history.json "
                    "(every step's loss) and loss.png. A fresh run refuses one that holds "
                    "a previous run (--resume, --overwrite). One run at a time: a second "
                    "run on it stops at once (exit code 2).")
flags.DEFINE_integer("checkpoint_every", _DEFAULTS.checkpoint_every,
                     "Save a checkpoint (model, optimizer, step, history) every this many "
                     "steps; 0: none by count. An epoch without one saves at its end, a "
                     "signal (SIGTERM, SIGINT, SIGHUP) saves before the run exits, and the "
                     f"final state is always saved; the newest {config_lib.KEEP_CHECKPOINTS} "
                     "are kept.")
flags.DEFINE_float("checkpoint_every_secs", _DEFAULTS.checkpoint_every_secs,
                   "Also save a checkpoint when this many seconds have passed since the "
                   "last one (for preemptible machines); 0: off. Every epoch without a "
                   "checkpoint saves one at its end.")
flags.DEFINE_bool("overwrite", _DEFAULTS.overwrite,
                  "Start afresh in a --model_dir that holds a previous run, deleting the "
                  "files that run wrote (its checkpoints, history.json, loss.png, "
                  "TensorBoard and timeline files) and nothing else. Without it such a "
                  "directory is refused (use --resume to continue the run).")
flags.DEFINE_bool("resume", _DEFAULTS.resume,
                  "Continue from the newest intact checkpoint in --model_dir (same batches "
                  "and loss curve as if never stopped; damaged checkpoints are skipped and "
                  "named). Starts afresh only if there is no checkpoint file at all; refuses "
                  "(exit code 1, nothing changed) if there are some but none is intact.")
flags.DEFINE_bool("reshard", _DEFAULTS.reshard,
                  "With --resume: accept a checkpoint written at another --stages "
                  "(or --schedule, --microbatches, --execution). Variables and optimizer "
                  "slots are matched by the model's layers, not by stage, so the run "
                  "continues exactly; a checkpoint of another architecture is refused.")
flags.DEFINE_float("learning_rate", _DEFAULTS.learning_rate,
                   "Adam learning rate. Training stops with exit code 3 at the first "
                   "non-finite loss; no non-finite checkpoint is ever saved.")
flags.DEFINE_integer("seed", _DEFAULTS.seed, "Seed of the initial weights and the data order.")
flags.DEFINE_string("cluster", _DEFAULTS.cluster,
                    "Stages on other processes (TensorFlow's gRPC runtime; this process is "
                    "the single client): local:N starts N worker processes on 127.0.0.1, "
                    "tf_config connects to the workers in the TF_CONFIG environment variable. "
                    "Stage k runs on /job:worker/task:k. Empty: this process's devices.")
flags.DEFINE_string("replicas", _DEFAULTS.replicas,
                    "Data parallel x pipeline. N: N copies of the pipeline in this process "
                    "(N x the pipeline's devices), each on 1/N of every batch. tf_config: "
                    "this process is one replica of the cluster in TF_CONFIG (every worker "
                    "runs the same command with its own task and the same --model_dir, "
                    "which only the chief writes: task 0, or TF_CONFIG's chief). "
                    "--batch_size is the global batch.")
flags.DEFINE_string("tpu", _DEFAULTS.tpu,
                    "Stages on a TPU's cores (tf.distribute.TPUStrategy): local on a Cloud "
                    "TPU VM, else the TPU's name or grpc:// address (TPUClusterResolver). "
                    "Stage k runs on logical core k of each replica; --replicas=N pipelines "
                    "share the TPU's cores; checkpoints are written from this host. Every "
                    "batch has --batch_size rows (a pass's remainder is left out). Empty: "
                    "no TPU.")
flags.DEFINE_float("step_timeout", _DEFAULTS.step_timeout,
                   "With --cluster: seconds a step may stall before every worker's port is "
                   "probed; a frozen or dead worker ends the run with exit code 4, naming "
                   "the task (tfpipe.StepWatchdog). 0: no watchdog. With --replicas=tf_config "
                   f"(0: {config_lib.DEFAULT_PEER_TIMEOUT:g} s): also the bound on the "
                   "start-up rendezvous, on each collective and on a stop, after which a "
                   "worker whose peer is gone or frozen ends (exit code 4, or 128 + the "
                   "signal's number).")


def _register_validators():
    """The checks of `launch.config` as flag validators: a bad flag is one line."""
    enums = {"model", "recompute", "execution"}  # absl's own parser names the choices
    for name, check in config_lib.FIELD_CHECKS.items():
        if name in FLAGS and name not in enums:
            def validate(value, check=check):
                message = check(value)
                if message:
                    raise flags.ValidationError(message)
                return True
            flags.register_validator(name, validate)
    for names, check in config_lib.CROSS_CHECKS:
        def validate_all(values, names=names, check=check):
            if any(config_lib.FIELD_CHECKS[n](values[n]) for n in names):
                return True  # the single-flag validator says what is wrong
            message = check(values)
            if message:
                raise flags.ValidationError(message)
            return True
        flags.register_multi_flags_validator(list(names), validate_all)


_register_validators()


def config_from_flags():
    return TrainConfig(**{field.name: FLAGS[field.name].value
                          for field in dataclasses.fields(TrainConfig)
                          if field.name in FLAGS})


def format_summary(config, result):
    """The text `main` prints at the end of a run."""
    lines = [
        "",
        f"final train loss      {result['train_loss']:.4f}",
        f"final train accuracy  {result['train_accuracy']:.4f}",
        f"final val loss        {result['val_loss']:.4f}",
        f"final val accuracy    {result['val_accuracy']:.4f}",
    ]
    if result["data_kind"] == "text":
        lines.append(f"val bits per byte     {result['val_loss'] / math.log(2):.3f}")
    step_time = result["step_time_ms"]
    lines += [
        f"steps                 {result['steps']} (this run: from step {result['start_step']})",
        (f"mean step time        {step_time:.2f} ms" if step_time is not None else
         "mean step time        - (no step ran in this process)"),
        f"TensorBoard logs      {os.path.join(config.model_dir, 'tensorboard')}",
        f"latest checkpoint     {result['checkpoint']}",
        f"loss curve            {result['loss_plot']}",
    ]
    if result.get("timeline"):
        lines.append(f"pipeline timeline     {result['timeline']}")
        lines.append(f"  one measured step:  {result['timeline_summary']}")
    lines += [
        result["pipeline_summary"],
    ]
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        print(f"launch.train: error: unexpected arguments {argv[1:]} (flags take the form "
              f"--name=value; --helpfull lists them)", file=sys.stderr)
        return 1
    if not FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)  # no INFO lines from TF's savers
    config = config_from_flags()
    role = config_lib.chief_or_worker(config)
    if role is None:
        return _main(config)
    # A tf_config worker: its run in a supervised child (`launch.supervisor`).
    scratch = scratch_folder(config)
    lock = os.path.join(scratch or config.model_dir, run_lock.LOCK_FILE)
    return supervisor.run(lambda: _main(config, scratch), config_lib.peer_timeout(config),
                          lock, cleanup=lambda: scratch and shutil.rmtree(scratch, True))


def _main(config, scratch=None):
    """Runs `config` and prints what the run did; returns the exit code."""
    try:
        result = train(config, scratch=scratch)
    except RunError as err:
        print(f"launch.train: {err.label}: {err}", file=sys.stderr, flush=True)
        if isinstance(err, Stopped):
            signals.ignore_while_exiting()  # stopped: a later signal cannot change the status
        return err.exit_code
    except OSError as err:  # the file system: permissions, a full disk, a vanished path
        where = f" ({err.filename})" if err.filename else ""
        print(f"launch.train: error: {err.strerror or err}{where}. Nothing after the newest "
              f"committed checkpoint was saved.", file=sys.stderr, flush=True)
        return 1
    except MemoryError as err:
        print(f"launch.train: error: out of memory ({err or 'MemoryError'}) with "
              f"--batch_size={config.batch_size}. Use a smaller --batch_size (or --stages, "
              f"--microbatches to spread it). Nothing after the newest committed checkpoint "
              f"was saved.", file=sys.stderr, flush=True)
        return 1
    except Exception as err:  # pylint: disable=broad-except
        if not type(err).__module__.startswith("tensorflow"):
            raise
        # TensorFlow's own errors (resources, devices): one line, its first.
        message = str(getattr(err, "message", err)).strip().splitlines()
        print(f"launch.train: error: TensorFlow {type(err).__name__}: "
              f"{message[0][:300] if message else ''}. Nothing after the newest committed "
              f"checkpoint was saved.", file=sys.stderr, flush=True)
        return 1
    print(format_summary(config, result))
    return 0


if __name__ == "__main__":
    app.run(main)
