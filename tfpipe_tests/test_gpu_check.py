"""benchmarks/gpu_check.py: without a GPU it says so and exits 0; its
`--cpu_dry_run` runs every check on logical CPUs (real subprocesses)."""

import pytest

from tfpipe_tests import conftest
from tfpipe_tests import helpers


def _run(tmp_path, *flags):
    return helpers.run_device_check("benchmarks.gpu_check", tmp_path, *flags,
                                    env={"CUDA_VISIBLE_DEVICES": ""})


def test_without_a_gpu_it_says_so_and_exits_cleanly(tmp_path):
    proc, result = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "gpu_check: not run: CUDA_VISIBLE_DEVICES hides every GPU" in proc.stdout
    assert "--cpu_dry_run" in proc.stdout
    assert result["ran"] is False and "CUDA_VISIBLE_DEVICES" in result["reason"]


@pytest.mark.slow
def test_cpu_dry_run_checks_exactness_placement_speedup_and_memory(tmp_path):
    proc, result = _run(tmp_path, "--cpu_dry_run", "--repeats=2", "--steps=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["ran"] is True and result["device_kind"] == "CPU"
    assert len(result["devices"]) == conftest.NUM_DEVICES
    assert [(r["stages"], r["schedule"]) for r in result["exactness"]] == [
        (2, "gpipe"), (2, "1f1b"), (4, "gpipe"), (4, "1f1b")]
    assert all(r["max_abs_diff"] < 1e-5 for r in result["exactness"])
    assert [r["device"][-5:] for r in result["placement"]] == ["CPU:0", "CPU:1", "CPU:2",
                                                               "CPU:3"]
    assert all(r["placed"] and r["slots"] == 2 * r["variables"] for r in result["placement"])
    assert [r["microbatches"] for r in result["speedup"]] == [1, 4, 8]
    assert [round(r["ideal"], 3) for r in result["speedup"]] == [1.0, 1.6, 1.778]  # simulated
    assert all(r["step_ms"] > 0 for r in result["speedup"])
    assert [(r["model"], r["xla"]) for r in result["xla"]] == [
        ("plain Keras", "off"), ("plain Keras", "whole step"), ("tfpipe K=2", "off"),
        ("tfpipe K=2", "per stage")]
    assert all(r["step_ms"] > 0 for r in result["xla"])
    assert result["xla"][3]["max_abs_diff"] < 1e-5  # per-stage XLA against plain Keras
    assert [r["recompute"] for r in result["memory"]] == ["never", "except_last", "always",
                                                          "default: never"]
    assert "host memory" in result["memory"][-1]["reason"]  # CPUs: the host's
    assert [(r["microbatches"], r["recompute"]) for r in result["transformer"]] == [
        (4, "never"), (8, "never")]
    assert all(r["first_call_s"] > 0 and r["speedup"] > 0 for r in result["transformer"])
    assert all(r["peak_mib"] == [None, None] for r in result["memory"])  # CPUs report none
    assert "exactness (max abs dw vs plain Keras, M=4):\n| K | schedule |" in proc.stdout
