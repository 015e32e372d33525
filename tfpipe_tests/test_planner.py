"""`tfpipe.plan`: the numbers a user relies on before a run.

Counted figures (parameters, bytes, optimizer state) must equal the built
pipeline's; the bubble must be the simulator's; the recommendation must fit
the memory given; bad arguments must say what to fix. The memory prediction
is checked against peaks measured in real child processes (slow).
"""

import re
import subprocess
import sys

import keras
import numpy as np
import pytest

import tfpipe
from tfpipe import schedules
from tfpipe_tests.conftest import NUM_DEVICES

MIB = 2**20


def _mlp(depth=4, width=32):
    return keras.Sequential([keras.Input((16,))]
                            + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
                            + [keras.layers.Dense(4)])


def _skip_model():
    """A functional model with a skip connection across the middle."""
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", name="a")(inputs)
    b = keras.layers.Dense(16, activation="relu", name="b")(h)
    c = keras.layers.Dense(16, name="c")(b)
    out = keras.layers.Dense(3, name="head")(keras.layers.Add(name="add")([c, h]))
    return keras.Model(inputs, out)


def _bn_model():
    """Non-trainable variables (BatchNorm statistics) count as parameters."""
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                             keras.layers.BatchNormalization(), keras.layers.ReLU(),
                             keras.layers.Dense(2)])


def _built_stage_params(model, balance):
    """Parameters per stage of the built pipeline, as pipeline_summary counts them."""
    with tfpipe.PipelineStrategy(devices=[f"/CPU:{i}" for i in range(len(balance))]).scope():
        pipelined = tfpipe.PipelinedModel.from_model(model, balance=balance)
    seen, out = set(), []
    for stage in pipelined.stages:
        own = [v for v in stage.weights if id(v) not in seen]
        seen.update(id(v) for v in own)
        out.append(sum(int(np.prod(v.shape)) for v in own))
    return out


# (name, model factory, batch, M, K, schedule, recompute, optimizer, slots)
CONFIGS = [
    ("mlp_gpipe_adam", _mlp, 32, 4, 2, "gpipe", "except_last", "adam", 2),
    ("mlp_1f1b_sgd", _mlp, 32, 8, 4, "1f1b", "never", "sgd", 0),
    ("mlp_interleaved_momentum", lambda: _mlp(depth=7), 16, 4, 4, "interleaved",
     "always", "sgd+momentum", 1),
    ("skip_zbh1_rmsprop", _skip_model, 12, 3, 3, "zbh1", "always", "rmsprop", 1),
    ("batchnorm_gpipe_adam", _bn_model, 8, 2, 2, "gpipe", "never",
     keras.optimizers.Adam(amsgrad=True), 3),
]


@pytest.mark.parametrize("name,factory,batch,m,k,schedule,recompute,optimizer,slots",
                         CONFIGS, ids=[c[0] for c in CONFIGS])
