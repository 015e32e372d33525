"""Checkpoints that are verified on restore, the run's history inside them, and resuming.

Layout under MODEL_DIR/checkpoints, for a checkpoint after N steps:

    ckpt-N.index, ckpt-N.data-00000-of-00001   tf.train.Checkpoint.write: the model's
                                               variables, the optimizer's, the step
    ckpt-N.manifest.json                       the commit record (below)
    checkpoint                                 TF's state file, for TF's own tools only

A save writes the TensorFlow files under a unique temporary prefix
(`.ckpt-N.tmp-PID-RANDOM`), fsyncs and renames them to `ckpt-N.*`, then writes
the manifest: the step, the size and SHA-256 of each file, the run's whole
history up to step N, and a SHA-256 of all that. The manifest is written last
and atomically (`atomic_write`), so it is the commit: a checkpoint without one
was interrupted mid-write. Only after the commit are older checkpoints deleted
(the newest `keep` stay; each loses its manifest first).

A restore lists the checkpoints from the files, never from the state file
(which may be garbled or stale), and takes the newest whose manifest and
files all match: a truncated or flipped-byte data file, an empty index, a
missing file or a damaged manifest is skipped with its reason, and the files
of skipped checkpoints are moved to checkpoints/skipped/. If checkpoint files
exist but none is intact, `--resume` refuses and changes nothing.

The history (`RunHistory`: every step's own loss and metrics, every epoch's
validation metrics, the run's settings) is restored from the manifest of the
checkpoint itself, so the two cannot disagree, and the settings check of a
resume never depends on another file. MODEL_DIR/history.json is a copy for
people and plots, rewritten with every checkpoint; it is never read back.

Keras reports at each batch the running mean of the loss and metrics since
the epoch began. `StepRecorder` resets the metrics after every batch, so what
Keras reports is each step's own value, exactly; it records those, and puts
back into Keras' logs the running means over the whole epoch computed from
the history, so a mid-epoch resume reports the same epoch means as a run that
never stopped. It also stops the run at the first non-finite loss
(`Diverged`), and `Checkpointer` refuses to save non-finite weights: no
checkpoint ever holds a NaN, so the newest checkpoint is always the last
finite state.
"""

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import re
import secrets
import shutil
import tempfile

import keras
import numpy as np
import tensorflow as tf

from launch import config as config_lib
from launch.config import Diverged, RunError

HISTORY_FILE = "history.json"
CHECKPOINT_DIR = "checkpoints"
LOSS_PLOT = "loss.png"
TENSORBOARD_DIR = "tensorboard"
STATE_FILE = "checkpoint"  # TF's CheckpointManager state file name
SKIPPED_DIR = "skipped"
MANIFEST = ".manifest.json"
FORMAT = 1
KEEP = config_lib.KEEP_CHECKPOINTS

_CKPT_FILE = re.compile(r"ckpt-([0-9]+)(\..+)$")


# -- files ----------------------------------------------------------------------


