"""A run's history: each step's own metrics, the epochs' validation metrics,
and what is made from it (loss plot, TensorBoard scalars, Keras' epoch logs).

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

import bisect
import json
import math
import pathlib
import shutil

import keras
import numpy as np
import tensorflow as tf

from launch.config import Diverged
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
      changes: list of {"step": s, "learning_rate": lr}: the settings a resume
        may change, from step s on (the first entry at step 0).
    """

    def __init__(self, path, run, steps=None, epochs=None, changes=None):
        self.path = pathlib.Path(path)
        self.run = dict(run)
        self.steps = list(steps or [])
        self.epochs = list(epochs or [])
        self.changes = list(changes or [])

    def to_json(self):
        return {"run": self.run, "steps": self.steps, "epochs": self.epochs,
                "changes": self.changes}

    @classmethod
    def from_json(cls, path, saved):
        return cls(path, saved["run"], saved["steps"], saved["epochs"],
                   saved.get("changes"))

    def learning_rate(self):
        """The learning rate of the newest step (None if never recorded)."""
        return self.changes[-1]["learning_rate"] if self.changes else None

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
