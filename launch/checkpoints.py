"""Checkpoints every N steps, the run's history, and resuming both.

A checkpoint (`tf.train.CheckpointManager` under MODEL_DIR/checkpoints) holds
the model's variables, the optimizer's (its slots and iteration count) and a
step counter. `RunHistory` (MODEL_DIR/history.json) holds every step's own
training loss and metrics and every epoch's validation metrics; it is written
together with each checkpoint, so a resumed run continues the same loss curve.

Keras reports, at the end of each batch, the *running mean* of the loss and
metrics since the epoch began. `StepRecorder` turns those back into each
step's own values (weighting by the rows of each batch, which is how Keras'
mean metrics weight them), so the curve does not depend on where an epoch, or
a resumed run, started.
"""

import json
import os
import pathlib

import keras
import numpy as np
import tensorflow as tf

HISTORY_FILE = "history.json"
CHECKPOINT_DIR = "checkpoints"
LOSS_PLOT = "loss.png"


class RunHistory:
    """Per-step training metrics and per-epoch validation metrics of one run.

    Attributes:
      run: dict of the settings that fix the data order and the variables
        (model, dataset, stages, batch size, ...); a resume must match them.
      steps: list of {"step": s (steps done, 1-based), "rows": batch rows,
        "loss": ..., <metric>: ...}, in order.
      epochs: list of {"epoch": e (1-based), "step": s, "val_loss": ..., ...}.
    """

    def __init__(self, path, run, steps=None, epochs=None):
        self.path = pathlib.Path(path)
        self.run = dict(run)
        self.steps = list(steps or [])
        self.epochs = list(epochs or [])

    @classmethod
    def load(cls, path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        return cls(path, saved["run"], saved["steps"], saved["epochs"])

    def save(self):
        """Writes the JSON file atomically (a crash never leaves half a file)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"run": self.run, "steps": self.steps, "epochs": self.epochs}, f)
        os.replace(tmp, self.path)

    def truncate(self, step):
        """Drops what was recorded after `step` (a checkpoint older than the file)."""
        self.steps = [s for s in self.steps if s["step"] <= step]
        self.epochs = [e for e in self.epochs if e["step"] <= step]

    def mismatches(self, run):
        """{key: (recorded, now)} for the run settings that differ."""
        keys = set(self.run) | set(run)
        return {k: (self.run.get(k), run.get(k)) for k in sorted(keys)
                if self.run.get(k) != run.get(k)}

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
            lo, hi = (epoch - 1) * steps_per_epoch, epoch * steps_per_epoch
            rows = [s for s in self.steps if lo < s["step"] <= hi]
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


class StepRecorder(keras.callbacks.Callback):
    """Appends each step's own loss and metrics to a `RunHistory`.

    Args:
      history: the `RunHistory` to append to.
      rows_of_step: fn(global step, 0-based) -> rows in that step's batch.
      start_step: the global step of the first batch this fit runs.
      writer: optional `tf.summary` writer for per-step scalars ("step/loss", ...).
    """

    def __init__(self, history, rows_of_step, start_step, writer=None):
        super().__init__()
        self.history = history
        self.rows_of_step = rows_of_step
        self.step = int(start_step)
        self.writer = writer
        self._totals, self._weight = {}, 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._totals, self._weight = {}, 0.0  # Keras resets its metrics here too

    def on_train_batch_end(self, batch, logs=None):
        rows = float(self.rows_of_step(self.step))
        weight = self._weight + rows
        entry = {"step": self.step + 1, "rows": int(rows)}
        for key, value in (logs or {}).items():
            if key.startswith("val_"):
                continue
            total = float(value) * weight
            entry[key] = (total - self._totals.get(key, 0.0)) / rows
            self._totals[key] = total
        self._weight = weight
        self.step += 1
        self.history.steps.append(entry)
        if self.writer is not None:
            with self.writer.as_default(step=self.step):
                for key, value in entry.items():
                    if key not in ("step", "rows"):
                        tf.summary.scalar(f"step/{key}", value)

    def on_epoch_end(self, epoch, logs=None):
        entry = {"epoch": epoch + 1, "step": self.step}
        entry.update({k: float(v) for k, v in (logs or {}).items() if k.startswith("val_")})
        self.history.epochs.append(entry)
        if self.writer is not None:
            self.writer.flush()


class Checkpointer(keras.callbacks.Callback):
    """Counts steps and saves a checkpoint (and the history) every `every` steps.

    A step that ends an epoch is saved at the epoch's end, after validation,
    so the history written with it holds that epoch's validation metrics.
    List it after the `StepRecorder` it shares the history with.

    Args:
      manager: a `tf.train.CheckpointManager` whose checkpoint holds `step`.
      step: int64 `tf.Variable`, steps done; incremented after every batch.
      every: save every this many steps (0: never during training).
      steps_per_epoch: steps in one (full) epoch.
      history: the `RunHistory` to save with each checkpoint.
    """

    def __init__(self, manager, step, every, steps_per_epoch, history):
        super().__init__()
        self.manager, self.step_var = manager, step
        self.every, self.steps_per_epoch = int(every), int(steps_per_epoch)
        self.history = history

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.step_var.assign_add(1))
        if self.every and step % self.every == 0 and step % self.steps_per_epoch:
            self.save()

    def on_epoch_end(self, epoch, logs=None):
        step = int(self.step_var)
        if self.every and step % self.every == 0:
            self.save()

    def save(self):
        """Saves a checkpoint numbered by the step (once per step) and the history."""
        step = int(self.step_var)
        if self.manager.latest_checkpoint != self._path(step):
            self.manager.save(checkpoint_number=step)
        self.history.save()

    def _path(self, step):
        return os.path.join(self.manager.directory, f"ckpt-{step}")
