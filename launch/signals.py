"""SIGTERM, SIGINT and SIGHUP end a run cleanly: the step finishes, a
checkpoint is saved, one line names it, and the process exits 128 + the
signal's number (143, 130, 129: what a shell reports for a process ended by
that signal, so schedulers that restart preempted jobs see one).

Preemptible VMs, cluster schedulers and TPU maintenance send SIGTERM with a
grace period; people press Ctrl-C (SIGINT); a closed terminal sends SIGHUP.
What the handler does depends on the phase of the run:

- while training (and validating, and saving), it only records the signal:
  the training loop looks at the request after each step
  (`launch.checkpoints.StopOnRequest`), so the save happens between steps,
  never inside one;
- in a phase that has nothing to save and may take long (start-up:
  TensorFlow's loading, data, the model, a restore; and the end of the run
  after its final save: the timeline and the plot), the block runs inside
  `interrupting()` and the handler raises `Interrupted` at once: the phase
  is abandoned, not awaited.

A second signal stops at once (`os._exit`), after the hooks given to
`on_hard_exit` (the run's lock is released) and one line on the terminal
(written to the real stderr even while TensorFlow's loading is captured):
the save commits with its manifest, written last, so the newest committed
checkpoint is intact either way (`launch.checkpoints`).

Pure Python: `launch.train` installs the handlers before TensorFlow starts.

With --replicas=tf_config every worker process checks after each step, by
one small all-reduce, whether any of them received a signal
(`launch.checkpoints.agreed_signal`): all stop after the same step, each
saving its own --model_dir, so they resume together.

Why not `tf.distribute.experimental.PreemptionCheckpointHandler` (what Keras'
`BackupAndRestore(save_before_preemption=True)` uses)? It saves through its
own `CheckpointManager`, whose files have no manifest and no history, and
its agreement runs on the coordination service of a multi-worker or TPU
strategy. Our single-client runs (one process, or the client of --cluster)
need no agreement: the signal reaches the one process that writes
checkpoints; the tf_config workers agree with the all-reduce above, inside
the step order Keras already runs.
"""

import contextlib
import os
import signal
import threading

from launch import quiet

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Interrupted(BaseException):
    """Raised by the handler inside `StopRequest.interrupting()` (a
    BaseException, like KeyboardInterrupt: no `except Exception` on the way
    swallows it)."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code(signum):
    """The exit code of a run stopped by `signum`: 128 + its number."""
    return 128 + int(signum)


class StopRequest:
    """Records the first of `SIGNALS` while installed (a context manager).

    Attributes:
      signum: the signal received, or None.
    """

    def __init__(self):
        self.signum = None
        self.by_another_worker = False  # set when a multi-worker run agreed on another's
        self.interruptible = False  # inside `interrupting()`
        self._hard_exit_hooks = []
        self._previous = {}

    @property
    def name(self):
        if self.signum is None:
            return None
        name = signal.Signals(self.signum).name
        return f"{name} (to another worker)" if self.by_another_worker else name

    def on_hard_exit(self, hook):
        """Runs `hook()` (e.g. releasing the run's lock) before a second
        signal ends the process at once."""
        self._hard_exit_hooks.append(hook)

    def run_hard_exit_hooks(self):
        """Runs the `on_hard_exit` hooks (the process is about to `os._exit`)."""
        for hook in self._hard_exit_hooks:
            try:
                hook()
            except Exception:  # pylint: disable=broad-except
                pass  # exiting either way: the kernel drops the flock

    @contextlib.contextmanager
    def interrupting(self):
        """Inside the block a signal raises `Interrupted` at once (raised at
        the block's start if one came before)."""
        previous, self.interruptible = self.interruptible, True
        try:
            if self.signum is not None:
                raise Interrupted(self.signum)
            yield
        finally:
            self.interruptible = previous

    def _handle(self, signum, frame):  # pylint: disable=unused-argument
        name = signal.Signals(signum).name
        if self.signum is not None:
            self.run_hard_exit_hooks()
            say(f"launch.train: {name} again: stopping now, without saving; the newest "
                f"committed checkpoint is intact (--resume continues from it).")
            os._exit(exit_code(signum))  # pylint: disable=protected-access
        self.signum = signum
        if self.interruptible:
            self.interruptible = False  # the stop itself is not interrupted again
            raise Interrupted(signum)
        say(f"launch.train: {name}: finishing this step, then saving a checkpoint (send it "
            f"again to stop at once).")

    def install(self):
        """Makes the handlers current; again after TensorFlow set its own (a
        multi-worker strategy's coordination service takes SIGTERM)."""
        # Signal handlers can only be set from the main thread; elsewhere (a
        # test runner's thread) the default handling stays.
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                previous = signal.signal(signum, self._handle)
                self._previous.setdefault(signum, previous)

    def __enter__(self):
        self.install()
        return self

    def __exit__(self, *exc):
        if self.signum is not None:
            return  # stopping: a later signal still ends the process at once, with its line
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


def ignore_while_exiting():
    """Ignores `SIGNALS` from now on, for a run that has stopped and only
    exits: Python's own exit sets the handlers back to the default, so a
    second signal landing there would kill the process (status -N) instead of
    letting it exit 128 + N. An ignored handler is left alone by that exit."""
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)


def say(line):
    """Writes `line` to the user's stderr at once, from a signal handler too."""
    data = (line + "\n").encode()
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(quiet.stderr_fd(), data):]