def atomic_write(path, data):
    """Writes `data` (str or bytes) to `path`: all of it, or nothing.

    The bytes go to a uniquely named temporary file in the same directory
    (`.NAME.RANDOM.tmp`), which is fsynced and renamed over `path`; then the
    directory is fsynced. A crash leaves the old file or the new one, plus at
    most a temporary file (`remove_temporary_files` clears those).
    """
    path = pathlib.Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from others
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_temporary_files(directory):
    """Deletes what interrupted writes left in `directory`: `.NAME.*.tmp` files
    (`atomic_write`) and `.ckpt-N.tmp-*` files and directories (checkpoint saves).
    Call it only while holding the run's lock."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if entry.name.startswith(".") and (entry.name.endswith(".tmp") or ".tmp-" in entry.name):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _canonical(body):
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


# -- history ----------------------------------------------------------------------


class RunHistory:
    """Per-step training metrics and per-epoch validation metrics of one run.

    Attributes:
      run: dict of the settings that fix the data order and the variables
        (model, dataset, stages, batch size, ...); a resume must match them.
      steps: list of {"step": s (steps done, 1-based), "rows": batch rows,
        "loss": ..., <metric>: ...}, in order: each step's own values.
      epochs: list of {"epoch": e (1-based), "step": s, "val_loss": ..., ...}.
    """

    def __init__(self, path, run, steps=None, epochs=None):
        self.path = pathlib.Path(path)
        self.run = dict(run)
        self.steps = list(steps or [])
        self.epochs = list(epochs or [])

    def to_json(self):
        return {"run": self.run, "steps": self.steps, "epochs": self.epochs}

    @classmethod
    def from_json(cls, path, saved):
        return cls(path, saved["run"], saved["steps"], saved["epochs"])

    def save(self):
        """Writes the history.json copy atomically (never read back by a resume)."""
        atomic_write(self.path, json.dumps(self.to_json()))

    def mismatches(self, run):
        """{key: (recorded, now)} for the run settings that differ."""
        keys = set(self.run) | set(run)
        return {k: (self.run.get(k), run.get(k)) for k in sorted(keys)
                if self.run.get(k) != run.get(k)}

    def steps_of_epoch(self, epoch):
        """The step entries of epoch `epoch` (0-based), in order."""
        spe = self.run["steps_per_epoch"]
        return [s for s in self.steps if epoch * spe < s["step"] <= (epoch + 1) * spe]

    def per_epoch(self):
        """Keras-History-style dict of per-epoch lists: loss, metrics, val_*.

        Training values are the row-weighted means of the epoch's steps: what
        Keras shows at the end of an uninterrupted epoch.
        """
        steps_per_epoch = self.run["steps_per_epoch"]
        out = {}
        done = self.steps[-1]["step"] if self.steps else 0
        num_epochs = -(-done // steps_per_epoch)  # the last one may be partial
        val = {e["epoch"]: e for e in self.epochs}
        for epoch in range(1, num_epochs + 1):
            rows = self.steps_of_epoch(epoch - 1)
            if not rows:
                continue
            weights = np.array([s["rows"] for s in rows], dtype="float64")
            for key in rows[0]:
                if key in ("step", "rows"):
                    continue
                values = np.array([s[key] for s in rows], dtype="float64")
                out.setdefault(key, []).append(float(np.sum(values * weights) / np.sum(weights)))
            for key, value in val.get(epoch, {}).items():
                if key.startswith("val_"):
                    out.setdefault(key, []).append(value)
        return out

    def plot_loss(self, path):
        """Writes a PNG: each step's training loss, epoch means and validation loss."""
        # The object-oriented API with the Agg canvas: no pyplot state and no
        # global backend switch in the calling process.
        # pylint: disable=import-outside-toplevel
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        if self.steps:
            ax.plot([s["step"] for s in self.steps], [s["loss"] for s in self.steps],
                    color="tab:blue", alpha=0.35, linewidth=1, label="train loss (step)")
            epochs = self.per_epoch()
            middles = [(e - 0.5) * self.run["steps_per_epoch"]
                       for e in range(1, len(epochs.get("loss", [])) + 1)]
            ax.plot(middles, epochs["loss"], "o-", color="tab:blue",
                    label="train loss (epoch mean)")
            val = [e for e in self.epochs if "val_loss" in e]
            if val:
                ax.plot([e["step"] for e in val], [e["val_loss"] for e in val], "s-",
                        color="tab:orange", label="validation loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"{self.run.get('model')} on {self.run.get('dataset')}, "
                     f"{self.run.get('stages')} stage(s)")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)


# -- checkpoints ----------------------------------------------------------------------


class Damaged(Exception):
    """A checkpoint that cannot be used; the message says why."""


@dataclasses.dataclass
class Found:
    """What `CheckpointStore.find` saw.

    Attributes:
      step: the newest intact checkpoint's step, or None.
      manifest: its manifest (a dict), or None.
      skipped: [(name, reason)] of newer checkpoints that are not intact.
      notes: other things worth saying (e.g. a garbled state file).
      any_files: whether any checkpoint file exists at all.
    """

    step: int | None
    manifest: dict | None
    skipped: list
    notes: list
    any_files: bool


