"""launch.train under faults: damaged checkpoints, kill -9, divergence, two runs, bad flags.

Each table row does one thing to a run or to its --model_dir and checks what
the user gets: the exact message lines, the exit code, where the run resumes.
A resumed run must equal the uninterrupted run bit for bit: every weight, the
history (every step's loss and metrics), the epoch means Keras reports, and
the per-step TensorBoard run (each step once).

The run: the digits MLP in 2 stages, M=2, batch 32, 2 epochs of 5 steps,
a checkpoint every 3 steps (so steps 3, 6, 9 and the final 10). "The cut
run" died after step 8: it holds ckpt-3 and ckpt-6, and both resume points
are mid-epoch. Subprocess tests bind nothing, run with a time limit in their
own session, and are killed (the whole group) if they overrun.
"""

import hashlib
import json
import os
import pathlib
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from launch import checkpoints
from launch import config as config_lib
from launch import data as data_lib
from launch import run_lock
from launch import train as train_lib
from tfpipe_tests import helpers

REPO = pathlib.Path(__file__).resolve().parents[1]
SETTINGS = dict(stages=2, microbatches=2, batch_size=32, epochs=2, steps_per_epoch=5,
                checkpoint_every=3)
FLAGS = ["--stages=2", "--microbatches=2", "--batch_size=32", "--epochs=2",
         "--steps_per_epoch=5", "--checkpoint_every=3", "--notimeline", "--logical_cpus=4"]
DATA = "ckpt-6.data-00000-of-00001"
CHILD_TIMEOUT = 180  # seconds; a child training run takes about 10 s


def _config(model_dir, **kwargs):
    return train_lib.TrainConfig(model_dir=str(model_dir),
                                 **{"verbose": 0, "timeline": False, **SETTINGS, **kwargs})


class _EpochLogs(keras.callbacks.Callback):
    """The logs Keras hands to callbacks at each epoch's end (what the progress bar shows)."""

    def __init__(self):
        super().__init__()
        self.logs = {}

    def on_epoch_end(self, epoch, logs=None):
        self.logs[epoch] = dict(logs)


class _Preempted(Exception):
    pass


class _Crash(keras.callbacks.Callback):
    def __init__(self, after_steps):
        super().__init__()
        self.after, self.seen = after_steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.after:
            raise _Preempted(f"simulated pre-emption after step {self.after}")


def _weights(model):
    return [w for stage in model.stages for w in stage.get_weights()]


def _checkpoint_tensors(prefix):
    """The saved values (not the object graph, which holds Keras' unique names)."""
    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name != "_CHECKPOINTABLE_OBJECT_GRAPH"}


def _manifest(model_dir, step):
    path = pathlib.Path(model_dir) / "checkpoints" / f"ckpt-{step}{checkpoints.MANIFEST}"
    return json.loads(path.read_text())


def _committed(model_dir):
    names = os.listdir(pathlib.Path(model_dir) / "checkpoints")
    return sorted(int(n[5:-len(checkpoints.MANIFEST)]) for n in names
                  if n.startswith("ckpt-") and n.endswith(checkpoints.MANIFEST))


def _step_scalars(model_dir):
    """[(step, tag, value)] of the per-step TensorBoard run, in file order."""
    out = []
    for path in sorted((pathlib.Path(model_dir) / "tensorboard" / "steps").glob("events.*")):
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                out.append((event.step, value.tag, float(tf.make_ndarray(value.tensor))))
    return out


