"""benchmarks/tpu_check.py: without a TPU it says so and exits 0; its `--cpu_dry_run`
traces the TPU programs and runs what must run on logical CPUs (real subprocesses)."""

import pytest

from tfpipe_tests import helpers


def _run(tmp_path, *flags):
    return helpers.run_device_check("benchmarks.tpu_check", tmp_path, *flags)


def test_without_a_tpu_it_says_so_and_exits_cleanly(tmp_path):
    proc, result = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tpu_check: not run: no TPU on this machine" in proc.stdout
    assert "--cpu_dry_run" in proc.stdout
    assert result["ran"] is False and "/dev/accel" in result["reason"]


@pytest.mark.slow
def test_cpu_dry_run_traces_programs_and_runs_exactness_and_speed(tmp_path):
    proc, result = _run(tmp_path, "--cpu_dry_run", "--repeats=1", "--steps=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["ran"] is True and result["device_kind"].startswith("CPU dry run")
    assert [(r["stages"], r["schedule"], r["execution"]) for r in result["exactness"]] == [
        (2, "gpipe", "unrolled"), (2, "1f1b", "unrolled"), (4, "gpipe", "loop"),
        (4, "1f1b", "unrolled")]
    assert all(r["max_abs_diff"] < 1e-5 for r in result["exactness"])
    assert [(r["stages"], r["replicas"], r["cores_per_replica"]) for r in result["program"]] \
        == [(2, 2, 2), (4, 1, 4)]
    assert all(r["placed"] is True and min(r["matmuls_per_core"]) > 0
               for r in result["program"])
    assert [r["core"] for r in result["placement"]] == [f"TPU logical core {k}"
                                                        for k in range(4)]
    assert all(r["placed"] == "traced only" and r["slots"] == 2 * r["variables"]
               for r in result["placement"])
    assert [(r["stages"], r["microbatches"]) for r in result["speed"]] == [
        (k, m) for k in (1, 2, 4) for m in (1, 4, 8)]
    assert [round(r["ideal"], 3) for r in result["speed"]][3:6] == [1.0, 1.6, 1.778]
    assert result["profile"].startswith("traced only")