class CheckpointStore:
    """The checkpoints of one run: save, list, verify, restore, rotate.

    Args:
      directory: MODEL_DIR/checkpoints.
      checkpoint: the `tf.train.Checkpoint` (model, optimizer, step) to write
        and restore into.
      keep: how many committed checkpoints to keep.
    """

    def __init__(self, directory, checkpoint, keep=KEEP):
        self.dir = pathlib.Path(directory)
        self.checkpoint = checkpoint
        # tf.train.CheckpointOptions or None. With stages on other hosts, the
        # trainer sets experimental_io_device to this process's CPU, so that
        # every file is written here (not each shard on its worker's disk).
        self.options = None
        self.keep = int(keep)
        self.latest_step = None  # the newest committed step this process knows

    def path(self, step):
        return str(self.dir / f"ckpt-{step}")

    @property
    def latest_path(self):
        return None if self.latest_step is None else self.path(self.latest_step)

    # -- listing and verifying --------------------------------------------------

    def files_by_step(self):
        """{step: [file names]} of every `ckpt-N.*` file in the directory."""
        out = {}
        if self.dir.is_dir():
            for entry in self.dir.iterdir():
                match = _CKPT_FILE.fullmatch(entry.name)
                if match and entry.is_file():
                    out.setdefault(int(match.group(1)), []).append(entry.name)
        return out

    def verify(self, step):
        """The manifest of checkpoint `step` if it and every file it lists are
        intact; else raises `Damaged` with the reason."""
        name = f"ckpt-{step}"
        manifest_path = self.dir / (name + MANIFEST)
        if not manifest_path.exists():
            raise Damaged(f"it has no {name}{MANIFEST}: its write did not finish (or an "
                          f"older launch.train wrote it)")
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            body = {k: v for k, v in manifest.items() if k != "sha256"}
            ok = hashlib.sha256(_canonical(body).encode()).hexdigest() == manifest["sha256"]
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise Damaged(f"{name}{MANIFEST} is unreadable ({type(err).__name__}: {err})") \
                from None
        if not ok:
            raise Damaged(f"{name}{MANIFEST} does not match its own checksum (damaged)")
        if manifest.get("format") != FORMAT or manifest.get("step") != step:
            raise Damaged(f"{name}{MANIFEST} describes format {manifest.get('format')!r}, "
                          f"step {manifest.get('step')!r}")
        for file_name, expected in sorted(manifest["files"].items()):
            path = self.dir / file_name
            if not path.exists():
                raise Damaged(f"{file_name} is missing")
            size = path.stat().st_size
            if size != expected["size"]:
                raise Damaged(f"{file_name} has {size} bytes, {expected['size']} expected "
                              f"({'truncated' if size < expected['size'] else 'damaged'})")
            if _sha256(path) != expected["sha256"]:
                raise Damaged(f"{file_name} does not match its checksum (damaged)")
        return manifest

    def _state_file_step(self, notes):
        """The step TF's state file names as the newest, noting a garbled file."""
        path = self.dir / STATE_FILE
        if not path.exists():
            return None
        text = path.read_text(encoding="utf-8", errors="replace")
        match = re.search(r'^model_checkpoint_path: "(?:.*/)?ckpt-([0-9]+)"$', text, re.M)
        if not match:
            notes.append(f"{path} is unreadable; the checkpoint list was rebuilt from the "
                         f"checkpoint files")
            return None
        return int(match.group(1))

    def find(self):
        """The newest intact checkpoint, and the newer ones skipped (see `Found`)."""
        notes, skipped = [], []
        on_disk = self.files_by_step()
        listed = self._state_file_step(notes)
        if listed is not None and listed not in on_disk and (
                not on_disk or listed > max(on_disk)):
            skipped.append((f"ckpt-{listed}", f"{self.dir / STATE_FILE} lists it, but its "
                                              f"files are gone"))
        for step in sorted(on_disk, reverse=True):
            try:
                manifest = self.verify(step)
            except Damaged as err:
                skipped.append((f"ckpt-{step}", str(err)))
                continue
            return Found(step, manifest, skipped, notes, True)
        return Found(None, None, skipped, notes, bool(on_disk))

    def set_aside(self, names):
        """Moves the files of the checkpoints `names` (e.g. "ckpt-9") to skipped/."""
        on_disk = self.files_by_step()
        target = self.dir / SKIPPED_DIR
        for name in names:
            step = int(name.split("-")[1])
            for file_name in on_disk.get(step, []):
                target.mkdir(exist_ok=True)
                os.replace(self.dir / file_name, target / file_name)
        _fsync_dir(self.dir)

    # -- restore ------------------------------------------------------------------

    def restore(self, step, manifest, history_path, strict=False):
        """Restores checkpoint `step` into the existing variables; returns its
        `RunHistory`. `strict`: every saved value must find its variable and
        every variable its value (a resharded resume: nothing may be left over)."""
        try:
            status = self.checkpoint.read(self.path(step), options=self.options)
            if strict:
                status.assert_consumed()
            else:
                status.assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as err:
            raise RunError(
                f"--resume: {self.path(step)} is intact but does not fit this model "
                f"({type(err).__name__}: {str(err).splitlines()[0][:300]}). Was it written "
                f"by another version of the model code"
                f"{' or another architecture (--depth, when not given, grows with --stages: pass the depth of the run you resume)' if strict else ''}"
                f"? Use another --model_dir.") from None
        self.latest_step = step
        return RunHistory.from_json(history_path, manifest["history"])

    # -- save ---------------------------------------------------------------------

    def save(self, step, history):
        """Writes checkpoint `step` with `history`, commits it, then rotates."""
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"ckpt-{step}"
        self._delete(step)  # leftovers of an interrupted write of this step
        tmp = self.dir / f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        self.checkpoint.write(str(tmp), options=self.options)
        files = {}
        for written in sorted(self.dir.glob(tmp.name + ".*")):
            final = self.dir / (name + written.name[len(tmp.name):])
            with open(written, "rb") as f:
                os.fsync(f.fileno())
            os.replace(written, final)
            files[final.name] = {"size": final.stat().st_size, "sha256": _sha256(final)}
        _fsync_dir(self.dir)
        body = {"format": FORMAT, "step": int(step), "files": files,
                "history": history.to_json()}
        manifest = dict(body, sha256=hashlib.sha256(_canonical(body).encode()).hexdigest())
        atomic_write(self.dir / (name + MANIFEST), json.dumps(manifest))  # the commit
        self.latest_step = int(step)
        self._rotate()
        self._write_state()
        return self.path(step)

    def committed_steps(self):
        return sorted(s for s, names in self.files_by_step().items()
                      if f"ckpt-{s}{MANIFEST}" in names)

    def _delete(self, step):
        """Deletes checkpoint `step`: its manifest first, so it is never half there
        and committed."""
        names = self.files_by_step().get(step, [])
        for file_name in sorted(names, key=lambda n: not n.endswith(MANIFEST)):
            (self.dir / file_name).unlink(missing_ok=True)

    def _rotate(self):
        kept = self.committed_steps()[-self.keep:]
        for step in self.files_by_step():
            if step < kept[0]:
                self._delete(step)

    def _write_state(self):
        """TF's state file (for tf.train.latest_checkpoint and TensorBoard); a copy,
        never trusted by `find`."""
        steps = self.committed_steps()
        lines = [f'model_checkpoint_path: "ckpt-{steps[-1]}"']
        lines += [f'all_model_checkpoint_paths: "ckpt-{s}"' for s in steps]
        atomic_write(self.dir / STATE_FILE, "\n".join(lines) + "\n")


