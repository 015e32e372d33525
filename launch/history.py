"""A run's history: each step's own metrics, the epochs' validation metrics,
and what is made from it (loss plot, TensorBoard scalars, Keras' epoch logs).

The history (`RunHistory`: every step's own loss and metrics, every epoch's
validation metrics, the learning rates, the run's settings) is restored from
the checkpoint itself (its manifest and history segments, `launch.segments`),
so the two cannot disagree, and the settings check of a resume never
depends on another file. MODEL_DIR/history.json is a copy for people and
plots, written when the run ends, stops on a signal or diverges; it is never
read back. Nothing here costs more per save as the run grows: a save writes
the steps since the last one, TensorBoard files are trimmed, not rewritten,
at a resume (`benchmarks/run_costs.py`).

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

import bisect
import io
import json
import math
import os
import pathlib
import re
import struct

import keras
import numpy as np
import tensorflow as tf

from launch import segments
from launch.errors import Diverged
from launch.files import atomic_write

from launch.outputs import HISTORY_FILE, LOSS_PLOT, TENSORBOARD_DIR  # noqa: F401


class RunHistory:
    """Per-step training metrics and per-epoch validation metrics of one run.

    Attributes:
      run: dict of the settings that fix the data order and the variables
        (model, dataset, stages, batch size, ...); a resume must match them.
      steps: list of {"step": s (steps done, 1-based), "rows": batch rows,
        "loss": ..., <metric>: ...}, in order: each step's own values.
      epochs: list of {"epoch": e (1-based), "step": s, "val_loss": ..., ...}.
      changes: list of {"step": s, "learning_rate": lr} and {"step": s,
        "reshard": {setting: [before, after]}}: what a resume changed, from
        step s on (the first entry, the learning rate at step 0).
    """

    def __init__(self, path, run, steps=None, epochs=None, changes=None):
        self.path = pathlib.Path(path)
        self.run = dict(run)
        self.steps = list(steps or [])
        self.epochs = list(epochs or [])
        self.changes = list(changes or [])
        # The newest checkpoint's history segment, and how much of each list
        # it holds: the next save writes only the rest (`launch.segments`).
        self.saved_ref = None
        self._saved = {key: 0 for key in segments.KEYS}

    def to_json(self):
        return {"run": self.run, "steps": self.steps, "epochs": self.epochs,
                "changes": self.changes}

    @classmethod
    def from_json(cls, path, saved, saved_ref=None):
        """From `to_json`'s dict; `saved_ref`: the segment it was read from."""
        history = cls(path, saved["run"], saved["steps"], saved["epochs"],
                      saved.get("changes"))
        if saved_ref is not None:
            history.mark_saved(saved_ref)
        return history

    def tail(self):
        """What the history gained since the last `mark_saved` (a segment's lists)."""
        return {key: getattr(self, key)[self._saved[key]:] for key in segments.KEYS}

    def mark_saved(self, ref):
        """Records that a checkpoint's segment `ref` now holds all of the history."""
        self.saved_ref = ref
        self._saved = {key: len(getattr(self, key)) for key in segments.KEYS}

    def learning_rate(self, step=None):
        """The learning rate in force at global step `step` (1-based; None:
        the newest), or None if never recorded."""
        rates = [c for c in self.changes if "learning_rate" in c
                 and (step is None or c["step"] < step)]
        return rates[-1]["learning_rate"] if rates else None

    def loss_at(self, step):
        """The training loss recorded at global step `step`, or None."""
        i = bisect.bisect_left(self.steps, step, key=lambda s: s["step"])
        if i < len(self.steps) and self.steps[i]["step"] == step:
            return self.steps[i].get("loss")
        return None

    def save(self, record):
        """Writes the history.json copy atomically (never read back by a
        resume), recorded in `record` (`launch.outputs.Record`)."""
        atomic_write(self.path, json.dumps(self.to_json()), record)

    def mismatches(self, run):
        """{key: (recorded, now)} for the run settings that differ."""
        keys = set(self.run) | set(run)
        return {k: (self.run.get(k), run.get(k)) for k in sorted(keys)
                if self.run.get(k) != run.get(k)}

    def steps_of_epoch(self, epoch):
        """The step entries of epoch `epoch` (0-based), in order."""
        spe = self.run["steps_per_epoch"]
        # Steps are in order: a binary search, not a scan of the whole run.
        first = bisect.bisect_right(self.steps, epoch * spe, key=lambda s: s["step"])
        last = bisect.bisect_right(self.steps, (epoch + 1) * spe, key=lambda s: s["step"])
        return self.steps[first:last]

    def per_epoch(self):
        """Keras-History-style dict of per-epoch lists: loss, metrics, val_*.

        Training values are the row-weighted means of the epoch's steps: what
        Keras shows at the end of an uninterrupted epoch.
        """
        steps_per_epoch = self.run["steps_per_epoch"]
        out = {}
        by_epoch = {}  # one pass: O(steps), not O(steps x epochs)
        for s in self.steps:
            by_epoch.setdefault((s["step"] - 1) // steps_per_epoch + 1, []).append(s)
        val = {e["epoch"]: e for e in self.epochs}
        for epoch in sorted(by_epoch):
            rows = by_epoch[epoch]
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

    def plot_loss(self, path, record):
        """Writes a PNG, atomically and recorded in `record`: each step's
        training loss, epoch means and validation loss."""
        # The object-oriented API with the Agg canvas: no pyplot state and no
        # global backend switch in the calling process.
        # pylint: disable=import-outside-toplevel
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        if self.steps:
            # At most ~4 points per pixel column: a long run's plot costs what a short one's does.
            stride = max(1, len(self.steps) // 4000)
            shown = self.steps[::stride]
            ax.plot([s["step"] for s in shown], [s["loss"] for s in shown],
                    color="tab:blue", alpha=0.35, linewidth=1,
                    label="train loss (step)" + (f", every {stride}th" if stride > 1 else ""))
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
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        atomic_write(path, buffer.getvalue(), record)


class TensorBoardLog:
    """The run's TensorBoard scalars, written as the steps are recorded.

    Runs under MODEL_DIR/tensorboard: `steps` ("step/loss", ... for every
    step), `train` and `validation` ("epoch_loss", ... at each epoch's last
    step). Event files are named with their first step
    (`...from-0000000007.v2`) and a save moves on to new files once the
    current ones hold `steps_per_file` steps (`rotate`). A resume from step S
    (`resume`) deletes the files that start after S and drops the records
    after S from the one file that may hold some: TensorBoard shows each step
    once, and a resume rewrites at most `steps_per_file` + one save interval
    of steps, never the whole run's logs.
    """

    RUNS = ("steps", "train", "validation")
    _FROM = re.compile(r"\.from-([0-9]+)\.v2$")

    def __init__(self, directory, record, steps_per_file=10_000):
        self.dir = pathlib.Path(directory)
        self.record = record  # `launch.outputs.Record`: only its files are trimmed
        self.steps_per_file = int(steps_per_file)
        self._writers = {}
        self.first_step = 1  # the step the current files start at

    def resume(self, step):
        """Continues after checkpoint `step`: the logs of later steps go."""
        self.close()
        for run in self.RUNS:
            files = {}
            folder = self.dir / run
            for entry in (folder.iterdir() if folder.is_dir() else ()):
                match = self._FROM.search(entry.name)
                if match and self.record.owns(entry):
                    files[entry] = int(match.group(1))
            for entry, first in files.items():
                if first > step:
                    entry.unlink()
            kept = [entry for entry, first in files.items() if first <= step]
            if kept:
                _drop_records_after(max(kept, key=files.get), step)
        self.first_step = step + 1

    def rotate(self, step):
        """After the save at `step`: flushes, and once the files hold
        `steps_per_file` steps, later records go to new ones."""
        if step - self.first_step + 1 >= self.steps_per_file:
            self.close()
            self.first_step = step + 1
        else:
            self.flush()

    def _writer(self, run):
        if run not in self._writers:
            folder = self.dir / run
            self.record.make_dir(folder)
            before = {entry.name for entry in folder.iterdir()}
            self._writers[run] = tf.summary.create_file_writer(
                str(folder), filename_suffix=f".from-{self.first_step:010d}.v2")
            self.record.add_new_files(folder, before)  # TensorFlow named it
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


def _drop_records_after(path, step):
    """Cuts the event file `path` before its first record of a step after
    `step` (records are written in step order, so the rest goes too), or
    before a record torn by a kill. TFRecord framing: an 8-byte length, a
    4-byte CRC, the data, a 4-byte CRC."""
    data = path.read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        end = pos + 12 + length + 4
        if end > len(data):
            break  # torn
        if tf.compat.v1.Event.FromString(data[pos + 12:pos + 12 + length]).step > step:
            break
        pos = end
    if pos < len(data):
        os.truncate(path, pos)


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
