"""`benchmarks/multiprocess.py`: remote vs local step time, as a user runs it.

The smoke run (`--quick`: a tiny MLP, a few steps) is the real program in a
subprocess: two children (a `LocalCluster(2)` client and a 2-logical-CPU
process) that take turns. The test reads the JSON it writes and checks with
`ps` that none of its processes (children, workers) is left. Its timings are
not checked against a goal: the machine is shared, and the tiny model is
dominated by the fixed per-step cost of TensorFlow's RPCs.

The flag checks run the same program with a bad flag; they stop before any
TensorFlow import, so they stay in the default suite.
"""

import json
import pathlib
import subprocess

import pytest

from tfpipe_tests import helpers

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 150  # the quick run takes 30-40 s on 2 shared cores


def _run(*flags, timeout=TIMEOUT_S):
    """`python -m benchmarks.multiprocess *flags` in its own session (killed
    as a group if it overruns); returns the CompletedProcess."""
    try:
        return helpers.run_child(["-m", "benchmarks.multiprocess", *flags], timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"benchmarks.multiprocess overran {timeout} s")


def _running(pids):
    """Those of `pids` that `ps` lists as running (zombies count as gone)."""
    listed = subprocess.run(["ps", "-eo", "pid=,stat="], capture_output=True, text=True,
                            timeout=30, check=True).stdout
    states = dict(line.split(None, 1) for line in listed.strip().splitlines())
    return [p for p in pids if str(p) in states and not states[str(p)].startswith("Z")]


@pytest.mark.parametrize("flag, message", [
    ("--layers=3", "--layers must be even and >= 2 (2 equal stages), got 3."),
    ("--layers=0", "--layers must be even and >= 2 (2 equal stages), got 0."),
    ("--steps=0", "--steps, --repeats and --warmup must be >= 1."),
    ("--warmup=0", "--steps, --repeats and --warmup must be >= 1."),
    ("--microbatches=1,0", "--microbatches must list counts >= 1, got '1,0'."),
])
def test_bad_flags_stop_before_any_process(flag, message, tmp_path):
    done = _run(flag, f"--out={tmp_path / 'm.json'}", timeout=60)
    assert done.returncode != 0
    assert message in done.stderr
    assert not (tmp_path / "m.json").exists()


@pytest.mark.slow
def test_quick_run_writes_both_timings_and_leaves_no_process(tmp_path):
    out = tmp_path / "multiprocess.json"
    done = _run("--quick", f"--out={out}", "--timeout_s=120", "--time_limit_s=300")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [row["microbatches"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["local_step_ms"] > 0 and row["remote_step_ms"] > 0
        assert row["ratio"] == pytest.approx(row["remote_step_ms"] / row["local_step_ms"])
        assert len(row["runs_ms"]["local"]) == len(row["runs_ms"]["remote"]) == 2
        # Same model, data and seed on both sides: the same training.
        assert row["last_loss"]["remote"] == pytest.approx(row["last_loss"]["local"],
                                                           rel=1e-5)
        cpu = row["cpu_ms_per_step"]
        assert set(cpu["local"]) == {"process"}
        assert set(cpu["remote"]) == {"client", "task0", "task1"}
        ops = row["client_ops"]
        assert 0 < ops["client"] < ops["total"]
        assert sum(ops["client_by_type"].values()) == ops["client"]
    assert result["devices"] == {
        "local": ["/device:CPU:0", "/device:CPU:1"],
        "remote": ["/job:worker/replica:0/task:0/device:CPU:0",
                   "/job:worker/replica:0/task:1/device:CPU:0"]}
    assert "| M | local step" in out.with_suffix(".md").read_text()
    # Nothing left: the benchmark's own check, then ps.
    pids = result["worker_pids"] + list(result["child_pids"].values())
    assert len(result["worker_pids"]) == 2
    assert result["workers_left"] == []
    assert _running(pids) == []
