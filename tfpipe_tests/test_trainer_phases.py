"""A signal stops launch.train promptly in every phase of a run, and a run
that stops leaves its lock released.

Real `python -m launch.train` processes send themselves the signal at the
start of a phase (`_MAIN_SIGNALLED_IN`): TensorFlow's loading, a validation
pass, the final save (inside its manifest's commit), the timeline and the
loss plot. Each row asserts the exit code, the one line, the committed
checkpoints, an empty (released) lock file, and the delay from the signal
to the process's end: the bounds README's *Stopping* states.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from launch import run_lock
from tfpipe_tests import helpers
from tfpipe_tests import trainer_runs as runs

# `python -m launch.train ARGS` sending itself $SIGNAL at the start of the
# phase $PHASE, and writing when (time.time()) to $SIGNALLED.
_MAIN_SIGNALLED_IN = (
    "import contextlib, os, runpy, signal, sys, time\n"
    "phase, sig = os.environ['PHASE'], getattr(signal, os.environ['SIGNAL'])\n"
    "def send():\n"
    "    with open(os.environ['SIGNALLED'], 'w') as f:\n"
    "        f.write(repr(time.time()))\n"
    "    os.kill(os.getpid(), sig)\n"
    "from launch import quiet, history\n"
    "if phase == 'start_up':\n"
    "    real = quiet.quiet_start_up\n"
    "    @contextlib.contextmanager\n"
    "    def quiet_start_up():\n"
    "        with real():\n"
    "            send()\n"
    "            yield\n"
    "    quiet.quiet_start_up = quiet_start_up\n"
    "elif phase == 'start_up_wrapped':\n"
    "    real = quiet.quiet_start_up\n"
    "    @contextlib.contextmanager\n"
    "    def quiet_start_up():\n"
    "        with real():\n"
    "            try:\n"
    "                send()\n"
    "                time.sleep(30)\n"
    "            except BaseException as e:  # as a C extension's init turns it\n"
    "                raise SystemError('initialization of a module raised an "
    "unreported exception') from e\n"
    "            yield\n"
    "    quiet.quiet_start_up = quiet_start_up\n"
    "elif phase == 'validation':\n"
    "    def on_test_begin(self, logs=None):\n"
    "        if self.step == 5:\n"
    "            send()\n"
    "    history.StepRecorder.on_test_begin = on_test_begin\n"
    "elif phase == 'final_save':\n"
    "    real_replace = os.replace\n"
    "    def replace(src, dst, *args, **kwargs):\n"
    "        if os.path.basename(str(dst)) == 'ckpt-10.manifest.json':\n"
    "            send()\n"
    "        return real_replace(src, dst, *args, **kwargs)\n"
    "    os.replace = replace\n"
    "elif phase == 'timeline':\n"
    "    from tfpipe import timeline\n"
    "    real_step = timeline.record_step\n"
    "    def record_step(*args, **kwargs):\n"
    "        send()\n"
    "        time.sleep(30)  # a timeline that takes long: it is not awaited\n"
    "        return real_step(*args, **kwargs)\n"
    "    timeline.record_step = record_step\n"
    "elif phase == 'plot':\n"
    "    real_plot = history.RunHistory.plot_loss\n"
    "    def plot_loss(self, *args):\n"
    "        send()\n"
    "        time.sleep(30)\n"
    "        return real_plot(self, *args)\n"
    "    history.RunHistory.plot_loss = plot_loss\n"
    "sys.argv = ['launch.train'] + sys.argv[1:]\n"
    "runpy.run_module('launch.train', run_name='__main__', alter_sys=True)\n")

_BEFORE_FIRST = ("launch.train: stopped: {sig} before the first step: nothing was saved (a "
                 "checkpoint already in --model_dir is as it was).")
_AFTER_LAST = ("launch.train: stopped: {sig} after the run's last step (10): saved "
               "{ckpt}/ckpt-10; the run is complete, its timeline and loss plot were left out.")
_AFTER_STEP = ("launch.train: stopped: {sig} after step 5: saved {ckpt}/ckpt-5; --resume "
               "continues the run from there.")

# (phase, signal, exit code, committed checkpoints, last stderr line, the most
# seconds from the signal to the end: README, *Stopping*)
PHASES = [
    ("start_up", "SIGTERM", 143, None, _BEFORE_FIRST, 3.0),
    # The signal surfacing as another error (how CI once saw exit 1).
    ("start_up_wrapped", "SIGTERM", 143, None, _BEFORE_FIRST, 3.0),
    ("validation", "SIGINT", 130, [3, 5], _AFTER_STEP, 10.0),
    ("final_save", "SIGTERM", 143, [6, 9, 10], _AFTER_LAST, 3.0),
    ("timeline", "SIGHUP", 129, [6, 9, 10], _AFTER_LAST, 3.0),
    ("plot", "SIGTERM", 143, [6, 9, 10], _AFTER_LAST, 3.0),
]


@pytest.mark.parametrize("phase, sig, code, committed, line, bound", PHASES,
                         ids=[row[0] for row in PHASES])
def test_a_signal_stops_every_phase_promptly(tmp_path, phase, sig, code, committed, line,
                                            bound):
    model_dir = tmp_path / "run"
    signalled = tmp_path / "signalled"
    flags = [f for f in runs.FLAGS if f != "--notimeline"] if phase == "timeline" \
        else runs.FLAGS
    proc = helpers.run_child(["-c", _MAIN_SIGNALLED_IN, f"--model_dir={model_dir}", *flags],
                             runs.CHILD_TIMEOUT,
                             env={"PHASE": phase, "SIGNAL": sig, "SIGNALLED": str(signalled)})
    delay = time.time() - float(signalled.read_text())
    ckpt = model_dir / "checkpoints"
    assert proc.returncode == code, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == line.format(sig=sig, ckpt=ckpt)
    assert "Traceback" not in proc.stderr
    if committed is not None:
        assert runs.committed(model_dir) == committed
    else:
        assert not list(ckpt.glob("*.manifest.json"))
    assert (model_dir / run_lock.LOCK_FILE).read_text() == ""  # released
    assert delay < bound, f"{phase}: {delay:.1f} s from the signal to the end"
    if phase == "timeline":
        assert not list((model_dir / "timeline").glob("*.png"))  # abandoned


def test_two_signals_while_tensorflow_loads_exit_with_a_line_and_release_the_lock(tmp_path):
    """From outside, as a scheduler does: the first signal abandons the start-up,
    a second one a moment later exits at once; either way one line is printed
    and the lock file is left empty."""
    model_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.train", f"--model_dir={model_dir}", *runs.FLAGS],
        cwd=runs.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    try:
        lock = model_dir / run_lock.LOCK_FILE
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text()):  # the lock taken: TF loads next
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(0.3)  # inside `import tensorflow` (about 3 s here)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.05)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    lines = [l for l in err.splitlines() if l.startswith("launch.train:")]
    assert lines in ([_BEFORE_FIRST.format(sig="SIGTERM")],
                     ["launch.train: SIGTERM again: stopping now, without saving; the newest "
                      "committed checkpoint is intact (--resume continues from it)."]), err
    assert lock.read_text() == ""
    assert json.dumps(err).count("Traceback") == 0
