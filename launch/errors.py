"""How a `launch.train` run ends when it does not finish: one error class per
exit code, each with a message that says why and what to do.

Exit codes of `python -m launch.train` (the `exit_code` of each error class):

- 1: bad input: a flag (absl's parser), a setting, a data set, or a
  `--resume` with nothing usable to resume from (`RunError`);
- 2: `--model_dir` is in use by another run (`ModelDirBusy`);
- 3: training diverged: a non-finite loss or non-finite weights (`Diverged`);
- 4: a worker of --cluster was lost: it froze (`--step_timeout`'s
  `tfpipe.StepWatchdog` ends the process) or died (`WorkerLost`);
- 128 + N: stopped by signal N (SIGTERM 143, SIGINT 130, SIGHUP 129) after
  saving a checkpoint (`Stopped`; `launch.signals`).
"""


class RunError(ValueError):
    """A run that cannot start or go on, with a message that says why and what to do."""

    exit_code = 1
    label = "error"  # launch.train prints "launch.train: <label>: <message>"


class ModelDirBusy(RunError):
    """Another process holds the lock on --model_dir."""

    exit_code = 2


class Diverged(RunError):
    """The loss (or a weight) became non-finite; nothing non-finite was saved."""

    exit_code = 3

    def __init__(self, message, step):
        super().__init__(message)
        self.step = step


class WorkerLost(RunError):
    """A worker of --cluster died mid-run (TensorFlow's UnavailableError)."""

    exit_code = 4  # tfpipe.watchdog.EXIT_CODE: a frozen worker ends the run with it too


class Stopped(RunError):
    """The run stopped on a signal after saving a checkpoint; `--resume` continues it."""

    label = "stopped"

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code