def test_counts_match_the_built_pipeline_and_bubble_is_the_simulators(
        name, factory, batch, m, k, schedule, recompute, optimizer, slots):
    model = factory()
    plan = tfpipe.plan(model, batch, m, num_stages=k, schedule=schedule, recompute=recompute,
                       optimizer=optimizer, measure_time=False, recommend=False)
    assert [s.params for s in plan.stages] == _built_stage_params(model, plan.balance)
    assert plan.params == model.count_params()
    for s in plan.stages:
        assert s.param_bytes == 4 * s.params  # float32
        trainable = s.gradient_bytes
        assert trainable <= s.param_bytes
        assert s.optimizer_bytes == slots * trainable
        assert s.peak_bytes == (s.param_bytes + s.optimizer_bytes + s.gradient_bytes
                                + s.activation_bytes)
    devices = len(plan.devices)
    # Equal stages, each replayed micro-batch's forward priced in its backward.
    assert plan.bubble_fraction == schedules.simulate(schedule, m, devices,
                                                      recompute=recompute).bubble_fraction
    assert plan.microbatch_rows == -(-batch // m)
    assert max(plan.device_peak_bytes) <= plan.host_peak_bytes <= sum(plan.device_peak_bytes)
    assert plan.to_dict()["stages"][0]["params"] == plan.stages[0].params


def test_activation_bytes_follow_the_recompute_mode_and_the_schedule():
    """Dense(64, relu) x 4 at 16 rows: the backward keeps each ReLU output
    (16 x 64 x 4 bytes) per micro-batch; recomputing keeps only stage inputs."""
    plans = {(r, s): tfpipe.plan(_mlp(depth=4, width=64), 64, 4, num_stages=1, schedule=s,
                                 recompute=r, measure_time=False, recommend=False)
             for r in ("never", "always") for s in ("gpipe",)}
    never, always = plans["never", "gpipe"], plans["always", "gpipe"]
    relu_out = 16 * 64 * 4
    # 4 ReLU outputs, the input (needed by the first matmul's weight gradient).
    assert never.stages[0].stash_bytes_per_microbatch == 4 * relu_out + 16 * 16 * 4
    assert always.stages[0].input_bytes_per_microbatch == 16 * 16 * 4
    # GPipe keeps all M micro-batches: the whole stash for never, inputs for always.
    assert never.stages[0].activation_bytes >= 4 * never.stages[0].stash_bytes_per_microbatch
    assert always.stages[0].activation_bytes < never.stages[0].activation_bytes / 2
    # 1F1B keeps min(M, K) micro-batches on device 0 instead of M.
    gpipe = tfpipe.plan(_mlp(), 64, 8, num_stages=4, schedule="gpipe", recompute="never",
                        measure_time=False, recommend=False)
    onefoneb = tfpipe.plan(_mlp(), 64, 8, num_stages=4, schedule="1f1b", recompute="never",
                           measure_time=False, recommend=False)
    assert onefoneb.stages[0].activation_bytes < gpipe.stages[0].activation_bytes


@pytest.mark.parametrize("recompute", ["never", "except_last", "always"])
def test_measured_times_feed_the_simulator(recompute):
    model = _mlp()
    plan = tfpipe.plan(model, 32, 4, num_stages=2, schedule="1f1b", recompute=recompute,
                       repeats=1)
    # The simulator prices the replays: each recomputed micro-batch's backward
    # pays its stage's forward again (all four, three, or none of them).
    sim = schedules.simulate("1f1b", 4, 2, forward_cost=[s.forward_s for s in plan.stages],
                             backward_cost=[s.backward_s for s in plan.stages],
                             recompute=recompute)
    assert plan.step_time_s == pytest.approx(sim.makespan)
    assert plan.bubble_fraction == pytest.approx(sim.bubble_fraction)
    assert all(s.forward_s > 0 and s.backward_s > 0 for s in plan.stages)
    r = plan.recommendation
    assert r.step_time_s <= plan.step_time_s  # the planned one is among those tried
    assert 32 % r.num_microbatches == 0
    assert sum(r.balance) == len(model.layers)
    # Every configuration compared, fastest first: the recommendation, then
    # the rest, the planned one among them with its predicted step.
    settings = ("num_microbatches", "schedule", "recompute", "balance", "step_time_s")
    assert {k: r.tried[0][k] for k in settings} == {k: getattr(r, k) for k in settings}
    steps = [t["step_time_s"] for t in r.tried]
    assert all(a <= b + 1e-12 for a, b in zip(steps, steps[1:]))  # ties by peak
    assert r.reason.startswith(f"Of {len(r.tried)} configurations tried")
    assert {"num_microbatches": 4, "schedule": "1f1b", "recompute": recompute,
            "balance": plan.balance, "step_time_s": pytest.approx(plan.step_time_s)} in [
        {k: t[k] for k in settings} for t in r.tried]
    # Times are relative (each layer timed alone: no per-call overhead, no
    # devices sharing a host); the printout says so and never shows a step in
    # ms that reads as a prediction of the run's. The recommendation is a
    # ratio of two predictions made the same way.
    text = str(plan)
    assert "Plan for" in text and "step time: relative only (this plan = 1.00" in text
    assert not re.search(r"step [0-9.]+ ms", text)
    assert (f"predicted step {1 / r.speedup:.2f} of this plan's ({r.speedup:.2f}x, predicted "
            f"the same way)") in text
    assert r.speedup == pytest.approx(plan.step_time_s / r.step_time_s)


@pytest.mark.parametrize("limit", ["none", "just_under_the_plan", "one_byte"])
def test_recommendation_fits_the_memory_given(limit):
    def plan(device_memory_bytes):
        return tfpipe.plan(_mlp(depth=6, width=64), 64, 2, num_stages=2, recompute="never",
                           device_memory_bytes=device_memory_bytes, measure_time=False,
                           max_microbatches=16)
    unlimited = plan(None)
    if limit == "none":
        assert unlimited.fits is None and unlimited.recommendation.fits is None
        return
    bytes_ = max(unlimited.device_peak_bytes) - 1 if limit == "just_under_the_plan" else 1
    limited = plan(bytes_)
    r = limited.recommendation
    assert limited.fits is False
    assert "does NOT fit" in str(limited)
    # What fits comes first, the recommendation at its head.
    fits = [t["fits"] for t in r.tried]
    assert fits == sorted(fits, key=lambda f: f is False)
    if limit == "one_byte":
        assert r.fits is False and set(fits) == {False}
        assert "Nothing tried fits" in r.reason
    else:  # recompute or more micro-batches bring it under the limit
        assert r.fits is True and fits[0] is True
        assert r.tried[0]["peak_bytes"] == max(r.device_peak_bytes) <= bytes_
        assert "fit" in r.reason


@pytest.mark.parametrize("memory, mode, reason", [
    (None, "never", r"'never' is predicted to need [\d.]+ KiB of host memory's"),
    (10_000, "except_last", r"of /device:CPU:\d's 9.8 KiB, more than 50% of it"),
])
def test_a_plan_given_no_recompute_chooses_it_as_a_model_would(memory, mode, reason):
    plan = tfpipe.plan(_mlp(), 32, 4, num_stages=2, device_memory_bytes=memory,
                       measure_time=False, recommend=False)
    assert plan.recompute == mode and re.search(reason, plan.recompute_reason)
    assert f"recompute={mode} (tfpipe chose it: {plan.recompute_reason})" in str(plan)


def test_plans_a_pipelined_model_as_it_is_cut():
    """Hand-made stages: planned as they are, with the model's settings."""
    with tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"], num_microbatches=2,
                                 schedule="1f1b", recompute="never").scope():
        stages = [keras.Sequential([keras.layers.Dense(8), keras.layers.Dense(8)]),
                  keras.Sequential([keras.layers.Dense(3)])]
        pipelined = tfpipe.PipelinedModel(stages, input_shape=(None, 5))
    plan = tfpipe.plan(pipelined, 8, 2, measure_time=False, recommend=False)
    assert plan.balance == [2, 1]
    assert (plan.schedule, plan.recompute) == ("1f1b", "never")
    assert [s.params for s in plan.stages] == [6 * 8 + 9 * 8, 9 * 3]
    assert [s.device for s in plan.stages] == [str(d) for d in pipelined.stage_devices]


