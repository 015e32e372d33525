"""launch.train under faults: damaged checkpoints, kill -9, divergence, two runs
(bad input: test_trainer_flags.py).

Each table row does one thing to a run or to its --model_dir and checks what
the user gets: the exact message lines, the exit code, where the run resumes.
A resumed run must equal the uninterrupted run bit for bit: every weight, the
history (every step's loss and metrics), the epoch means Keras reports, and
the per-step TensorBoard run (each step once).

The runs are `tfpipe_tests/trainer_runs.py`'s. Subprocess tests bind nothing, run with a time limit in their
own session, and are killed (the whole group) if they overrun.
"""

import json
import os
import re
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
from launch import errors
from launch import outputs
from launch import run_lock
from launch import segments
from launch import train as train_lib
from tfpipe_tests import helpers

from tfpipe_tests import trainer_runs as runs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (`trainer_runs.make_reference`)."""
    return runs.make_reference(tmp_path_factory)


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory):
    """The run cut after step 8 (`trainer_runs.make_cut_run`)."""
    return runs.make_cut_run(tmp_path_factory)


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
    path = ckpt_dir / "history" / segments.name(6)
    segment = json.loads(path.read_text())
    segment["steps"][1]["loss"] += 1e-9  # still valid JSON, one digit off
    path.write_text(json.dumps(segment))


def _change_a_setting(ckpt_dir):
    path = ckpt_dir / f"ckpt-6{checkpoints.MANIFEST}"
    manifest = json.loads(path.read_text())
    manifest["run"]["seed"] = 1  # still valid JSON, the run's settings off
    path.write_text(json.dumps(manifest))


def _leftovers(ckpt_dir):
    """What an interrupted save leaves: temporary files the run recorded
    before making them (removed at the resume), and a user's file named like
    one, which it did not (kept)."""
    record = outputs.Record(ckpt_dir.parent)
    record.add(ckpt_dir / ".ckpt-9.tmp-4242-0badc0de", "prefix")
    (ckpt_dir / ".ckpt-9.tmp-4242-0badc0de.index").write_bytes(b"half")
    (ckpt_dir / ".ckpt-9.tmp-4242-0badc0de_temp").mkdir()
    record.add(ckpt_dir.parent / ".history.json.x1y2z3.tmp")
    (ckpt_dir.parent / ".history.json.x1y2z3.tmp").write_text('{"run"')
    (ckpt_dir.parent / ".notes.tmp").write_text("a user's")


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
    ("data_truncated", _truncate(runs.DATA), 3,
     _skipped(f"{runs.DATA} has {{half}} bytes, {_SIZE} expected (truncated)")),
    ("data_byte_flipped", _flip_byte(runs.DATA), 3,
     _skipped(f"{runs.DATA} does not match its checksum (damaged)")),
    ("index_emptied", _empty("ckpt-6.index"), 3,
     _skipped(f"ckpt-6.index has 0 bytes, {_SIZE} expected (truncated)")),
    ("index_byte_flipped", _flip_byte("ckpt-6.index", at=0.2), 3,
     _skipped("ckpt-6.index does not match its checksum (damaged)")),
    ("data_deleted", _delete(runs.DATA), 3, _skipped(f"{runs.DATA} is missing")),
    ("manifest_truncated", _truncate(f"ckpt-6{checkpoints.MANIFEST}"), 3,
     _skipped(f"ckpt-6{checkpoints.MANIFEST} is unreadable (JSONDecodeError: {{json_error}})")),
    ("manifest_changed", _change_a_setting, 3,
     _skipped(f"ckpt-6{checkpoints.MANIFEST} does not match its own checksum (damaged)")),
    # ckpt-6's chain runs through it; ckpt-3's ends before it.
    ("history_segment_changed", _change_a_loss, 3,
     _skipped(f"its history segment {segments.name(6)} does not match its checksum "
              f"(damaged)")),
    ("write_not_committed", _delete(f"ckpt-6{checkpoints.MANIFEST}"), 3,
     _skipped(f"it has no ckpt-6{checkpoints.MANIFEST}: its write did not finish (or an "
              f"older launch.train wrote it)")),
    ("newest_deleted_by_hand", _delete(runs.DATA, "ckpt-6.index", f"ckpt-6{checkpoints.MANIFEST}"),
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
    ("history_json_deleted", lambda d: (d.parent / "history.json").unlink(missing_ok=True), 6,
     []),
    ("temporary_files_left", _leftovers, 6, []),
    ("lock_left_by_a_killed_run", _stale_lock, 6,
     ["launch.train: warning: taking over --model_dir={dir} from a run that ended without "
      "releasing it (pid 999999999 on elsewhere, since 2025-01-01T00:00:00)."]),
]


# The default suite runs one damage of each kind of file (CI's slow step runs all).
DEFAULT_RESUMES = ("intact", "data_byte_flipped", "index_emptied", "manifest_truncated",
                   "history_segment_changed", "state_file_garbled", "write_not_committed",
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
    manifest = runs.manifest(model_dir, 6)
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
    logs = runs.EpochLogs()
    result = train_lib.train(runs.config(model_dir, resume=True), callbacks=[logs])
    captured = capsys.readouterr()

    damaged_name = next((n for n in sizes if n in "".join(expected)), runs.DATA)
    half = sizes[damaged_name] // 2
    assert runs.warnings(captured) == [
        line.format(ckpt=ckpt, dir=model_dir, size=sizes[damaged_name], half=half,
                    json_error=json_error) for line in expected]
    assert f"Resuming from {ckpt}/ckpt-{resumed_from} (step {resumed_from})." in captured.out
    assert result["start_step"] == resumed_from and result["steps"] == 10
    runs.assert_same_as_reference(model_dir, result, logs, reference, first_epoch=1 if
                              resumed_from >= 5 else 0)
    skipped = sorted(os.listdir(ckpt / "skipped")) if (ckpt / "skipped").exists() else []
    assert skipped == (left_of_6 if any("moved the files" in e for e in expected) else [])
    assert [n for n in os.listdir(ckpt) + os.listdir(model_dir) if n.endswith(".tmp")
            or ".tmp-" in n] == ([".notes.tmp"] if damage is _leftovers else [])
    assert runs.committed(model_dir) == [6, 9, 10] and \
        tf.train.latest_checkpoint(str(ckpt)) == str(ckpt / "ckpt-10")
    assert (model_dir / run_lock.LOCK_FILE).read_text() == ""  # released


# -- resumes that are refused, and change nothing --------------------------------------


def _refusal_for_nothing_intact(ckpt):
    return (f"--resume: no checkpoint in {ckpt} is intact, so there is nothing to resume "
            f"from (ckpt-6: {runs.DATA} has {{half6}} bytes, {{size6}} expected (truncated); "
            f"ckpt-3: it has no ckpt-3{checkpoints.MANIFEST}: its write did not finish (or "
            f"an older launch.train wrote it)). Nothing was changed. Start afresh with "
            f"--overwrite instead of --resume, or pass another --model_dir.")


REFUSALS = [
    ("nothing_intact",
     lambda d: (_truncate(runs.DATA)(d), _delete(f"ckpt-3{checkpoints.MANIFEST}")(d)), {},
     _refusal_for_nothing_intact),
    ("other_settings", None, {"batch_size": 16, "microbatches": 4},
     lambda ckpt: (f"--resume: {ckpt.parent} holds a run with other settings (batch_size: "
                   f"32 then, 16 now; microbatches: 2 then, 4 now). Use the same settings, or "
                   f"another --model_dir without --resume.")),
    ("other_stages_without_reshard", None, {"stages": 4},
     lambda ckpt: (f"--resume: {ckpt.parent} holds a run with other settings (stages: 2 "
                   f"then, 4 now). Use the same settings (or add --reshard to continue at the "
                   f"new stages: the run then follows them from here), or another --model_dir "
                   f"without --resume.")),
    # M changes the computation (BatchNorm statistics, summation order): recorded
    # with the run, and refused without --reshard.
    ("other_microbatches_without_reshard", None, {"microbatches": 4, "schedule": "1f1b"},
     lambda ckpt: (f"--resume: {ckpt.parent} holds a run with other settings (microbatches: "
                   f"2 then, 4 now; schedule: 'auto' then, '1f1b' now). Use the same settings "
                   f"(or add --reshard to continue at the new microbatches, schedule: the run "
                   f"then follows them from here), or another --model_dir without --resume.")),
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
    ("other_seed_after_fallback", _truncate(runs.DATA), {"seed": 1},
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
    size6 = runs.manifest(model_dir, 6)["files"][runs.DATA]["size"]
    if damage is not None:
        damage(ckpt)
    before = runs.tree(model_dir)
    with pytest.raises(errors.RunError) as err:
        train_lib.train(runs.config(model_dir, resume=True, **changes))
    assert str(err.value) == message(ckpt).format(half6=size6 // 2, size6=size6)
    assert err.value.exit_code == 1
    assert runs.tree(model_dir) == before


@pytest.mark.parametrize("stages, schedule", [(1, "gpipe"), (4, "1f1b")])
def test_reshard_resumes_at_another_stage_count_like_the_uninterrupted_run(
        tmp_path, capsys, reference, cut_run, stages, schedule):
    """Written at 2 stages, resumed at 1 or 4 (--reshard): the same run."""
    model_dir = tmp_path / "run"
    shutil.copytree(cut_run, model_dir)
    result = train_lib.train(runs.config(model_dir, resume=True, reshard=True, stages=stages,
                                     schedule=schedule))
    out = capsys.readouterr().out
    assert f"Resuming from {model_dir / 'checkpoints'}/ckpt-6 (step 6)." in out
    then, now = {"stages": 2}, {"stages": stages}
    if schedule != "auto":  # the settings that changed, each named (written at auto)
        then["schedule"], now["schedule"] = "auto", schedule
    assert f"--reshard: checkpoint written at {then}, continuing at {now}." in out
    assert len(result["model"].stages) == stages
    for ours, theirs in zip(runs.weights(result["model"]), reference["weights"], strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    history = runs.manifest(model_dir, 10)["history"]
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
    logs = runs.EpochLogs()
    result = train_lib.train(runs.config(tmp_path, resume=True), callbacks=[logs])
    captured = capsys.readouterr()
    assert runs.warnings(captured) == [line.format(ckpt=ckpt) for line in expected]
    assert f"--resume: no checkpoint in {ckpt}; starting from step 0." in captured.out
    assert result["start_step"] == 0
    runs.assert_same_as_reference(tmp_path, result, logs, reference, first_epoch=0)


def test_resume_of_a_finished_run_trains_nothing_and_says_so(tmp_path, capsys, reference):
    shutil.copytree(reference["dir"], tmp_path / "run")
    config = runs.config(tmp_path / "run", resume=True)
    result = train_lib.train(config)
    out = capsys.readouterr().out
    assert "The run had finished: step 10 of 10 (--epochs=2 x 5 steps); nothing to train." in out
    assert result["start_step"] == result["steps"] == 10 and result["step_time_ms"] is None
    summary = train_lib.format_summary(config, result)
    assert "mean step time        - (no step ran in this process)" in summary
    assert "nan" not in summary
    assert result["history"] == reference["history"]
    assert runs.committed(tmp_path / "run") == [6, 9, 10]


# -- divergence -------------------------------------------------------------------------


_NONE_LEFT = (
    "training diverged: the training loss is nan at step 2. Stopped there; nothing "
    "non-finite was saved. No checkpoint from before the loss climbed is left (the next step "
    "after each one saved was already non-finite, or none was saved). The 1 checkpoint(s) "
    "saved in the run (ckpt-1), whose weights led there, were set aside in {ckpt}/skipped. "
    "Start again with a lower learning rate: --overwrite --learning_rate=1e+08.")


def test_non_finite_loss_stops_the_run_and_keeps_the_last_finite_checkpoint(tmp_path):
    """Diverged from the first update: ckpt-1's weights are finite but already
    lead to a NaN, so it is set aside and the advice is a fresh start."""
    with pytest.raises(errors.Diverged) as err:
        train_lib.train(runs.config(tmp_path, learning_rate=1e9, checkpoint_every=1))
    ckpt = tmp_path / "checkpoints"
    assert str(err.value) == _NONE_LEFT.format(ckpt=ckpt)
    assert err.value.step == 2 and err.value.exit_code == 3
    assert runs.committed(tmp_path) == []
    for name, value in runs.checkpoint_tensors(str(ckpt / "skipped" / "ckpt-1")).items():
        if value.dtype.kind == "f":
            assert np.isfinite(value).all(), name
    assert [s["step"] for s in json.loads((tmp_path / "history.json").read_text())["steps"]] \
        == [1]


@pytest.mark.slow
def test_divergence_from_the_command_line_exits_3(tmp_path):
    proc = _child(["-m", "launch.train", f"--model_dir={tmp_path}", "--learning_rate=1e9",
                   "--checkpoint_every=1", *runs.FLAGS[:5], *runs.FLAGS[6:]])
    assert proc.returncode == 3
    assert proc.stderr.splitlines()[-1] == "launch.train: error: " + _NONE_LEFT.format(
        ckpt=tmp_path / "checkpoints")
    assert runs.committed(tmp_path) == []


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
    with pytest.raises(errors.Diverged) as err:
        train_lib.train(runs.config(tmp_path, checkpoint_every=1), callbacks=[poison])
    ckpt = tmp_path / "checkpoints"
    assert re.fullmatch(
        rf"training diverged: after step 3 2 variable\(s\) hold NaN or infinite values "
        rf"\({re.escape(', '.join(poison.names))}\), although the loss was finite\. Stopped "
        rf"there; nothing non-finite was saved\. The newest checkpoint from before the loss "
        rf"climbed is {ckpt}/ckpt-2 \(the loss was [0-9.]+ at step 3\); --resume continues "
        rf"from it\. Resume with a lower learning rate than the 0\.001 that failed: --resume "
        rf"--learning_rate=0\.0001\.", str(err.value)), str(err.value)
    assert err.value.step == 3 and runs.committed(tmp_path) == [1, 2]
    # The advice can be followed: the resume at the lower rate is accepted, runs
    # at it, and the history records from which step.
    result = train_lib.train(runs.config(tmp_path, checkpoint_every=1, resume=True,
                                         learning_rate=1e-4))
    assert result["start_step"] == 2 and result["steps"] == 10
    assert float(result["model"].optimizer.learning_rate.numpy()) == pytest.approx(1e-4)
    assert runs.manifest(tmp_path, 10)["history"]["changes"] == [
        {"step": 0, "learning_rate": 1e-3}, {"step": 2, "learning_rate": 1e-4}]


def test_the_divergence_advice_trains_past_the_failing_step(tmp_path):
    """5 steps at 1e-3, then a resume at 1e9 diverges at step 7: the advice
    names ckpt-5 (ckpt-6's weights led there: set aside) and the rate that
    trained it; following it trains past step 7 to the end, every loss finite."""
    train_lib.train(runs.config(tmp_path, checkpoint_every=1, epochs=1))
    with pytest.raises(errors.Diverged) as err:
        train_lib.train(runs.config(tmp_path, checkpoint_every=1, resume=True,
                                    learning_rate=1e9))
    ckpt = tmp_path / "checkpoints"
    assert err.value.step == 7
    assert re.search(rf"The newest checkpoint from before the loss climbed is {ckpt}/ckpt-5 "
                     rf"\(the loss was [0-9.]+ at step 6\); --resume continues from it\. The 1 "
                     rf"checkpoint\(s\) saved after it \(ckpt-6\), whose weights led there, "
                     rf"were set aside in {ckpt}/skipped\. Resume with a lower learning rate "
                     rf"than the 1e\+09 that failed: --resume --learning_rate=0\.001\.$",
                     str(err.value)), str(err.value)
    rate = float(str(err.value).rsplit("--learning_rate=", 1)[1].rstrip("."))
    result = train_lib.train(runs.config(tmp_path, checkpoint_every=1, resume=True,
                                         learning_rate=rate))
    assert result["start_step"] == 5 and result["steps"] == 10
    steps = runs.manifest(tmp_path, 10)["history"]["steps"]
    assert [s["step"] for s in steps] == list(range(1, 11))
    assert all(np.isfinite(s["loss"]) for s in steps)


# -- one run per --model_dir -----------------------------------------------------------


def test_a_second_run_on_a_busy_model_dir_stops_at_once(tmp_path):
    with run_lock.RunLock(tmp_path) as lock:
        holder = (tmp_path / run_lock.LOCK_FILE).read_text().strip()
        assert holder.startswith(f"pid {os.getpid()} on {socket.gethostname()}, since ")
        with pytest.raises(errors.ModelDirBusy) as err:
            train_lib.train(runs.config(tmp_path))
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
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=runs.REPO,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        holder = (tmp_path / run_lock.LOCK_FILE).read_text().strip()
        assert holder.startswith(f"pid {proc.pid} on ")
        with pytest.raises(errors.ModelDirBusy, match=f"kill {proc.pid}"):
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


def _child(args, timeout=runs.CHILD_TIMEOUT, env=None):
    """Runs `python ARGS` in the repository, in its own session; kills the group on overrun."""
    return helpers.run_child(args, timeout, env)


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
    # steps 3, 6, 9 and 10; each renames its history segment, data, index, manifest, state file.
    ("replace:ckpt-6.data-00000-of-00001:1", [3], []),  # TF's files under their temp name
    ("replace:ckpt-6.index:1", [3], _NOT_COMMITTED),  # the data file renamed, not the index
    ("replace:ckpt-6.manifest.json:1", [3], _NOT_COMMITTED),  # both renamed, no commit
    ("replace:checkpoint:2", [3, 6], []),  # committed; TF's state file still names ckpt-3
    ("replace:steps-0000000006.json:1", [3], []),  # ckpt-6's history segment, written first
    ("unlink:ckpt-3.index:1", [6, 9, 10], []),  # rotation after ckpt-10: ckpt-3 half deleted
]


def _kill_and_resume(tmp_path, capsys, reference, where, committed, expected):
    model_dir = tmp_path / "run"
    proc = _child(["-c", _MAIN_KILLED_AT, f"--model_dir={model_dir}", *runs.FLAGS],
                  env={"KILL_BEFORE": where})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    # TensorFlow started quietly (launch.train.quiet_start_up; test_packaging.py).
    assert [line for line in proc.stderr.splitlines()
            if "oneDNN" in line or "absl::InitializeLog" in line or "E0000" in line] == []
    assert runs.committed(model_dir) == committed
    capsys.readouterr()
    logs = runs.EpochLogs()
    result = train_lib.train(runs.config(model_dir, resume=True), callbacks=[logs])
    ckpt = model_dir / "checkpoints"
    warnings = runs.warnings(capsys.readouterr())
    assert warnings[0].startswith(
        f"launch.train: warning: taking over --model_dir={model_dir} from a run that ended "
        f"without releasing it (pid {proc.pid} on ")
    assert warnings[1:] == [line.format(ckpt=ckpt) for line in expected]
    assert result["start_step"] == committed[-1]
    runs.assert_same_as_reference(model_dir, result, logs, reference,
                              first_epoch=committed[-1] // 5)
    assert not [n for n in os.listdir(ckpt) if n.startswith(".")]
    assert runs.committed(model_dir) == [6, 9, 10]


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
            *runs.FLAGS[:5], *runs.FLAGS[6:]]

    def newest():
        return ([0] + runs.committed(model_dir) if (model_dir / "checkpoints").is_dir() else [0])[-1]

    killed_after = []
    for attempt in range(4):
        start_step = newest() if attempt else 0
        with open(tmp_path / f"stderr{attempt}", "w+") as err:
            proc = subprocess.Popen([sys.executable, *args, *(["--resume"] if attempt else [])],
                                    cwd=runs.REPO, stdout=subprocess.DEVNULL, stderr=err,
                                    text=True, start_new_session=True,
                                    env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
            try:
                deadline = time.monotonic() + runs.CHILD_TIMEOUT
                while attempt < 3 and proc.poll() is None and newest() == start_step:
                    assert time.monotonic() < deadline, "no checkpoint within the time limit"
                    time.sleep(0.005)
                if attempt < 3:
                    time.sleep(float(rng.uniform(0.0, 0.4)))
                if attempt < 3 and proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed_after.append(newest())
                proc.wait(timeout=runs.CHILD_TIMEOUT)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            err.seek(0)
            assert proc.returncode in (0, -signal.SIGKILL), err.read()[-3000:]
        if proc.returncode == 0:
            break
    assert killed_after and newest() == 10, killed_after
    ours = runs.checkpoint_tensors(str(model_dir / "checkpoints" / "ckpt-10"))
    theirs = runs.checkpoint_tensors(str(reference["dir"] / "checkpoints" / "ckpt-10"))
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert runs.manifest(model_dir, 10)["history"] == reference["manifest"]["history"]