def non_finite_variables(variables):
    """Names of the floating-point variables that hold a NaN or an infinity."""
    bad = []
    for v in variables:
        if (tf.as_dtype(v.dtype).is_floating
                and not bool(tf.reduce_all(tf.math.is_finite(getattr(v, "value", v))))):
            bad.append(getattr(v, "path", None) or v.name)
    return bad


# -- TensorBoard ----------------------------------------------------------------------


class TensorBoardLog:
    """The run's TensorBoard scalars, a function of its history.

    Runs under MODEL_DIR/tensorboard: `steps` ("step/loss", ... for every
    step), `train` and `validation` ("epoch_loss", ... at each epoch's last
    step). `rebuild` rewrites all three from a history, so a resumed run holds
    each step once, whatever an interrupted run had written.
    """

    RUNS = ("steps", "train", "validation")

    def __init__(self, directory):
        self.dir = pathlib.Path(directory)
        self._writers = {}

    def rebuild(self, history):
        self.close()
        for run in self.RUNS:
            shutil.rmtree(self.dir / run, ignore_errors=True)
        means = history.per_epoch()
        for entry in history.steps:
            self.step(entry)
        for entry in history.epochs:
            train = {k: v[entry["epoch"] - 1] for k, v in means.items()
                     if not k.startswith("val_") and len(v) >= entry["epoch"]}
            self.epoch(entry, train)
        self.flush()

    def _writer(self, run):
        if run not in self._writers:
            self._writers[run] = tf.summary.create_file_writer(str(self.dir / run))
        return self._writers[run]

    def step(self, entry):
        with self._writer("steps").as_default(step=entry["step"]):
            for key, value in entry.items():
                if key not in ("step", "rows"):
                    tf.summary.scalar(f"step/{key}", value)

    def epoch(self, entry, train_means):
        with self._writer("train").as_default(step=entry["step"]):
            for key, value in train_means.items():
                tf.summary.scalar(f"epoch_{key}", value)
        with self._writer("validation").as_default(step=entry["step"]):
            for key, value in entry.items():
                if key.startswith("val_"):
                    tf.summary.scalar(f"epoch_{key[4:]}", value)

    def flush(self):
        for writer in self._writers.values():
            writer.flush()

    def close(self):
        for writer in self._writers.values():
            writer.close()
        self._writers = {}


# -- callbacks ----------------------------------------------------------------------


