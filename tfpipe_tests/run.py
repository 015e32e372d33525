"""`python -m tfpipe_tests.run [--processes=N] [pytest arguments]`: the suite as N
pytest processes at once.

Process i runs `python -m pytest <arguments> --shard=i/N` (tfpipe_tests/sharding.py),
so together they run each selected test once. Many tests keep one core busy
(TensorFlow traces in Python), so on the 2-core machines CI runs on two processes
finish the same tests sooner than one (BUILD.md, Tests, has the measured times).

Each process writes its own log; they are printed in shard order when all are done,
each under a header with its exit status and minutes. The exit status is pytest's
for the whole run (`combined_status`). Interrupting or terminating the runner
(SIGINT, SIGTERM) kills every process it started, and theirs.

Plain `python -m pytest` runs the same tests in one process.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

DEFAULT_PROCESSES = 2  # the cores of the machines CI and the suite's timings ran on
NO_TESTS = 5  # pytest's exit status when it collected no test


def combined_status(codes):
    """The run's pytest exit status from its processes' statuses.

    A process that selected no test (5) is fine when another ran some: with
    more processes than tests some shards are empty. Otherwise the first
    failure (1 tests failed, 2 interrupted, 3 internal error, 4 usage error)
    is the run's, and 5 only when no process ran any test.
    """
    failures = [c for c in codes if c not in (0, NO_TESTS)]
    if failures:
        return failures[0]
    return 0 if 0 in codes else NO_TESTS


def parse_args(argv):
    """(processes, the pytest arguments); raises SystemExit(4) naming the fix
    for a bad --processes or a --shard of the caller's own."""
    parser = argparse.ArgumentParser(
        prog="python -m tfpipe_tests.run", add_help=False, allow_abbrev=False,
        description="Runs pytest as N processes at once, each on every N-th selected test.")
    parser.add_argument("--processes", default=str(DEFAULT_PROCESSES))
    known, rest = parser.parse_known_args(argv)
    try:
        processes = int(known.processes)
    except ValueError:
        processes = 0
    if processes < 1:
        _usage_error(f"--processes={known.processes!r}: expected a whole number of pytest "
                     f"processes >= 1, e.g. --processes={DEFAULT_PROCESSES}.")
    if any(a == "--shard" or a.startswith("--shard=") for a in rest):
        _usage_error("--shard: the runner gives each process its own --shard; run "
                     "`python -m pytest --shard=I/N` for one shard by hand.")
    return processes, rest


def _usage_error(message):
    print(f"ERROR: {message}", file=sys.stderr)
    raise SystemExit(4)  # pytest's usage error


def run(processes, pytest_args, out=sys.stdout):
    """Runs the shards at once; prints their logs; returns the combined status.

    If the runner is interrupted, the shards still running are killed (with
    their process groups) and the logs printed so far; then the interruption
    goes on.
    """
    logs = tempfile.mkdtemp(prefix="tfpipe_tests_run_")
    shards, finished, started = [], {}, time.monotonic()
    print(f"tfpipe_tests.run: {processes} pytest processes; their logs are in {logs} "
          "until all are done", file=out, flush=True)
    try:
        for i in range(processes):
            log = open(os.path.join(logs, f"shard_{i}.log"), "w+")
            command = [sys.executable, "-m", "pytest", *pytest_args, f"--shard={i}/{processes}"]
            # Each child leads its own process group, so stopping it stops
            # whatever it started (the suite's multi-process tests) too.
            shards.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True), log))
        while len(finished) < len(shards):
            for i, (child, _) in enumerate(shards):
                if i not in finished and child.poll() is not None:
                    finished[i] = (child.returncode, (time.monotonic() - started) / 60)
            time.sleep(0.5)
    finally:
        for child, _ in shards:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        for i, (_, log) in enumerate(shards):
            code, minutes = finished.get(i, ("killed", (time.monotonic() - started) / 60))
            log.seek(0)
            print(f"== shard {i}/{processes}: exit {code} after {minutes:.1f} min", file=out)
            text = log.read()
            out.write(text if text.endswith("\n") or not text else text + "\n")
            log.close()
            os.remove(log.name)
        os.rmdir(logs)
    codes = [finished[i][0] for i in range(processes)]
    status = combined_status(codes)
    print(f"== tfpipe_tests.run: exit {status} (shards: {codes}) in "
          f"{(time.monotonic() - started) / 60:.1f} min", file=out, flush=True)
    return status


def main(argv=None):
    processes, pytest_args = parse_args(sys.argv[1:] if argv is None else argv)
    # SIGTERM's default would end the runner without its cleanup and leave the
    # children (in their own sessions) running; as an exit, `run` kills them.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return run(processes, pytest_args)


if __name__ == "__main__":
    sys.exit(main())
