"""How the suite is split: N pytest processes at once (`--shard=I/N`,
tfpipe_tests/sharding.py; the runner `python -m tfpipe_tests.run`,
tfpipe_tests/run.py) and the rows of a table the default suite runs
(`helpers.taking_turns`, `helpers.in_default_suite`).

Each `--shard` case runs a real pytest child on a small generated suite, with only the sharding
plugin loaded (no TensorFlow, ~1 s): which tests each shard runs, and the error text
of a bad value.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tfpipe_tests import helpers
from tfpipe_tests import run as run_lib

REPO = pathlib.Path(__file__).resolve().parents[1]

# Six tests in collection order; t1 and t4 are marked slow.
SUITE = """
import pytest

def test_t0(): pass

@pytest.mark.slow
def test_t1(): pass

@pytest.mark.parametrize("row", ["a", "b"])
def test_t2(row): pass

@pytest.mark.slow
def test_t4(): pass

def test_t5(): pass
"""
ALL = ["test_t0", "test_t1", "test_t2[a]", "test_t2[b]", "test_t4", "test_t5"]


def _write_suite(tmp_path, suite=SUITE):
    (tmp_path / "test_suite.py").write_text(suite)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: heavy\n")


def _pytest(tmp_path, *args):
    _write_suite(tmp_path)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tfpipe_tests.sharding", "-p",
         "no:cacheprovider", "-v", *args, str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=120, check=False)


def _passed(proc):
    return [line.split("::")[1].split(" ")[0] for line in proc.stdout.splitlines()
            if " PASSED" in line]


@pytest.mark.parametrize("args,expected", [
    ((), ALL),
    (("--shard=0/1",), ALL),
    (("--shard=0/2",), ["test_t0", "test_t2[a]", "test_t4"]),
    (("--shard=1/2",), ["test_t1", "test_t2[b]", "test_t5"]),
    (("--shard=2/3",), ["test_t2[a]", "test_t5"]),
    # The deal is over what -m selected: the two slow tests go one to each shard.
    (("-m", "slow", "--shard=0/2"), ["test_t1"]),
    (("-m", "slow", "--shard=1/2"), ["test_t4"]),
    (("-m", "not slow", "--shard=1/2"), ["test_t2[a]", "test_t5"]),
    # More shards than tests: the extra shard runs none (pytest's exit 5).
    (("-m", "slow", "--shard=2/3"), []),
], ids=lambda v: " ".join(v) if isinstance(v, tuple) else None)
def test_each_shard_runs_every_nth_selected_test(tmp_path, args, expected):
    proc = _pytest(tmp_path, *args)
    assert proc.returncode == (0 if expected else 5), proc.stdout + proc.stderr
    assert _passed(proc) == expected


@pytest.mark.parametrize("count", [2, 3])
def test_the_shards_together_run_each_selected_test_once(tmp_path, count):
    runs = [_passed(_pytest(tmp_path, f"--shard={i}/{count}")) for i in range(count)]
    assert sorted(sum(runs, [])) == sorted(ALL)


@pytest.mark.parametrize("value", ["2/2", "1", "a/b", "-1/2", "0/0", "1/2/3"])
def test_a_bad_shard_stops_before_any_test_and_names_the_fix(tmp_path, value):
    proc = _pytest(tmp_path, f"--shard={value}")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert (f"--shard={value!r}: expected I/N with 0 <= I < N (this process's shard, "
            "counted from 0, of N), e.g. --shard=0/2 and --shard=1/2 for two processes."
            ) in proc.stderr
    assert _passed(proc) == []


# -- the runner: N pytest processes at once (tfpipe_tests/run.py) ------------------------

def _runner(tmp_path, *args, suite=SUITE, **popen):
    """`python -m tfpipe_tests.run <args>` on `suite`: the finished process, or
    with `popen` keyword arguments the running one."""
    _write_suite(tmp_path, suite)
    command = [sys.executable, "-m", "tfpipe_tests.run", *args, "-p", "tfpipe_tests.sharding",
               "-p", "no:cacheprovider", "-v", str(tmp_path)]
    if popen:
        return subprocess.Popen(command, cwd=tmp_path, **popen)
    return subprocess.run(command, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("args, expected", [
    ((), ALL),
    (("--processes=1",), ALL),
    (("--processes=3",), ALL),
    (("-m", "slow"), ["test_t1", "test_t4"]),
    # More processes than tests: the empty shards' exit 5 is not the run's.
    (("--processes=4", "-m", "slow"), ["test_t1", "test_t4"]),
], ids=lambda v: " ".join(v) or "default" if isinstance(v, tuple) else None)
def test_the_runner_runs_each_selected_test_once(tmp_path, args, expected):
    proc = _runner(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(_passed(proc)) == sorted(expected)
    processes = int(args[0].split("=")[1]) if args and "processes" in args[0] else 2
    assert [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("== shard")
            ] == [f"== shard {i}/{processes}" for i in range(processes)]


@pytest.mark.parametrize("codes, status", [
    ([0, 0], 0),
    ([0, 5], 0),     # an empty shard beside one that ran tests
    ([5, 5], 5),     # no test anywhere
    ([0, 1], 1),     # a failure in any shard fails the run
    ([5, 1], 1),
    ([4, 0], 4),     # the first failure is the run's
    ([2, 1], 2),
])
def test_combined_status(codes, status):
    assert run_lib.combined_status(codes) == status


def test_the_runner_fails_when_one_shard_fails_and_prints_its_log(tmp_path):
    proc = _runner(tmp_path, suite=SUITE + "\ndef test_t6(): assert 1 == 2, 'the failure'\n")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the failure" in proc.stdout
    assert "== tfpipe_tests.run: exit 1 (shards: [1, 0])" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (("--processes=0",), "--processes='0': expected a whole number of pytest processes >= 1, "
                         "e.g. --processes=2."),
    (("--processes=two",), "--processes='two': expected a whole number of pytest processes "
                           ">= 1, e.g. --processes=2."),
    (("--shard=0/2",), "--shard: the runner gives each process its own --shard; run "
                       "`python -m pytest --shard=I/N` for one shard by hand."),
])
def test_the_runner_refuses_bad_arguments_naming_the_fix(tmp_path, args, message):
    proc = _runner(tmp_path, *args)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert f"ERROR: {message}" in proc.stderr
    assert _passed(proc) == []


def test_terminating_the_runner_leaves_no_test_process_behind(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    suite = ("import os, pathlib, time\n"
             "def test_waits():\n"
             f"    pathlib.Path({str(pids)!r}, str(os.getpid())).touch()\n"
             "    time.sleep(120)\n")
    logs = tmp_path / "logs"  # the runner's temporary folder
    logs.mkdir()
    runner = _runner(tmp_path, suite=suite, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     text=True, env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(logs)})
    children = []
    try:
        deadline = time.monotonic() + 60
        while not list(pids.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.1)
        (child,) = children = [int(p.name) for p in pids.iterdir()]
        runner.terminate()
        output = runner.communicate(timeout=30)[0]
        assert runner.returncode == 128 + signal.SIGTERM, output
        # What the shards wrote before they were killed is printed, and removed.
        assert "== shard 0/2: exit killed after" in output
        assert "test_suite.py::test_waits" in output
        # Each header starts a line, though the killed shard's log ended
        # mid-line. (Shard 1 has no test: exit 5, or killed if it had not
        # finished by then.)
        assert "\n== shard 1/2: exit " in output
        assert list(logs.iterdir()) == []
        deadline = time.monotonic() + 10
        while helpers.process_alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not helpers.process_alive(child)
    finally:
        runner.kill()
        runner.wait()
        for pid in children:  # only if the runner left it
            if helpers.process_alive(pid):
                os.kill(pid, signal.SIGKILL)


# -- which rows of a table the default suite runs (helpers) -----------------------------

SCHEDULE_NAMES = ["gpipe", "1f1b", "zbv"]
RUN_PAIRS = [("unrolled", "always"), ("loop", "always")]


def _rows(params):
    """[(values, slow?)] of pytest params."""
    return [(p.values, any(m.name == "slow" for m in p.marks)) for p in params]


@pytest.mark.parametrize("first, second, default", [
    # More schedules than runs: each schedule once, the runs taking turns.
    (SCHEDULE_NAMES, RUN_PAIRS, [("gpipe", "unrolled", "always"), ("1f1b", "loop", "always"),
                                 ("zbv", "unrolled", "always")]),
    # More of the second axis: each of it once, the first taking turns.
    ([16, 14], ["a", "b", "c"], [(16, "a"), (14, "b"), (16, "c")]),
    ([1], ["a"], [(1, "a")]),
])
def test_taking_turns_runs_every_value_of_both_axes_by_default_and_the_product_slow(
        first, second, default):
    rows = _rows(helpers.taking_turns(first, second))
    assert len(rows) == len(first) * len(second)
    assert [values for values, slow in rows if not slow] == [
        values for values, _ in rows if values in default]
    assert sorted(values for values, slow in rows if not slow) == sorted(default)


def test_taking_turns_ids_join_the_given_ids():
    params = helpers.taking_turns([16, 14], [dict(a=1), dict(a=2)], second_ids=["one", "two"])
    assert [p.id for p in params] == ["16-one", "16-two", "14-one", "14-two"]


@pytest.mark.parametrize("default, expected", [
    (["zbv"], [(("gpipe",), True), (("1f1b",), True), (("zbv",), False)]),
    (SCHEDULE_NAMES, [(("gpipe",), False), (("1f1b",), False), (("zbv",), False)]),
])
def test_in_default_suite_marks_the_other_rows_slow(default, expected):
    assert _rows(helpers.in_default_suite(SCHEDULE_NAMES, default)) == expected


def test_in_default_suite_refuses_a_default_row_that_is_not_in_the_table():
    with pytest.raises(ValueError, match=r"default rows \['zbh1'\] are not in the table"):
        helpers.in_default_suite(SCHEDULE_NAMES, ["zbh1"])