class StepRecorder(keras.callbacks.Callback):
    """Records each step's own loss and metrics; stops at a non-finite loss.

    After every batch it resets the model's metrics, so the values Keras
    reports for the next batch are that batch's own. It appends them to the
    history, then writes into Keras' logs the running means over the epoch so
    far, from the history (steps restored from a checkpoint included): the
    progress bar, `History` and later callbacks see the same epoch means as in
    a run that was never interrupted.

    Args:
      history: the `RunHistory` to append to.
      rows_of_step: fn(global step, 0-based) -> rows in that step's batch.
      start_step: the global step of the first batch this fit runs.
      board: optional `TensorBoardLog`.

    Raises (from fit):
      Diverged: a step's loss is NaN or infinite; that step is not recorded.
    """

    def __init__(self, history, rows_of_step, start_step, board=None):
        super().__init__()
        self.history = history
        self.rows_of_step = rows_of_step
        self.step = int(start_step)
        self.board = board
        self._sums, self._rows = {}, 0.0

    def on_epoch_begin(self, epoch, logs=None):
        # The epoch's steps already done (restored from a checkpoint), summed in
        # step order: the same sums an uninterrupted run has at this point.
        self._sums, self._rows = {}, 0.0
        for entry in self.history.steps_of_epoch(epoch):
            if entry["step"] <= self.step:
                self._add(entry)

    def _add(self, entry):
        for key, value in entry.items():
            if key not in ("step", "rows"):
                self._sums[key] = self._sums.get(key, 0.0) + value * entry["rows"]
        self._rows += entry["rows"]

    def on_train_batch_end(self, batch, logs=None):
        logs = logs if logs is not None else {}
        values = {k: float(v) for k, v in logs.items() if not k.startswith("val_")}
        loss = values.get("loss")
        if loss is not None and not math.isfinite(loss):
            raise Diverged(f"the training loss is {loss} at step {self.step + 1}",
                           self.step + 1)
        rows = int(self.rows_of_step(self.step))
        self.step += 1
        entry = {"step": self.step, "rows": rows, **values}
        self.history.steps.append(entry)
        self.model.reset_metrics()  # the next batch's logs: that batch alone
        self._add(entry)
        logs.update({k: v / self._rows for k, v in self._sums.items()})
        if self.board is not None:
            self.board.step(entry)

    def on_epoch_end(self, epoch, logs=None):
        entry = {"epoch": epoch + 1, "step": self.step}
        entry.update({k: float(v) for k, v in (logs or {}).items() if k.startswith("val_")})
        self.history.epochs.append(entry)
        train = {k: v / self._rows for k, v in self._sums.items()} if self._rows else {}
        if logs is not None:
            logs.update(train)  # Keras' epoch logs held the metrics reset after the last step
        if self.board is not None:
            self.board.epoch(entry, train)
            self.board.flush()


class Checkpointer(keras.callbacks.Callback):
    """Counts steps and saves a checkpoint (with the history) every `every` steps.

    A step that ends an epoch is saved at the epoch's end, after validation,
    so the history saved with it holds that epoch's validation metrics.
    List it after the `StepRecorder` it shares the history with.

    Args:
      store: the `CheckpointStore`, whose checkpoint holds `step`.
      step: int64 `tf.Variable`, steps done; incremented after every batch.
      every: save every this many steps (0: never during training).
      steps_per_epoch: steps in one (full) epoch.
      history: the `RunHistory` to save with each checkpoint.
      variables: the variables whose floating-point ones must be finite to be saved.

    Raises (from fit, or `save`):
      Diverged: a weight is NaN or infinite; nothing is saved.
    """

    def __init__(self, store, step, every, steps_per_epoch, history, variables):
        super().__init__()
        self.store, self.step_var = store, step
        self.every, self.steps_per_epoch = int(every), int(steps_per_epoch)
        self.history = history
        self.variables = list(variables)

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.step_var.assign_add(1))
        if self.every and step % self.every == 0 and step % self.steps_per_epoch:
            self.save()

    def on_epoch_end(self, epoch, logs=None):
        step = int(self.step_var)
        if self.every and step % self.every == 0:
            self.save()

    def save(self):
        """Saves a checkpoint numbered by the step (once per step) and history.json."""
        step = int(self.step_var)
        if self.store.latest_step == step:
            return
        bad = non_finite_variables(self.variables)
        if bad:
            raise Diverged(
                f"after step {step} {len(bad)} variable(s) hold NaN or infinite values "
                f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}), although the "
                f"loss was finite", step)
        self.store.save(step, self.history)
        self.history.save()