@pytest.mark.parametrize("kwargs,message", [
    ({"batch_size": 0}, "batch_size must be a positive integer, got 0"),
    ({"num_microbatches": 40}, "num_microbatches=40 is more than batch_size=32"),
    ({"num_microbatches": 2.5}, "num_microbatches must be a positive integer, got 2.5"),
    ({"num_stages": 9}, "num_stages=9 but 'sequential"),
    ({"num_stages": 3, "schedule": "zbv"}, "num_stages must be a multiple of 2"),
    ({"num_stages": 5}, f"needs 5 devices; devices has {NUM_DEVICES}"),
    ({"schedule": "gpipe2"}, "Unknown schedule 'gpipe2'"),
    ({"recompute": "sometimes"}, "Unknown recompute mode 'sometimes'"),
    ({"optimizer": "adamz"}, "optimizer='adamz' is not one the planner knows"),
    ({"device_memory_bytes": -1}, "device_memory_bytes must be a positive number"),
    ({"balance": [1, 1]}, "balance [1, 1] sums to 2 but the model has 5"),
    ({"devices": ["/CPU:9"]}, "Device '/CPU:9' does not exist"),
    ({"repeats": 0}, "repeats must be a positive integer"),
], ids=lambda v: str(v)[:30] if isinstance(v, dict) else None)
def test_bad_arguments_name_argument_value_and_fix(kwargs, message):
    args = {"batch_size": 32, "num_microbatches": 4}
    args.update(kwargs)
    with pytest.raises(ValueError) as err:
        tfpipe.plan(_mlp(), **args, measure_time=False, recommend=False)
    assert message in str(err.value)


