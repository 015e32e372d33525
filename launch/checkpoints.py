"""Checkpoints that are verified on restore, the run's history inside them, and resuming.

Layout under MODEL_DIR/checkpoints, for a checkpoint after N steps:

    ckpt-N.index, ckpt-N.data-00000-of-00001   tf.train.Checkpoint.write: the model's
                                               variables, the optimizer's, the step
    ckpt-N.manifest.json                       the commit record (below)
    checkpoint                                 TF's state file, for TF's own tools only

A save writes what the history gained since the last save as a segment
(`launch.segments`: checkpoints/history/steps-N.json, chained to the one
before), then the TensorFlow files under a unique temporary prefix
(`.ckpt-N.tmp-PID-RANDOM`), fsyncs and renames them to `ckpt-N.*`, then writes
the manifest: the step, the size and SHA-256 of each file, the run settings,
the name and SHA-256 of the newest history segment, and a SHA-256 of all that.
The manifest is written last and atomically (`atomic_write`), so it is the
commit: a checkpoint without one was interrupted mid-write. Only after the commit are older checkpoints deleted
(the newest `keep` stay; each loses its manifest first).

A restore lists the checkpoints from the files, never from the state file
(which may be garbled or stale), and takes the newest whose manifest and
files all match: a truncated or flipped-byte data file, an empty index, a
missing file, a damaged manifest or history segment is skipped with its reason, and the files
of skipped checkpoints are moved to checkpoints/skipped/. If checkpoint files
exist but none is intact, `--resume` refuses and changes nothing.

The history saved in each manifest is `launch.history`'s; `Checkpointer`
saves every N steps and refuses non-finite weights, so no checkpoint ever
holds a NaN and the newest is always the last finite state.
"""

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import re
import secrets
import signal
import time

import keras
import tensorflow as tf

from launch import config as config_lib
from launch import outputs
from launch.errors import Diverged, RunError
from launch.files import atomic_write, canonical, fsync_dir, sha256

from launch import segments
from launch.outputs import (CHECKPOINT_DIR, HISTORY_SEGMENTS, MANIFEST,  # noqa: F401
                            SKIPPED_DIR, STATE_FILE)