def _tree(directory):
    """{relative path: sha256} of every file under `directory`."""
    directory = pathlib.Path(directory)
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _warnings(captured):
    return [line for line in captured.err.splitlines() if line.startswith("launch.train:")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its directory, weights and Keras' epoch logs.
    Trained once per pytest run (`helpers.shared_directory`): the other
    pytest-xdist worker reads it back; the tests copy the directory to change it."""
    def make(directory):
        model_dir = directory / "run"
        logs = _EpochLogs()
        result = train_lib.train(_config(model_dir), callbacks=[logs])
        assert result["steps"] == 10 and _committed(model_dir) == [6, 9, 10]
        with open(directory / "reference.pickle", "wb") as f:
            pickle.dump({"weights": _weights(result["model"]), "logs": logs.logs,
                         "history": result["history"]}, f)
    directory = helpers.shared_directory(tmp_path_factory, "trainer_faults_reference", make)
    with open(directory / "reference.pickle", "rb") as f:
        saved = pickle.load(f)
    model_dir = directory / "run"
    return {"dir": model_dir, **saved, "manifest": _manifest(model_dir, 10)}


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory):
    """A run that died after step 8: ckpt-3 and ckpt-6 committed (made once
    per pytest run; the tests copy it)."""
    def make(model_dir):
        with pytest.raises(_Preempted):
            train_lib.train(_config(model_dir), callbacks=[_Crash(after_steps=8)])
        assert _committed(model_dir) == [3, 6]
    return helpers.shared_directory(tmp_path_factory, "trainer_faults_cut_run", make)


def _assert_same_as_reference(model_dir, result, logs, reference, first_epoch):
    """Bit for bit: weights, history (manifest and history.json), epoch logs, TensorBoard."""
    for ours, theirs in zip(_weights(result["model"]), reference["weights"], strict=True):
        np.testing.assert_array_equal(ours, theirs)
    assert _manifest(model_dir, 10)["history"] == reference["manifest"]["history"]
    assert json.loads((model_dir / "history.json").read_text()) == \
        reference["manifest"]["history"]
    assert result["history"] == reference["history"]
    assert logs.logs == {e: reference["logs"][e] for e in range(first_epoch, 2)}
    assert _step_scalars(model_dir) == _step_scalars(reference["dir"])
    assert [s for s, tag, _ in _step_scalars(model_dir) if tag == "step/loss"] == \
        list(range(1, 11))
    ours = _checkpoint_tensors(str(model_dir / "checkpoints" / "ckpt-10"))
    theirs = _checkpoint_tensors(str(reference["dir"] / "checkpoints" / "ckpt-10"))
    assert ours.keys() == theirs.keys()
    for name in ours:  # model, optimizer (Adam slots, iterations) and the step
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


# -- damage done to the cut run's directory, and the resume that follows ----------


def _truncate(name):
    def damage(ckpt_dir):
        path = ckpt_dir / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return damage


def _flip_byte(name, at=0.5):
    def damage(ckpt_dir):
        data = bytearray((ckpt_dir / name).read_bytes())
        data[int(len(data) * at)] ^= 0x01
        (ckpt_dir / name).write_bytes(bytes(data))
    return damage


def _empty(name):
    return lambda ckpt_dir: (ckpt_dir / name).write_bytes(b"")


def _delete(*names):
    def damage(ckpt_dir):
        for name in names:
            (ckpt_dir / name).unlink()
    return damage


def _write(name, text):
    return lambda ckpt_dir: (ckpt_dir / name).write_text(text)


def _change_a_loss(ckpt_dir):
    path = ckpt_dir / f"ckpt-6{checkpoints.MANIFEST}"
    manifest = json.loads(path.read_text())
    manifest["history"]["steps"][2]["loss"] += 1e-9  # still valid JSON, one digit off
    path.write_text(json.dumps(manifest))


def _leftovers(ckpt_dir):
    (ckpt_dir / ".ckpt-9.tmp-4242-0badc0de.index").write_bytes(b"half")
    (ckpt_dir / ".ckpt-9.tmp-4242-0badc0de_temp").mkdir()
    (ckpt_dir.parent / ".history.json.x1y2z3.tmp").write_text('{"run"')


def _stale_lock(ckpt_dir):
    (ckpt_dir.parent / run_lock.LOCK_FILE).write_text(
        "pid 999999999 on elsewhere, since 2025-01-01T00:00:00\n")


def _skipped(reason):
    return [f"launch.train: warning: skipped ckpt-6: {reason}.",
            "launch.train: warning: moved the files of ckpt-6 to {ckpt}/skipped."]


_SIZE = "{size}"  # the size of the damaged file that ckpt-6's manifest recorded
RESUMES = [
    # (id, damage, resumed from, warnings: "{ckpt}" is the checkpoint dir, _SIZE ckpt-6's)
    ("intact", None, 6, []),
    ("data_truncated", _truncate(DATA), 3,
     _skipped(f"{DATA} has {{half}} bytes, {_SIZE} expected (truncated)")),
    ("data_byte_flipped", _flip_byte(DATA), 3,
     _skipped(f"{DATA} does not match its checksum (damaged)")),
    ("index_emptied", _empty("ckpt-6.index"), 3,
     _skipped(f"ckpt-6.index has 0 bytes, {_SIZE} expected (truncated)")),
    ("index_byte_flipped", _flip_byte("ckpt-6.index", at=0.2), 3,
     _skipped("ckpt-6.index does not match its checksum (damaged)")),
    ("data_deleted", _delete(DATA), 3, _skipped(f"{DATA} is missing")),
    ("manifest_truncated", _truncate(f"ckpt-6{checkpoints.MANIFEST}"), 3,
     _skipped(f"ckpt-6{checkpoints.MANIFEST} is unreadable (JSONDecodeError: {{json_error}})")),
    ("history_in_manifest_changed", _change_a_loss, 3,
     _skipped(f"ckpt-6{checkpoints.MANIFEST} does not match its own checksum (damaged)")),
    ("write_not_committed", _delete(f"ckpt-6{checkpoints.MANIFEST}"), 3,
     _skipped(f"it has no ckpt-6{checkpoints.MANIFEST}: its write did not finish (or an "
              f"older launch.train wrote it)")),
    ("newest_deleted_by_hand", _delete(DATA, "ckpt-6.index", f"ckpt-6{checkpoints.MANIFEST}"),
     3, ["launch.train: warning: skipped ckpt-6: {ckpt}/checkpoint lists it, but its files "
         "are gone."]),
    ("state_file_garbled", _write("checkpoint", "model_checkpoint_pa\x00\x17 garbage"), 6,
     ["launch.train: warning: {ckpt}/checkpoint is unreadable; the checkpoint list was "
      "rebuilt from the checkpoint files"]),
    ("state_file_deleted", _delete("checkpoint"), 6, []),
    ("state_file_names_only_the_oldest", _write("checkpoint", 'model_checkpoint_path: "ckpt-3"\n'),
     6, []),
    ("history_json_truncated", lambda d: (d.parent / "history.json").write_text('{"run": {'),
     6, []),
    ("history_json_deleted", lambda d: (d.parent / "history.json").unlink(), 6, []),
    ("temporary_files_left", _leftovers, 6, []),
    ("lock_left_by_a_killed_run", _stale_lock, 6,
     ["launch.train: warning: taking over --model_dir={dir} from a run that ended without "
      "releasing it (pid 999999999 on elsewhere, since 2025-01-01T00:00:00)."]),
]


# The default suite runs one damage of each kind of file (CI's slow step runs all).
DEFAULT_RESUMES = ("intact", "data_byte_flipped", "index_emptied", "manifest_truncated",
                   "history_in_manifest_changed", "state_file_garbled", "write_not_committed",
                   "lock_left_by_a_killed_run")
assert set(DEFAULT_RESUMES) <= {r[0] for r in RESUMES}, DEFAULT_RESUMES


@pytest.mark.parametrize("damage, resumed_from, expected", [
    pytest.param(d, s, e, id=i, marks=() if i in DEFAULT_RESUMES else pytest.mark.slow)
    for i, d, s, e in RESUMES])
def test_resume_after_damage_equals_the_uninterrupted_run(
        tmp_path, capsys, reference, cut_run, damage, resumed_from, expected):
    model_dir = tmp_path / "run"
    shutil.copytree(cut_run, model_dir)
    ckpt = model_dir / "checkpoints"
    manifest = _manifest(model_dir, 6)
    sizes = {name: f["size"] for name, f in manifest["files"].items()}
    if damage is not None:
        damage(ckpt)
    left_of_6 = sorted(n for n in os.listdir(ckpt) if n.startswith("ckpt-6."))
    json_error = None
    if (ckpt / f"ckpt-6{checkpoints.MANIFEST}").exists():
        try:
            json.loads((ckpt / f"ckpt-6{checkpoints.MANIFEST}").read_text())
        except ValueError as err:
            json_error = str(err)
    capsys.readouterr()
    logs = _EpochLogs()
    result = train_lib.train(_config(model_dir, resume=True), callbacks=[logs])
    captured = capsys.readouterr()

    damaged_name = next((n for n in sizes if n in "".join(expected)), DATA)
    half = sizes[damaged_name] // 2
    assert _warnings(captured) == [
        line.format(ckpt=ckpt, dir=model_dir, size=sizes[damaged_name], half=half,
                    json_error=json_error) for line in expected]
    assert f"Resuming from {ckpt}/ckpt-{resumed_from} (step {resumed_from})." in captured.out
    assert result["start_step"] == resumed_from and result["steps"] == 10
    _assert_same_as_reference(model_dir, result, logs, reference, first_epoch=1 if
                              resumed_from >= 5 else 0)
    skipped = sorted(os.listdir(ckpt / "skipped")) if (ckpt / "skipped").exists() else []
    assert skipped == (left_of_6 if any("moved the files" in e for e in expected) else [])
    assert not [n for n in os.listdir(ckpt) + os.listdir(model_dir) if n.endswith(".tmp")
                or ".tmp-" in n]
    assert _committed(model_dir) == [6, 9, 10] and \
        tf.train.latest_checkpoint(str(ckpt)) == str(ckpt / "ckpt-10")
    assert (model_dir / run_lock.LOCK_FILE).read_text() == ""  # released


# -- resumes that are refused, and change nothing --------------------------------------


def _refusal_for_nothing_intact(ckpt):
    return (f"--resume: no checkpoint in {ckpt} is intact, so there is nothing to resume "
            f"from (ckpt-6: {DATA} has {{half6}} bytes, {{size6}} expected (truncated); "
            f"ckpt-3: it has no ckpt-3{checkpoints.MANIFEST}: its write did not finish (or "
            f"an older launch.train wrote it)). Nothing was changed. Run without --resume "
            f"to start afresh (this deletes them), or pass another --model_dir.")


REFUSALS = [
    ("nothing_intact",
     lambda d: (_truncate(DATA)(d), _delete(f"ckpt-3{checkpoints.MANIFEST}")(d)), {},
     _refusal_for_nothing_intact),
    ("other_settings", None, {"batch_size": 16, "microbatches": 4},
     lambda ckpt: (f"--resume: {ckpt.parent} holds a run with other settings (batch_size: "
                   f"32 then, 16 now). Use the same settings, or another --model_dir without "
                   f"--resume.")),
    ("other_stages_without_reshard", None, {"stages": 4},
     lambda ckpt: (f"--resume: {ckpt.parent} holds a run with other settings (stages: 2 "
                   f"then, 4 now). Use the same settings, or another --model_dir without "
                   f"--resume.")),
    ("reshard_to_another_depth", None, {"stages": 4, "depth": 6, "reshard": True},
     lambda ckpt: (f"--resume: {ckpt.parent} holds a run with other settings (depth: 0 "
                   f"then, 6 now). Use the same settings, or another --model_dir without "
                   f"--resume.")),
    # 8 stages (2 per device) make the MLP deeper: its variables no longer fit.
    ("reshard_to_another_architecture", None,
     {"stages": 8, "schedule": "interleaved", "microbatches": 4, "reshard": True},
     lambda ckpt: (f"--resume: {ckpt}/ckpt-6 is intact but does not fit this model "
                   f"(ValueError: Received incompatible tensor with shape (128, 10) when "
                   f"attempting to restore variable with shape (128, 128) and name "
                   f"digits_mlp/dense_4/kernel:0.). Was it written by another version of the "
                   f"model code or another architecture (--depth, when not given, grows with "
                   f"--stages: pass the depth of the run you resume)? Use another "
                   f"--model_dir.")),
    ("other_seed_after_fallback", _truncate(DATA), {"seed": 1},
     lambda ckpt: (f"--resume: {ckpt.parent} holds a run with other settings (seed: 0 then, "
                   f"1 now). Use the same settings, or another --model_dir without "
                   f"--resume.")),
]


@pytest.mark.parametrize("damage, changes, message",
                         [pytest.param(d, c, m, id=i) for i, d, c, m in REFUSALS])
def test_resume_refuses_and_changes_nothing(tmp_path, cut_run, damage, changes, message):
    model_dir = tmp_path / "run"
    shutil.copytree(cut_run, model_dir)
    ckpt = model_dir / "checkpoints"
    size6 = _manifest(model_dir, 6)["files"][DATA]["size"]
    if damage is not None:
        damage(ckpt)
    before = _tree(model_dir)
    with pytest.raises(config_lib.RunError) as err:
        train_lib.train(_config(model_dir, resume=True, **changes))
    assert str(err.value) == message(ckpt).format(half6=size6 // 2, size6=size6)
    assert err.value.exit_code == 1
    assert _tree(model_dir) == before


@pytest.mark.parametrize("stages, schedule", [(1, "gpipe"), (4, "1f1b")])
def test_reshard_resumes_at_another_stage_count_like_the_uninterrupted_run(
        tmp_path, capsys, reference, cut_run, stages, schedule):
    """Written at 2 stages, resumed at 1 or 4 (--reshard): the same run."""
    model_dir = tmp_path / "run"
    shutil.copytree(cut_run, model_dir)
    result = train_lib.train(_config(model_dir, resume=True, reshard=True, stages=stages,
                                     schedule=schedule))
    out = capsys.readouterr().out
    assert f"Resuming from {model_dir / 'checkpoints'}/ckpt-6 (step 6)." in out
    assert (f"--reshard: checkpoint written at {{'stages': 2}}, continuing at "
            f"{{'stages': {stages}}}.") in out
    assert len(result["model"].stages) == stages
    for ours, theirs in zip(_weights(result["model"]), reference["weights"], strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    history = _manifest(model_dir, 10)["history"]
    for ours, theirs in zip(history["steps"], reference["manifest"]["history"]["steps"],
                            strict=True):
        assert ours == pytest.approx(theirs, rel=1e-5)
    assert result["history"].keys() == reference["history"].keys()
    for key, values in reference["history"].items():
        assert result["history"][key] == pytest.approx(values, rel=1e-5), key
    # The checkpoints now belong to the new layout: a plain --resume at it works.
    assert history["run"]["stages"] == stages


@pytest.mark.parametrize("state_file, expected", [
    (None, []),
    ('model_checkpoint_path: "ckpt-6"\n',  # every checkpoint file deleted by hand
     ["launch.train: warning: skipped ckpt-6: {ckpt}/checkpoint lists it, but its files are "
      "gone."]),
], ids=["empty_model_dir", "only_a_state_file_left"])
def test_resume_without_any_checkpoint_file_starts_at_step_0(
        tmp_path, capsys, reference, state_file, expected):
    ckpt = tmp_path / "checkpoints"
    if state_file:
        ckpt.mkdir()
        (ckpt / "checkpoint").write_text(state_file)
    logs = _EpochLogs()
    result = train_lib.train(_config(tmp_path, resume=True), callbacks=[logs])
    captured = capsys.readouterr()
    assert _warnings(captured) == [line.format(ckpt=ckpt) for line in expected]
    assert f"--resume: no checkpoint in {ckpt}; starting from step 0." in captured.out
    assert result["start_step"] == 0
    _assert_same_as_reference(tmp_path, result, logs, reference, first_epoch=0)


def test_resume_of_a_finished_run_trains_nothing_and_says_so(tmp_path, capsys, reference):
    shutil.copytree(reference["dir"], tmp_path / "run")
    config = _config(tmp_path / "run", resume=True)
    result = train_lib.train(config)
    out = capsys.readouterr().out
    assert "The run had finished: step 10 of 10 (--epochs=2 x 5 steps); nothing to train." in out
    assert result["start_step"] == result["steps"] == 10 and result["step_time_ms"] is None
    summary = train_lib.format_summary(config, result)
    assert "mean step time        - (no step ran in this process)" in summary
    assert "nan" not in summary
    assert result["history"] == reference["history"]
    assert _committed(tmp_path / "run") == [6, 9, 10]


# -- divergence -------------------------------------------------------------------------


def test_non_finite_loss_stops_the_run_and_keeps_the_last_finite_checkpoint(tmp_path):
    with pytest.raises(config_lib.Diverged) as err:
        train_lib.train(_config(tmp_path, learning_rate=1e9, checkpoint_every=1))
    ckpt = tmp_path / "checkpoints"
    assert str(err.value) == (
        f"training diverged: the training loss is nan at step 2. Stopped there; nothing "
        f"non-finite was saved: the newest checkpoint, {ckpt}/ckpt-1, is the last one saved "
        f"(its weights are finite) and --resume would continue from it. A lower "
        f"--learning_rate (now 1e+09) may help.")
    assert err.value.step == 2 and err.value.exit_code == 3
    assert _committed(tmp_path) == [1]
    for name, value in _checkpoint_tensors(str(ckpt / "ckpt-1")).items():
        if value.dtype.kind == "f":
            assert np.isfinite(value).all(), name
    assert [s["step"] for s in json.loads((tmp_path / "history.json").read_text())["steps"]] \
        == [1]


@pytest.mark.slow
def test_divergence_from_the_command_line_exits_3(tmp_path):
    proc = _child(["-m", "launch.train", f"--model_dir={tmp_path}", "--learning_rate=1e9",
                   "--checkpoint_every=1", *FLAGS[:5], *FLAGS[6:]])
    assert proc.returncode == 3
    assert proc.stderr.splitlines()[-1] == (
        f"launch.train: error: training diverged: the training loss is nan at step 2. Stopped "
        f"there; nothing non-finite was saved: the newest checkpoint, {tmp_path}/checkpoints/"
        f"ckpt-1, is the last one saved (its weights are finite) and --resume would continue "
        f"from it. A lower --learning_rate (now 1e+09) may help.")
    assert _committed(tmp_path) == [1]


class _PoisonAdamSlot(keras.callbacks.Callback):
    """After step `at`, a NaN into the velocity of the first kernel: the next step's loss
    is still finite (the weights are), its update is not."""

    def __init__(self, at):
        super().__init__()
        self.at, self.seen, self.names = at, 0, None

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            kernel = self.model.stages[0].trainable_variables[0]
            slot = next(v for v in self.model.optimizer.variables
                        if v.path.endswith(kernel.path.replace("/", "_") + "_velocity"))
            slot.assign(np.full(slot.shape, np.nan, "float32"))
            self.names = [kernel.path, slot.path]


def test_non_finite_weights_are_never_saved(tmp_path):
    poison = _PoisonAdamSlot(at=2)
    with pytest.raises(config_lib.Diverged) as err:
        train_lib.train(_config(tmp_path, checkpoint_every=1), callbacks=[poison])
    ckpt = tmp_path / "checkpoints"
    assert str(err.value) == (
        f"training diverged: after step 3 2 variable(s) hold NaN or infinite values "
        f"({', '.join(poison.names)}), although the loss was finite. Stopped there; nothing "
        f"non-finite was saved: the newest checkpoint, {ckpt}/ckpt-2, is the last one saved "
        f"(its weights are finite) and --resume would continue from it. A lower "
        f"--learning_rate (now 0.001) may help.")
    assert err.value.step == 3 and _committed(tmp_path) == [1, 2]


# -- one run per --model_dir -----------------------------------------------------------


def test_a_second_run_on_a_busy_model_dir_stops_at_once(tmp_path):
    with run_lock.RunLock(tmp_path) as lock:
        holder = (tmp_path / run_lock.LOCK_FILE).read_text().strip()
        assert holder.startswith(f"pid {os.getpid()} on {socket.gethostname()}, since ")
        with pytest.raises(config_lib.ModelDirBusy) as err:
            train_lib.train(_config(tmp_path))
        assert str(err.value) == (
            f"--model_dir={tmp_path} is in use by another run ({holder}); two runs in one "
            f"directory would mix their checkpoints. Wait for it to end, stop it (kill "
            f"{os.getpid()}), or pass another --model_dir.")
        assert err.value.exit_code == 2
        # From the command line: exit code 2, before TensorFlow is even imported.
        start = time.monotonic()
        proc = _child(["-m", "launch.train", f"--model_dir={tmp_path}"], timeout=60)
        assert time.monotonic() - start < 5
        assert proc.returncode == 2
        assert proc.stderr.splitlines()[-1] == f"launch.train: error: {err.value}"
        assert lock.previous is None
    assert sorted(os.listdir(tmp_path)) == [run_lock.LOCK_FILE]  # nothing else was touched


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path):
    code = ("import sys, time; from launch import run_lock; "
            "run_lock.RunLock(sys.argv[1]).acquire(); print('locked', flush=True); "
            "time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        holder = (tmp_path / run_lock.LOCK_FILE).read_text().strip()
        assert holder.startswith(f"pid {proc.pid} on ")
        with pytest.raises(config_lib.ModelDirBusy, match=f"kill {proc.pid}"):
            run_lock.RunLock(tmp_path).acquire()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    lock = run_lock.RunLock(tmp_path).acquire()
    try:
        assert lock.previous == holder
        assert (tmp_path / run_lock.LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")
    finally:
        lock.release()


# -- flags: one line and exit code 1, before TensorFlow starts ---------------------------

# Runs `python -m launch.train ARGS` and says at exit whether TensorFlow was imported.
_MAIN_REPORTING_TF = (
    "import atexit, runpy, sys\n"
    "atexit.register(lambda: sys.stderr.write("
    "'tensorflow imported: %s\\n' % ('tensorflow' in sys.modules)))\n"
    "sys.argv = ['launch.train'] + sys.argv[1:]\n"
    "runpy.run_module('launch.train', run_name='__main__', alter_sys=True)\n")

BAD_FLAGS = [
    ("--batch_size=0", "flag --batch_size=0: must be a positive integer (rows per training "
                       "step), got 0"),
    ("--batch_size=x", "flag --batch_size=x: invalid literal for int() with base 10: 'x'"),
    ("--epochs=-1", "flag --epochs=-1: must be a positive integer (training epochs), got -1"),
    ("--epochs=0", "flag --epochs=0: must be a positive integer (training epochs), got 0"),
    ("--steps_per_epoch=-3", "flag --steps_per_epoch=-3: must be an integer >= 0 (0: one pass "
                             "over the training data), got -3"),
    ("--stages=0", "flag --stages=0: must be a positive integer (pipeline stages), got 0"),
    ("--microbatches=0", "flag --microbatches=0: must be a positive integer (micro-batches per "
                         "training batch), got 0"),
    ("--depth=-1", "flag --depth=-1: must be an integer >= 0 (0: 4), got -1"),
    ("--max_examples=-1", "flag --max_examples=-1: must be an integer >= 0 (0: all), got -1"),
    ("--logical_cpus=0", "flag --logical_cpus=0: must be a positive integer (logical CPU "
                         "devices), got 0"),
    ("--checkpoint_every=-1", "flag --checkpoint_every=-1: must be an integer >= 0 (steps; 0: "
                              "only at the end), got -1"),
    ("--learning_rate=0", "flag --learning_rate=0.0: must be a finite number > 0, got 0.0"),
    ("--learning_rate=nan", "flag --learning_rate=nan: must be a finite number > 0, got nan"),
    ("--seed=-1", "flag --seed=-1: must be an integer from 0 to 2**32 - 1, got -1"),
    ("--model=vgg", "flag --model=vgg: value should be one of <mlp|resnet|transformer|unet>"),
    ("--recompute=sometimes", "flag --recompute=sometimes: value should be one of "
                              "<auto|always|except_last|never>"),
    ("--execution=graph", "flag --execution=graph: value should be one of "
                          "<auto|unrolled|stage_functions|loop>"),
    ("--schedule=gpipee", "flag --schedule=gpipee: unknown schedule 'gpipee'; valid choices: "
                          "gpipe, 1f1b, interleaved (2 stages per device), interleaved:V (V "
                          "stages per device, V >= 1), zbh1, zbv (2 stages per device, in a "
                          "V), or NAME/segments=N (each stage recomputed in N pieces)"),
    ("--schedule=interleaved:0", "flag --schedule=interleaved:0: interleaved:V needs V >= 1 "
                                 "stages per device, got 'interleaved:0'"),
    ("--dataset=mnist", "flag --dataset=mnist: unknown dataset 'mnist'; valid choices: auto, "
                        "digits, digits_masks, pydoc_topics, or tfds:NAME (a TensorFlow "
                        "Datasets data set prepared under --data_dir)"),
    ("--dataset=tfds:", "flag --dataset=tfds:: 'tfds:' needs a TFDS name, e.g. tfds:mnist"),
    ("--model_dir=/dev/null", "flag --model_dir=/dev/null: /dev/null exists and is not a "
                              "directory"),
    ("--microbatches=7 --batch_size=4",
     "flags microbatches=7, batch_size=4: --microbatches=7 is more than the training batch "
     "(--batch_size=4): 3 of the 7 micro-batches of every training step would be empty. Use "
     "--microbatches <= 4, or --batch_size >= 7."),
    ("--model=transformer --dataset=digits",
     "flags model=transformer, dataset=digits: --model=transformer trains on text data, but "
     "--dataset=digits is image data (models for it: mlp, resnet)."),
    ("--model=unet --dataset=pydoc_topics",
     "flags model=unet, dataset=pydoc_topics: --model=unet trains on segmentation data, but "
     "--dataset=pydoc_topics is text data (models for it: transformer)."),
    ("--stages=3 --schedule=interleaved",
     "flags stages=3, schedule=interleaved, microbatches=4: --schedule=interleaved puts 2 "
     "stages on each device, so --stages must be a multiple of 2; got --stages=3. Use "
     "--stages=4."),
    ("--stages=4 --schedule=interleaved --microbatches=3",
     "flags stages=4, schedule=interleaved, microbatches=3: --schedule=interleaved:2 needs "
     "--microbatches to be a multiple of its 2 devices; got --microbatches=3. Use "
     "--microbatches=4, or --schedule=1f1b."),
    ("--stages=3 --schedule=zbv",
     "flags stages=3, schedule=zbv, microbatches=4: --schedule=zbv puts 2 stages on each "
     "device, so --stages must be a multiple of 2; got --stages=3. Use --stages=4."),
    ("--execution=loop --recompute=never",
     "flags execution=loop, recompute=never: --execution=loop keeps only the stage inputs "
     "and recomputes every stage in the backward pass, so it needs --recompute=always (or "
     "auto); got --recompute=never. Use --execution=unrolled for 'never'."),
    ("--reshard --stages=2", "flags reshard=True, resume=False: --reshard changes the stage "
                             "layout of a resumed run; it needs --resume (a fresh run takes "
                             "any --stages without it)."),
    ("--replicas=0", "flag --replicas=0: unknown replicas '0'; valid choices: N >= 1 (N "
                     "data-parallel copies of the pipeline in this process, on N x the "
                     "pipeline's devices), or tf_config (this process is one replica of the "
                     "TF_CONFIG cluster; every worker runs the same command)"),
    ("--replicas=2 --cluster=local:2 --stages=2",
     "flags replicas=2, cluster=local:2: --replicas=2 with --cluster=local:2: data "
     "parallelism over stages on remote workers is not built. Use --cluster (one pipeline "
     "over the workers) or --replicas (pipelines here, or one per TF_CONFIG worker "
     "process), not both."),
    ("--replicas=tf_config",
     "flags replicas=tf_config, cluster=: --replicas=tf_config: every worker process runs "
     "this command with its own TF_CONFIG, which must name the cluster and this process's "
     "task, e.g. TF_CONFIG='{\"cluster\": {\"worker\": [\"host0:port\", \"host1:port\"]}, "
     "\"task\": {\"type\": \"worker\", \"index\": 0}}'."),
    ("--epochs=2 extra", "launch.train: error: unexpected arguments ['extra'] (flags take the "
                         "form --name=value; --helpfull lists them)"),
]


def _child(args, timeout=CHILD_TIMEOUT, env=None):
    """Runs `python ARGS` in the repository, in its own session; kills the group on overrun."""
    return helpers.run_child(args, timeout, env)


@pytest.mark.parametrize("flags_, line", [pytest.param(f, m, id=f) for f, m in BAD_FLAGS])
def test_a_bad_flag_is_one_line_before_tensorflow_starts(tmp_path, flags_, line):
    start = time.monotonic()
    proc = _child(["-c", _MAIN_REPORTING_TF, f"--model_dir={tmp_path}/run",
                   *flags_.split()], timeout=60)
    elapsed = time.monotonic() - start
    expected = [line] if line.startswith("launch.train: error:") else [
        f"FATAL Flags parsing error: {line}",
        "Pass --helpshort or --helpfull to see help on flags."]
    assert proc.stderr.splitlines() == [*expected, "tensorflow imported: False"]
    assert proc.returncode == 1 and proc.stdout == ""
    assert elapsed < 5  # TensorFlow alone takes 5-8 s to import here
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("changes, message", [
    ({"batch_size": 0}, "batch_size=0: must be a positive integer (rows per training step), "
                        "got 0"),
    ({"model": "vgg"}, "model='vgg': unknown model 'vgg'; valid choices: mlp, resnet, "
                       "transformer, unet"),
    ({"verbose": 3}, "verbose=3: must be None, 0, 1 or 2, got 3"),
    ({"microbatches": 64, "batch_size": 32},
     "--microbatches=64 is more than the training batch (--batch_size=32): 32 of the 64 "
     "micro-batches of every training step would be empty. Use --microbatches <= 32, or "
     "--batch_size >= 64."),
    ({"max_examples": 1}, "--dataset=digits has 1 training example(s) (--max_examples=1), "
                          "fewer than --microbatches=2: every training batch would leave "
                          "micro-batches empty. Use more examples or fewer micro-batches."),
    ({"stages": 8}, "--stages=8 with --schedule=gpipe needs 8 devices, but --logical_cpus=4 "
                    "(and there is no GPU). Use --logical_cpus=8."),
    ({"stages": 2, "replicas": "4"},
     "--stages=2 with --schedule=gpipe and --replicas=4 needs 8 devices, but "
     "--logical_cpus=4 (and there is no GPU). Use --logical_cpus=8."),
    ({"dataset": "tfds:no_such_set_xyz", "data_dir": "/nonexistent/tfds"},
     "TensorFlow Datasets has no data set 'no_such_set_xyz': it is neither a registered TFDS "
     "name nor prepared under /nonexistent/tfds. Prepare it on a machine with network access "
     "(`tfds build no_such_set_xyz --data_dir=DIR`, or tfds.builder('no_such_set_xyz', "
     "data_dir=DIR).download_and_prepare()), copy DIR here and pass --data_dir=DIR."),
], ids=["batch_size_0", "unknown_model", "verbose_3", "microbatches_over_batch",
        "fewer_examples_than_microbatches", "more_devices_than_logical_cpus",
        "more_replicas_than_logical_cpus", "tfds_data_set_missing"])
def test_a_bad_train_config_raises_a_run_error(tmp_path, changes, message):
    with pytest.raises(config_lib.RunError) as err:
        train_lib.train(_config(tmp_path / "run", **changes))
    assert str(err.value) == message


def test_flag_choices_match_the_library():
    import tfpipe  # pylint: disable=import-outside-toplevel

    assert config_lib.RECOMPUTE_MODES[1:] == tfpipe.schedules.RECOMPUTE_MODES
    assert config_lib.EXECUTIONS[1:] == tuple(tfpipe.config.EXECUTIONS)
    from launch import trainer  # pylint: disable=import-outside-toplevel

    assert sorted(trainer.MODELS) == train_lib.MODEL_NAMES
    assert set(data_lib.BUILTIN_KINDS) == set(data_lib.BUILTIN)
    for name, kind in data_lib.BUILTIN_KINDS.items():  # what the flag check assumes
        assert data_lib.load(name, max_examples=2).kind == kind


# -- kill -9 of real training processes -------------------------------------------------

# `python -m launch.train ARGS`, killed with SIGKILL just before the N-th call of
# os.replace or os.unlink on a file of the name in $KILL_BEFORE ("replace:NAME:N" or
# "unlink:NAME:N"): a deterministic point inside a checkpoint save.
_MAIN_KILLED_AT = (
    "import os, runpy, signal, sys\n"
    "kind, name, nth = os.environ['KILL_BEFORE'].split(':')\n"
    "real, calls = getattr(os, kind), []\n"
    "def hooked(*args, **kwargs):\n"
    "    target = args[1] if kind == 'replace' else args[0]\n"
    "    if os.path.basename(str(target)) == name:\n"
    "        calls.append(target)\n"
    "        if len(calls) == int(nth):\n"
    "            os.kill(os.getpid(), signal.SIGKILL)\n"
    "    return real(*args, **kwargs)\n"
    "setattr(os, kind, hooked)\n"
    "sys.argv = ['launch.train'] + sys.argv[1:]\n"
    "runpy.run_module('launch.train', run_name='__main__', alter_sys=True)\n")

_NOT_COMMITTED = [
    "launch.train: warning: skipped ckpt-6: it has no ckpt-6.manifest.json: its write did "
    "not finish (or an older launch.train wrote it).",
    "launch.train: warning: moved the files of ckpt-6 to {ckpt}/skipped."]
KILL_POINTS = [
    # (where, committed after the kill, warnings of the resume). The saves are after
    # steps 3, 6, 9 and 10; each renames data, index, manifest, state file, history.json.
    ("replace:ckpt-6.data-00000-of-00001:1", [3], []),  # TF's files under their temp name
    ("replace:ckpt-6.index:1", [3], _NOT_COMMITTED),  # the data file renamed, not the index
    ("replace:ckpt-6.manifest.json:1", [3], _NOT_COMMITTED),  # both renamed, no commit
    ("replace:checkpoint:2", [3, 6], []),  # committed; TF's state file still names ckpt-3
    ("replace:history.json:2", [3, 6], []),  # committed; history.json still at step 3
    ("unlink:ckpt-3.index:1", [6, 9, 10], []),  # rotation after ckpt-10: ckpt-3 half deleted
]


def _kill_and_resume(tmp_path, capsys, reference, where, committed, expected):
    model_dir = tmp_path / "run"
    proc = _child(["-c", _MAIN_KILLED_AT, f"--model_dir={model_dir}", *FLAGS],
                  env={"KILL_BEFORE": where})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    # TensorFlow started quietly (launch.train.quiet_start_up; test_packaging.py).
    assert [line for line in proc.stderr.splitlines()
            if "oneDNN" in line or "absl::InitializeLog" in line or "E0000" in line] == []
    assert _committed(model_dir) == committed
    capsys.readouterr()
    logs = _EpochLogs()
    result = train_lib.train(_config(model_dir, resume=True), callbacks=[logs])
    ckpt = model_dir / "checkpoints"
    warnings = _warnings(capsys.readouterr())
    assert warnings[0].startswith(
        f"launch.train: warning: taking over --model_dir={model_dir} from a run that ended "
        f"without releasing it (pid {proc.pid} on ")
    assert warnings[1:] == [line.format(ckpt=ckpt) for line in expected]
    assert result["start_step"] == committed[-1]
    _assert_same_as_reference(model_dir, result, logs, reference,
                              first_epoch=committed[-1] // 5)
    assert not [n for n in os.listdir(ckpt) if n.startswith(".")]
    assert _committed(model_dir) == [6, 9, 10]


# Each point of the save once; the default suite runs the kill between the
# renames and the commit (data and index in place, no manifest yet).
@pytest.mark.parametrize("where, committed, expected", [
    pytest.param(*row, id=row[0], marks=() if row[0] == "replace:ckpt-6.manifest.json:1"
                 else pytest.mark.slow) for row in KILL_POINTS])
def test_kill_9_inside_a_checkpoint_save(tmp_path, capsys, reference, where, committed,
                                         expected):
    _kill_and_resume(tmp_path, capsys, reference, where, committed, expected)


@pytest.mark.slow
def test_kill_9_at_random_times_then_resume_equals_the_uninterrupted_run(tmp_path, reference):
    # A checkpoint after every step, so a random moment of training is often
    # inside a save. Each of three attempts is killed at a random moment within
    # 0.4 s after it committed its first new checkpoint (TensorFlow's start-up,
    # ~6 s, is not worth killing); a fourth resumes to the end. One seed: each
    # point inside a save is killed on purpose above (KILL_POINTS); this row
    # checks that three moments nobody chose resume exactly too.
    rng = np.random.default_rng(0)
    model_dir = tmp_path / "run"
    args = ["-m", "launch.train", f"--model_dir={model_dir}", "--checkpoint_every=1",
            *FLAGS[:5], *FLAGS[6:]]

    def newest():
        return ([0] + _committed(model_dir) if (model_dir / "checkpoints").is_dir() else [0])[-1]

    killed_after = []
    for attempt in range(4):
        start_step = newest() if attempt else 0
        with open(tmp_path / f"stderr{attempt}", "w+") as err:
            proc = subprocess.Popen([sys.executable, *args, *(["--resume"] if attempt else [])],
                                    cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                    text=True, start_new_session=True,
                                    env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
            try:
                deadline = time.monotonic() + CHILD_TIMEOUT
                while attempt < 3 and proc.poll() is None and newest() == start_step:
                    assert time.monotonic() < deadline, "no checkpoint within the time limit"
                    time.sleep(0.005)
                if attempt < 3:
                    time.sleep(float(rng.uniform(0.0, 0.4)))
                if attempt < 3 and proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed_after.append(newest())
                proc.wait(timeout=CHILD_TIMEOUT)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            err.seek(0)
            assert proc.returncode in (0, -signal.SIGKILL), err.read()[-3000:]
        if proc.returncode == 0:
            break
    assert killed_after and newest() == 10, killed_after
    ours = _checkpoint_tensors(str(model_dir / "checkpoints" / "ckpt-10"))
    theirs = _checkpoint_tensors(str(reference["dir"] / "checkpoints" / "ckpt-10"))
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert _manifest(model_dir, 10)["history"] == reference["manifest"]["history"]
