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

The history saved in each manifest is `launch.history`'s; `Checkpointer`
saves every N steps and refuses non-finite weights, so no checkpoint ever
holds a NaN and the newest is always the last finite state.
"""

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import secrets
import time

import keras
import tensorflow as tf

from launch import config as config_lib
from launch import outputs
from launch.config import Diverged, RunError
from launch.files import atomic_write, canonical, fsync_dir, sha256

from launch.outputs import CHECKPOINT_DIR, MANIFEST, SKIPPED_DIR, STATE_FILE  # noqa: F401

FORMAT = 1
KEEP = config_lib.KEEP_CHECKPOINTS

_CKPT_FILE = outputs.CHECKPOINT_FILE


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
            ok = hashlib.sha256(canonical(body).encode()).hexdigest() == manifest["sha256"]
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise Damaged(f"{name}{MANIFEST} is unreadable ({type(err).__name__}: {err})") \
                from None
        if not ok:
            raise Damaged(f"{name}{MANIFEST} does not match its own checksum (damaged)")
        if manifest.get("format") != FORMAT or manifest.get("step") != step:
            raise Damaged(f"{name}{MANIFEST} describes format {manifest.get('format')!r}, "
                          f"step {manifest.get('step')!r}")
        try:
            recorded = manifest["history"]["steps"]
            last = recorded[-1]["step"] if recorded else 0
        except (KeyError, TypeError, IndexError) as err:
            raise Damaged(f"{name}{MANIFEST} holds no readable history ({type(err).__name__})") \
                from None
        if last != step:  # a manifest re-signed by hand, or written by a bug
            raise Damaged(f"{name}{MANIFEST}'s history ends at step {last}, not at step {step}")
        for file_name, expected in sorted(manifest["files"].items()):
            path = self.dir / file_name
            if not path.exists():
                raise Damaged(f"{file_name} is missing")
            size = path.stat().st_size
            if size != expected["size"]:
                raise Damaged(f"{file_name} has {size} bytes, {expected['size']} expected "
                              f"({'truncated' if size < expected['size'] else 'damaged'})")
            if sha256(path) != expected["sha256"]:
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
        fsync_dir(self.dir)

    # -- restore ------------------------------------------------------------------

    def restore(self, step, manifest, strict=False):
        """Restores checkpoint `step` into the existing variables; returns the
        history saved with it (a dict, `launch.history.RunHistory.to_json`).
        `strict`: every saved value must find its variable and every variable
        its value (a resharded resume: nothing may be left over)."""
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
        return manifest["history"]

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
            files[final.name] = {"size": final.stat().st_size, "sha256": sha256(final)}
        fsync_dir(self.dir)
        body = {"format": FORMAT, "step": int(step), "files": files,
                "history": history.to_json()}
        manifest = dict(body, sha256=hashlib.sha256(canonical(body).encode()).hexdigest())
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


class Checkpointer(keras.callbacks.Callback):
    """Counts steps and saves a checkpoint (with the history): every `every`
    steps, when `every_secs` have passed since the last save, and at the end
    of every epoch that saved none (so a run saves at least once per epoch).

    A step that ends an epoch is saved at the epoch's end, after validation,
    so the history saved with it holds that epoch's validation metrics.
    List it after the `StepRecorder` it shares the history with.

    Args:
      store: the `CheckpointStore`, whose checkpoint holds `step`.
      step: int64 `tf.Variable`, steps done; incremented after every batch.
      every: save every this many steps (0: not by count).
      steps_per_epoch: steps in one (full) epoch.
      history: the `RunHistory` to save with each checkpoint.
      variables: the variables whose floating-point ones must be finite to be saved.
      every_secs: also save when this many seconds passed since the last save
        (0: not by time).

    Raises (from fit, or `save`):
      Diverged: a weight is NaN or infinite; nothing is saved.
    """

    def __init__(self, store, step, every, steps_per_epoch, history, variables,
                 every_secs=0.0):
        super().__init__()
        self.store, self.step_var = store, step
        self.every, self.steps_per_epoch = int(every), int(steps_per_epoch)
        self.every_secs = float(every_secs)
        self.history = history
        self.variables = list(variables)
        self._last_save = time.monotonic()

    def _due(self, step):
        return ((self.every and step % self.every == 0) or (
            self.every_secs and time.monotonic() - self._last_save >= self.every_secs))

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.step_var.assign_add(1))
        if step % self.steps_per_epoch and self._due(step):
            self.save()

    def on_epoch_end(self, epoch, logs=None):
        step = int(self.step_var)
        epoch_start = step - (step - 1) % self.steps_per_epoch - 1
        saved_this_epoch = (self.store.latest_step or 0) > epoch_start
        if self._due(step) or not saved_this_epoch:
            self.save()

    def save(self):
        """Saves a checkpoint numbered by the step (once per step) and history.json."""
        step = int(self.step_var)
        if self.store.latest_step == step:
            return self.store.path(step)
        bad = non_finite_variables(self.variables)
        if bad:
            raise Diverged(
                f"after step {step} {len(bad)} variable(s) hold NaN or infinite values "
                f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}), although the "
                f"loss was finite", step)
        path = self.store.save(step, self.history)
        self.history.save()
        self._last_save = time.monotonic()
        return path


class StopRequested(Exception):
    """Raised out of `fit` at a step boundary after a signal (`StopOnRequest`)."""


class StopOnRequest(keras.callbacks.Callback):
    """Ends `fit` at the first step boundary after a signal (`launch.signals`).

    After a step inside an epoch it raises `StopRequested` at once (no
    validation and no epoch end are recorded for a part of an epoch, so a
    resume repeats nothing); after an epoch's last step it waits for the
    epoch's end, after validation and the `Checkpointer`'s save. List it
    after the `Checkpointer`.

    Args:
      request: the `launch.signals.StopRequest` (its `signum` set by a signal).
      step: the int64 step `tf.Variable` the `Checkpointer` counts.
      steps_per_epoch: steps in one (full) epoch.
    """

    def __init__(self, request, step, steps_per_epoch):
        super().__init__()
        self.request, self.step_var = request, step
        self.steps_per_epoch = int(steps_per_epoch)

    def on_train_begin(self, logs=None):
        if self.request.signum is not None:
            raise StopRequested()

    def on_train_batch_end(self, batch, logs=None):
        if self.request.signum is not None and int(self.step_var) % self.steps_per_epoch:
            raise StopRequested()

    def on_epoch_end(self, epoch, logs=None):
        if self.request.signum is not None:
            raise StopRequested()