def test_model_that_is_not_keras_is_refused():
    with pytest.raises(ValueError, match="model must be a keras.Sequential"):
        tfpipe.plan("mlp", 8, 2)


def test_launch_plan_builds_the_trainers_model():
    """`launch.plan` plans exactly what `launch.train` would build."""
    from launch import plan as plan_cli
    from launch.config import TrainConfig
    result = plan_cli.plan_run(TrainConfig(model="mlp", stages=2, microbatches=4,
                                           batch_size=32), repeats=1)
    assert result.model == "digits_mlp"
    assert result.balance == [2, 3]  # models.mlp.stage_balance for 5 layers, K=2
    assert [s.params for s in result.stages] == [64 * 128 + 128 + 129 * 128,
                                                  2 * 129 * 128 + 129 * 10]
    assert result.recommendation is not None


@pytest.mark.parametrize("flag,message", [
    ("--stages=0", "stages=0: must be a positive integer"),
    ("--microbatches=100", "--microbatches=100 is more than the training batch"),
    ("--device_memory_mib=-1", "--device_memory_mib=-1.0: must be >= 0"),
])
def test_launch_plan_bad_flag_is_one_line(flag, message):
    proc = subprocess.run([sys.executable, "-m", "launch.plan", flag], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def _assert_plan_table(text):
    lines = text.splitlines()
    assert lines[0].startswith("Plan for ")
    assert [l.split()[0] for l in lines[2:5]] == ["0", "1", "total"]
    assert any(l.startswith("recommended: M=") for l in lines)
    assert any(l.startswith("step time: relative only") for l in lines)


# Each zoo model's plan table, once: the MLP through the command line (a child
# process: flags, TensorFlow's start, the printed table), the others (their
# builders and data shapes) through `plan_run` here, which the command prints.
@pytest.mark.slow
@pytest.mark.parametrize("model, via", [("mlp", "command"), ("resnet", "plan_run"),
                                        ("transformer", "plan_run"), ("unet", "plan_run")])
def test_launch_plan_prints_the_table_for_each_zoo_model(model, via):
    if via == "command":
        proc = subprocess.run([sys.executable, "-m", "launch.plan", f"--model={model}",
                               "--stages=2", "--microbatches=2", "--batch_size=8",
                               "--repeats=1"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        _assert_plan_table(proc.stdout)
    else:
        from launch import plan as plan_cli
        from launch.config import TrainConfig
        _assert_plan_table(str(plan_cli.plan_run(TrainConfig(model=model, stages=2,
                                                             microbatches=2, batch_size=8),
                                                 repeats=1)))


@pytest.mark.slow
def test_memory_prediction_within_25_percent_of_measured_peaks():
    """`plan.host_peak_bytes` + the batch against what building the model and a
    later step add to a started runtime, in fresh children
    (`benchmarks.memory`): 8 x Dense(512), batch 4096, M=4, K in {1, 2}."""
    from benchmarks import memory  # pylint: disable=import-outside-toplevel
    rows, _ = memory.run(modes=("never", "always"), devices=(1, 2), layers=8, width=512,
                         batch=4096, num_microbatches=4, budget_mib=0, parallel=2,
                         log=lambda line: None)
    for row in rows:
        assert row.get("error") is None, row["error"]
        for k in (1, 2):
            assert 0.75 <= row[f"plan_ratio_k{k}"] <= 1.25, (row["mode"], k, row)
