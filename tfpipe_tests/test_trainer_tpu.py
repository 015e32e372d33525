"""`launch.train --tpu`: the trainer under a `TPUStrategy`, stage k on logical
core k of each replica.

On CPU the strategy is `tfpipe.testing.tpu_strategy`'s real TPUStrategy over
cores that do not exist (put in place of `run_devices.connect_tpu`, which
needs a TPU), so a run goes through every phase before the first step (the
devices, whole batches, the build under the TPUStrategy, the restore,
the callbacks) and Keras' whole train step is traced; running it stops at
the missing TPU kernel. `benchmarks/tpu_check.py` is the hardware check.
"""

import keras
import pytest
import tensorflow as tf

import tfpipe
from launch import checkpoints
from launch import config as config_lib
from launch import run_devices
from launch import run_lock
from launch import train as train_lib
from tfpipe_tests import helpers


class _Seen(keras.callbacks.Callback):
    """The model and batch Keras hands to the callbacks before the first step."""

    def __init__(self):
        super().__init__()
        self.devices = None

    def on_train_begin(self, logs=None):
        self.devices = list(self.model.stage_devices)


# (model, stages, replicas, schedule): the models' data kinds and the schedules
# pairwise; interleaved holds two stages on each core.
RUNS = [
    ("mlp", 2, "2", "gpipe"),
    ("transformer", 2, "1", "1f1b"),
    ("unet", 4, "1", "interleaved"),
]


@pytest.mark.parametrize("model, stages, replicas, schedule", RUNS)
def test_a_tpu_run_traces_to_the_missing_tpu_kernel(tmp_path, monkeypatch, capsys, model,
                                                    stages, replicas, schedule):
    made = []

    def stand_in(name, cores_per_replica, num_replicas):
        made.append((name, cores_per_replica, num_replicas))
        return tfpipe.testing.tpu_strategy("v3-8", cores_per_replica, num_replicas)

    monkeypatch.setattr(run_devices, "connect_tpu", stand_in)
    seen = _Seen()
    # 30 validation rows of the data sets are not a multiple of the batch:
    # whole batches are what passes fit's static-batch check.
    config = train_lib.TrainConfig(
        model=model, stages=stages, replicas=replicas, schedule=schedule, microbatches=2,
        batch_size=16, epochs=1, steps_per_epoch=2, max_examples=70, verbose=2,
        timeline=True, tpu="local", model_dir=str(tmp_path / "run"))
    with pytest.raises(tf.errors.InvalidArgumentError, match="'TPUReplicatedInput'"):
        train_lib.train(config, callbacks=[seen])
    cores = config_lib.num_devices(config)
    assert made == [("local", cores, int(replicas))]
    # No plan and no timeline: both would time the host's CPU, not the TPU.
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"--tpu=local: {replicas} replica(s) of {cores} core(s); stage k on " \
                     f"logical core k."
    assert [line.split(":")[0] for line in out[1:3]] == ["No plan before the first step",
                                                       "--timeline"]
    assert all("a TPUStrategy's logical cores run only inside its replica program" in line
               for line in out[1:3])
    assert [(type(d).__name__, d.index) for d in seen.devices] == \
        [("LogicalCore", k % cores) for k in range(stages)]
    # Nothing was committed, and the lock is released.
    assert not list((tmp_path / "run" / checkpoints.CHECKPOINT_DIR).glob("ckpt-*.index"))
    assert (tmp_path / "run" / run_lock.LOCK_FILE).read_text() == ""


def test_tpu_local_without_a_tpu_is_one_line(tmp_path):
    proc = helpers.run_child(["-m", "launch.train", "--tpu=local", "--stages=2",
                              f"--model_dir={tmp_path}/run"], timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert lines[-1].startswith(
        "launch.train: error: --tpu=local with --stages=2, --schedule=auto: TPUs not found "
        "in the cluster."), lines
    assert lines[-1].endswith(
        "Run on a Cloud TPU VM (--tpu=local) or name a reachable TPU, with stages (or "
        "stages / V interleaved) x replicas within its cores.")
