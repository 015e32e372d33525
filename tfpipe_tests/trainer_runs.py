"""The trainer runs the fault tests share: the settings, the uninterrupted
reference run and the run cut after step 8 (each made once per pytest run), and
what a test reads back from a --model_dir.

The run: the digits MLP in 2 stages, M=2, batch 32, 2 epochs of 5 steps, a
checkpoint every 3 steps (so steps 3, 6, 9 and the final 10). "The cut run" died
after step 8: it holds ckpt-3 and ckpt-6, and both resume points are mid-epoch.
"""

import hashlib
import json
import os
import pathlib
import pickle

import keras
import numpy as np
import pytest
import tensorflow as tf

from launch import checkpoints
from launch import train as train_lib
from tfpipe_tests import helpers

REPO = pathlib.Path(__file__).resolve().parents[1]
SETTINGS = dict(stages=2, microbatches=2, batch_size=32, epochs=2, steps_per_epoch=5,
                checkpoint_every=3)
FLAGS = ["--stages=2", "--microbatches=2", "--batch_size=32", "--epochs=2",
         "--steps_per_epoch=5", "--checkpoint_every=3", "--notimeline", "--logical_cpus=4"]
DATA = "ckpt-6.data-00000-of-00001"
CHILD_TIMEOUT = 180  # seconds; a child training run takes about 10 s


def config(model_dir, **kwargs):
    """The runs' `TrainConfig` in `model_dir`, with `kwargs` changed."""
    return train_lib.TrainConfig(model_dir=str(model_dir),
                                 **{"verbose": 0, "timeline": False, **SETTINGS, **kwargs})


class EpochLogs(keras.callbacks.Callback):
    """The logs Keras hands to callbacks at each epoch's end (what the progress bar shows)."""

    def __init__(self):
        super().__init__()
        self.logs = {}

    def on_epoch_end(self, epoch, logs=None):
        self.logs[epoch] = dict(logs)


class Preempted(Exception):
    pass


class Crash(keras.callbacks.Callback):
    def __init__(self, after_steps):
        super().__init__()
        self.after, self.seen = after_steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.after:
            raise Preempted(f"simulated pre-emption after step {self.after}")


def weights(model):
    return [w for stage in model.stages for w in stage.get_weights()]


def checkpoint_tensors(prefix):
    """The saved values (not the object graph, which holds Keras' unique names)."""
    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name != "_CHECKPOINTABLE_OBJECT_GRAPH"}


def manifest(model_dir, step):
    """Checkpoint `step`'s manifest, verified, with its whole history read
    from the history segments (`CheckpointStore.verify`)."""
    store = checkpoints.CheckpointStore(pathlib.Path(model_dir) / "checkpoints", None)
    return store.verify(step)


def committed(model_dir):
    names = os.listdir(pathlib.Path(model_dir) / "checkpoints")
    return sorted(int(n[5:-len(checkpoints.MANIFEST)]) for n in names
                  if n.startswith("ckpt-") and n.endswith(checkpoints.MANIFEST))


def step_scalars(model_dir):
    """[(step, tag, value)] of the per-step TensorBoard run, sorted as
    TensorBoard shows them (by step; a step written twice appears twice)."""
    out = []
    for path in sorted((pathlib.Path(model_dir) / "tensorboard" / "steps").glob("events.*")):
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                out.append((event.step, value.tag, float(tf.make_ndarray(value.tensor))))
    return sorted(out)


def tree(directory):
    """{relative path: sha256} of every file under `directory`."""
    directory = pathlib.Path(directory)
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def warnings(captured):
    return [line for line in captured.err.splitlines() if line.startswith("launch.train:")]


def make_reference(tmp_path_factory):
    """The uninterrupted run: its directory, weights and Keras' epoch logs.
    Trained once per pytest run (`helpers.shared_directory`): the other
    pytest-xdist worker reads it back; the tests copy the directory to change it."""
    def make(directory):
        model_dir = directory / "run"
        logs = EpochLogs()
        result = train_lib.train(config(model_dir), callbacks=[logs])
        assert result["steps"] == 10 and committed(model_dir) == [6, 9, 10]
        with open(directory / "reference.pickle", "wb") as f:
            pickle.dump({"weights": weights(result["model"]), "logs": logs.logs,
                         "history": result["history"]}, f)
    directory = helpers.shared_directory(tmp_path_factory, "trainer_faults_reference", make)
    with open(directory / "reference.pickle", "rb") as f:
        saved = pickle.load(f)
    model_dir = directory / "run"
    return {"dir": model_dir, **saved, "manifest": manifest(model_dir, 10)}


def make_cut_run(tmp_path_factory):
    """A run that died after step 8: ckpt-3 and ckpt-6 committed (made once
    per pytest run; the tests copy it)."""
    def make(model_dir):
        with pytest.raises(Preempted):
            train_lib.train(config(model_dir), callbacks=[Crash(after_steps=8)])
        assert committed(model_dir) == [3, 6]
    return helpers.shared_directory(tmp_path_factory, "trainer_faults_cut_run", make)


def assert_same_as_reference(model_dir, result, logs, reference, first_epoch):
    """Bit for bit: weights, history (manifest and history.json), epoch logs, TensorBoard."""
    for ours, theirs in zip(weights(result["model"]), reference["weights"], strict=True):
        np.testing.assert_array_equal(ours, theirs)
    assert manifest(model_dir, 10)["history"] == reference["manifest"]["history"]
    assert json.loads((model_dir / "history.json").read_text()) == \
        reference["manifest"]["history"]
    assert result["history"] == reference["history"]
    assert logs.logs == {e: reference["logs"][e] for e in range(first_epoch, 2)}
    assert step_scalars(model_dir) == step_scalars(reference["dir"])
    assert [s for s, tag, _ in step_scalars(model_dir) if tag == "step/loss"] == \
        list(range(1, 11))
    ours = checkpoint_tensors(str(model_dir / "checkpoints" / "ckpt-10"))
    theirs = checkpoint_tensors(str(reference["dir"] / "checkpoints" / "ckpt-10"))
    assert ours.keys() == theirs.keys()
    for name in ours:  # model, optimizer (Adam slots, iterations) and the step
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
