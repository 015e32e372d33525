"""TensorFlow starting quietly: its C++ start-up messages filtered by the log level.

`launch.train` and `launch.plan` import TensorFlow inside `quiet_start_up()`.
"""

import contextlib
import os
import re
import sys
import tempfile


# -- TensorFlow's start-up ------------------------------------------------------
#
# TF_CPP_MIN_LOG_LEVEL filters TensorFlow's C++ log once absl logging is set up.
# What its shared libraries log while they load comes before that: absl writes it
# to stderr whatever the level, after a notice ("WARNING: All log messages before
# absl::InitializeLog() is called are written to STDERR"). `import tensorflow`
# prints the oneDNN banner ("I0000 ... port.cc:153] oneDNN custom operations are
# on ...") twice that way: port.cc is linked into _pywrap_cpu_feature_guard's
# library and again into _pywrap_profiler_plugin, and each copy logs on loading.

_ABSL_RECORD = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^\s\]]+:\d+\] ")
_ABSL_NOTICE = ("WARNING: All log messages before absl::InitializeLog() is called are "
                "written to STDERR")
_SEVERITIES = "IWEF"  # absl's record prefixes, by TF_CPP_MIN_LOG_LEVEL's numbers


def min_log_level():
    """TF_CPP_MIN_LOG_LEVEL as TensorFlow reads it: 0 if unset or not a number."""
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0


def filter_start_up_log(text, level):
    """What TF_CPP_MIN_LOG_LEVEL=`level` lets through of `text`, the stderr of
    TensorFlow's loading.

    absl records (`I0000 00:00:1796305424.900836   26955 port.cc:153] ...`)
    of a severity below `level` are dropped (FATAL never is), and absl's
    notice with them if no record is left. Every other line (Python warnings,
    tracebacks, TensorFlow's own `2025-...: E ...` records, which already
    honour the level) is kept, in order.
    """
    kept, records = [], 0
    for line in text.splitlines(keepends=True):
        if _ABSL_RECORD.match(line):
            if _SEVERITIES.index(line[0]) < min(level, 3):
                continue
            records += 1
        kept.append(line)
    if not records:
        kept = [line for line in kept if line.rstrip("\n") != _ABSL_NOTICE]
    return "".join(kept)


_REAL_STDERR = []  # the terminal's descriptor while fd 2 is captured


def stderr_fd():
    """The descriptor that reaches the user's stderr now: fd 2, or the one
    `quiet_start_up` saved while it captures fd 2 (a message written from a
    signal handler during TensorFlow's loading must not be filtered away)."""
    return _REAL_STDERR[-1] if _REAL_STDERR else 2


@contextlib.contextmanager
def quiet_start_up():
    """Runs the block, the first import of TensorFlow, with file descriptor 2
    (where C++ writes) captured, then writes what `filter_start_up_log` keeps of
    it to stderr. A no-op if TensorFlow is loaded already or the level is 0."""
    level = min_log_level()
    if level <= 0 or "tensorflow" in sys.modules:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        _REAL_STDERR.append(saved)
        try:
            yield
        finally:  # also on an ImportError: its causes may be in what was captured
            sys.stderr.flush()
            _REAL_STDERR.pop()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            sys.stderr.write(filter_start_up_log(captured.read().decode(errors="replace"),
                                                 level))
            sys.stderr.flush()