FORMAT = 2  # 2: the history in segments (`launch.segments`)
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
      record: the run's `launch.outputs.Record`: every file a save makes is
        recorded; only recorded files are deleted or moved (None: reading only).
    """

    def __init__(self, directory, checkpoint, keep=KEEP, record=None):
        self.dir = pathlib.Path(directory)
        self.checkpoint = checkpoint
        self.record = record
        # tf.train.CheckpointOptions or None. With stages on other hosts, the
        # trainer sets experimental_io_device to this process's CPU, so that
        # every file is written here (not each shard on its worker's disk).
        self.options = None
        self.keep = int(keep)
        self.latest_step = None  # the newest committed step this process knows
        # Committed steps rotation spares besides the newest `keep` (the
        # restart point a divergence would name: `Checkpointer`).
        self.protected = set()

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
        try:
            history = segments.read(self.dir / HISTORY_SEGMENTS, manifest["history"])
            run = manifest["run"]
            last = history["steps"][-1]["step"] if history["steps"] else 0
        except segments.BrokenChain as err:
            raise Damaged(str(err)) from None
        except (KeyError, TypeError, IndexError, ValueError) as err:
            raise Damaged(f"{name}{MANIFEST} holds no readable history ({type(err).__name__})") \
                from None
        if last != step:  # a manifest re-signed by hand, or written by a bug
            raise Damaged(f"{name}{MANIFEST}'s history ends at step {last}, not at step {step}")
        # The whole history (`RunHistory.to_json`), and the segment it ends in.
        return dict(manifest, history={"run": run, **history}, history_ref=manifest["history"])

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
            aside = any(_CKPT_FILE.fullmatch(p.name) and p.name.startswith(f"ckpt-{listed}.")
                        for p in outputs.entries(self.dir / SKIPPED_DIR))
            skipped.append((f"ckpt-{listed}", f"{self.dir / STATE_FILE} lists it, but "
                            + (f"an earlier resume set it aside in {SKIPPED_DIR}/" if aside
                               else "its files are gone")))
        for step in sorted(on_disk, reverse=True):
            try:
                manifest = self.verify(step)
            except Damaged as err:
                skipped.append((f"ckpt-{step}", str(err)))
                continue
            return Found(step, manifest, skipped, notes, True)
        return Found(None, None, skipped, notes, bool(on_disk))

    def set_aside(self, names):
        """Moves the files of the checkpoints `names` (e.g. "ckpt-9") to
        skipped/, which keeps those of the newest `keep` checkpoints set aside."""
        on_disk = self.files_by_step()
        target = self.dir / SKIPPED_DIR
        for name in names:
            step = int(name.split("-")[1])
            for file_name in on_disk.get(step, []):
                if not self.record.owns(self.dir / file_name):
                    continue  # a file the trainer did not write stays where it is
                self.record.make_dir(target)
                self.record.add(target / file_name)
                os.replace(self.dir / file_name, target / file_name)
        aside = {}
        for entry in outputs.entries(target):
            match = _CKPT_FILE.fullmatch(entry.name)
            if match and self.record.owns(entry):
                aside.setdefault(int(match.group(1)), []).append(entry)
        for step in sorted(aside)[:-self.keep]:
            for entry in aside[step]:
                entry.unlink()
        state = self.dir / STATE_FILE
        if self.committed_steps():
            self._write_state()  # TF's copy no longer names what was set aside
        elif self.record.owns(state):
            state.unlink(missing_ok=True)
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
        """Writes checkpoint `step` with what `history` gained since the last
        save (a segment, `launch.segments`), commits it, then rotates."""
        self.record.make_dir(self.dir)
        name = f"ckpt-{step}"
        self._delete(step)  # leftovers of an interrupted write of this step
        ref = segments.write(self.dir / HISTORY_SEGMENTS, step, history.tail(),
                             history.saved_ref, self.record)
        tmp = self.dir / f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        self.record.add(tmp, "prefix")  # TensorFlow names the files under it
        try:
            self.checkpoint.write(str(tmp), options=self.options)
        except tf.errors.OpError as err:  # a full disk, a file size limit, an I/O error
            reason = str(err.message).rsplit(";", 1)[-1].split("\n")[0]
            reason = re.sub(r"\s*\[Op:\w+\]$", "", reason.strip())[:200]
            raise RunError(
                f"could not write checkpoint {name} in {self.dir}: {reason} "
                f"({type(err).__name__}). Nothing after the newest committed checkpoint "
                f"({self.latest_path or 'none yet'}) was saved; make room on the file "
                f"system, then --resume.") from None
        files = {}
        for written in sorted(self.dir.glob(tmp.name + ".*")):
            final = self.dir / (name + written.name[len(tmp.name):])
            if os.path.lexists(final) and not self.record.owns(final):
                raise RunError(
                    f"{final} exists and launch.train did not write it: a checkpoint "
                    f"cannot be saved under that name. Move it, then --resume.")
            with open(written, "rb") as f:
                os.fsync(f.fileno())
            self.record.add(final)
            os.replace(written, final)
            files[final.name] = {"size": final.stat().st_size, "sha256": sha256(final)}
        fsync_dir(self.dir)
        body = {"format": FORMAT, "step": int(step), "files": files, "run": history.run,
                "history": ref}
        manifest = dict(body, sha256=hashlib.sha256(canonical(body).encode()).hexdigest())
        atomic_write(self.dir / (name + MANIFEST), json.dumps(manifest), self.record)  # commit
        history.mark_saved(ref)
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
        names = [n for n in self.files_by_step().get(step, [])
                 if self.record.owns(self.dir / n)]
        for file_name in sorted(names, key=lambda n: not n.endswith(MANIFEST)):
            (self.dir / file_name).unlink(missing_ok=True)

    def _rotate(self):
        kept = self.committed_steps()[-self.keep:]
        for step in self.files_by_step():
            if step < kept[0] and step not in self.protected:
                self._delete(step)

    def _write_state(self):
        """TF's state file (for tf.train.latest_checkpoint and TensorBoard); a copy,
        never trusted by `find`."""
        steps = self.committed_steps()
        lines = [f'model_checkpoint_path: "ckpt-{steps[-1]}"']
        lines += [f'all_model_checkpoint_paths: "ckpt-{s}"' for s in steps]
        atomic_write(self.dir / STATE_FILE, "\n".join(lines) + "\n", self.record)


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
      after_save: callables of the step, run after each committed save (the
        TensorBoard log starts its next file there).
      before_save: callables run before each save (the run lock's check).

    Raises (from fit, or `save`):
      Diverged: a weight is NaN or infinite; nothing is saved.
    """

    def __init__(self, store, step, every, steps_per_epoch, history, variables,
                 every_secs=0.0, after_save=(), before_save=()):
        super().__init__()
        self.after_save = list(after_save)  # fn(step) after each committed save
        self.before_save = list(before_save)  # fn() before each save; raises to refuse it
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

    def restart_point(self):
        """(step, its next step's loss) of the newest committed checkpoint from
        before the loss climbed: among those whose next step was recorded with a
        finite loss, the newest whose loss there is at most twice the lowest
        (noise is not a climb). A divergence names it; rotation spares it.
        None if there is none."""
        candidates = [(step, self.history.loss_at(step + 1))
                      for step in self.store.committed_steps()]
        candidates = [(s, l) for s, l in candidates if l is not None and math.isfinite(l)]
        if not candidates:
            return None
        lowest = min(l for _, l in candidates)
        return [(s, l) for s, l in candidates if l <= lowest + abs(lowest)][-1]

    def save(self):
        """Saves a checkpoint numbered by the step (once per step); returns its path."""
        step = int(self.step_var)
        if self.store.latest_step == step:
            return self.store.path(step)
        best = self.restart_point()
        self.store.protected = {best[0]} if best else set()
        bad = non_finite_variables(self.variables)
        if bad:
            raise Diverged(
                f"after step {step} {len(bad)} variable(s) hold NaN or infinite values "
                f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}), although the "
                f"loss was finite", step)
        for check in self.before_save:
            check()
        path = self.store.save(step, self.history)
        for hook in self.after_save:
            hook(step)
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
      agree: None, or fn(signum or None) -> the signal any worker of a
        multi-worker run received (or None), called by every worker at the
        same points: they all stop after the same step (`agreed_signal`).
    """

    def __init__(self, request, step, steps_per_epoch, agree=None):
        super().__init__()
        self.request, self.step_var = request, step
        self.steps_per_epoch = int(steps_per_epoch)
        self.agree = agree

    def _requested(self):
        signum = self.request.signum
        if self.agree is not None:
            signum = self.agree(signum)
            if signum is not None and self.request.signum is None:
                # Another worker's signal: stop as it does, and say so.
                self.request.signum, self.request.by_another_worker = signum, True
        return signum is not None

    def on_train_begin(self, logs=None):
        if self._requested():
            raise StopRequested()

    def on_train_batch_end(self, batch, logs=None):
        if int(self.step_var) % self.steps_per_epoch and self._requested():
            raise StopRequested()

    def on_epoch_end(self, epoch, logs=None):
        if self._requested():
            raise StopRequested()


def agreed_signal(strategy):
    """For a multi-worker `strategy`: fn(signum or None) -> whether any worker
    received a signal, as a signal number (its own, else SIGTERM's), or None.
    One small collective all-reduce, which every worker runs at the same
    point of the same program, so all of them stop after the same step."""
    @tf.function
    def count(flag):  # traced once: eager strategy.run would warn at every step
        flags = strategy.run(lambda: tf.identity(flag))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, flags, axis=None)

    def agree(signum):
        if int(count(tf.constant(1 if signum else 0, tf.int32))) == 0:
            return None
        return signum or int(signal.SIGTERM)
    return agree
