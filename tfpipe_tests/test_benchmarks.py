"""The benchmark machinery on tiny configurations: structure and sanity, never timing.

Speed claims come from `python -m benchmarks.run` on a quiet machine, not from
a timed unit test; these tests check that the measuring code runs, returns
what the tables read, and keeps BUILD.md's markers.
"""

import json

import keras
import numpy as np
import pytest

from benchmarks import common
from benchmarks import first_step
from benchmarks import memory
from benchmarks import run
from benchmarks import schedules


def test_replace_section_keeps_markers_and_surroundings(tmp_path):
    path = tmp_path / "BUILD.md"
    path.write_text(f"# Title\n\nbefore\n{common.BEGIN_MARKER}\nold table\n"
                    f"{common.END_MARKER}\nafter\n")
    common.rewrite_build_md(path, "| a |\n|---|\n| 1 |\n")
    text = path.read_text()
    assert text.startswith("# Title\n\nbefore\n")
    assert text.endswith(f"{common.END_MARKER}\nafter\n")
    assert "old table" not in text
    body = text.split(common.BEGIN_MARKER)[1].split(common.END_MARKER)[0]
    assert body == "\n| a |\n|---|\n| 1 |\n"
    common.rewrite_build_md(path, "second")  # idempotent: markers still there once
    assert path.read_text().count(common.BEGIN_MARKER) == 1


@pytest.mark.parametrize("text", [
    "no markers at all",
    f"{common.END_MARKER} then {common.BEGIN_MARKER}",
    f"{common.BEGIN_MARKER} {common.BEGIN_MARKER} {common.END_MARKER}",
])
def test_replace_section_rejects_bad_markers(text):
    with pytest.raises(ValueError):
        common.replace_section(text, "x")


def test_ideal_speedups():
    assert schedules.ideal_speedup(2, 8) == pytest.approx(16 / 9)
    assert schedules.ideal_speedup(4, 1) == 1.0
    for k, m in [(2, 1), (2, 8), (4, 16)]:
        assert schedules.simulated_speedup("gpipe", k, m) == pytest.approx(
            schedules.ideal_speedup(k, m))
    # Interleaving shrinks the bubble; recompute lowers what can be reached.
    assert schedules.simulated_speedup("interleaved", 2, 8) > schedules.ideal_speedup(2, 8)
    # Serial work 2 * 8 * 3 = 48 over the makespans 27, 35 and 36 (F=1, B=2;
    # a replayed micro-batch pays F again; except_last keeps the last one).
    for recompute, makespan in (("never", 27), ("except_last", 35), ("always", 36)):
        assert schedules.simulated_speedup("gpipe", 2, 8, recompute) == pytest.approx(
            48 / makespan)
    assert not schedules.valid("interleaved", 4, 2, layers=8)
    assert schedules.valid("interleaved", 2, 4, layers=8)


@pytest.mark.slow  # ~6-19 s each: a benchmark's own machinery, run in CI's slow step
def test_measure_step_in_process():
    # conftest made 4 logical CPUs; the thread settings do not matter here.
    result = schedules.measure_step(2, 2, "gpipe", batch=16, width=8, layers=2, warmup=1,
                                    repeats=1, steps=1)
    for name in ("tfpipe", "plain", "plain_threaded"):
        assert result[name]["step_ms"] > 0
        assert result[name]["trace_s"] > 0
        assert result[name]["ops_total"] >= result[name]["ops"] > 0
    assert set(result["speedup"]) == {"plain", "plain_threaded"}
    assert all(v > 0 for v in result["speedup"].values())
    assert result["config"]["stages"] == 2
    json.dumps(result)  # what a child prints must be JSON


@pytest.mark.slow
def test_measure_step_times_other_recompute_modes_beside_the_pipeline():
    result = schedules.measure_step(2, 2, "gpipe", recompute="except_last",
                                    execution="stage_functions", batch=16, width=8, layers=2,
                                    warmup=1, repeats=3, steps=1, baselines=("plain",),
                                    compare_recompute=("always", "never"))
    for mode in ("always", "never"):
        runs = result[f"tfpipe[{mode}]"]["runs_ms"]
        assert len(runs) == 3 and min(runs) > 0
        pairs = sorted(a / b for a, b in zip(result["tfpipe"]["runs_ms"], runs))
        assert result["recompute_pairs"][mode] == pytest.approx(pairs[1])
    assert set(result["speedup"]) == {"plain"}  # the compared pipelines are not baselines
    assert result["config"]["compare_recompute"] == ["always", "never"]
    json.dumps(result)


@pytest.mark.parametrize("schedule, kinds", [
    pytest.param("1f1b", {"F", "B"}, marks=pytest.mark.slow), ("zbh1", {"F", "I", "W"})])
def test_measure_step_records_a_step_and_simulates_it_on_its_costs(schedule, kinds):
    result = schedules.measure_step(2, 2, schedule, batch=16, width=8, layers=2, warmup=1,
                                    repeats=1, steps=1, baselines=(), timeline=True)
    recorded = result["timeline"]
    assert set(recorded["mean_ms"]) == kinds and min(recorded["mean_ms"].values()) > 0
    assert recorded["span_ms"] > 0 and recorded["predicted_span_ms"] > 0
    assert 0.0 <= recorded["predicted_bubble"] < 1.0 and 0.0 <= recorded["measured_bubble"] < 1.0
    json.dumps(result)


@pytest.mark.parametrize("executions, recomputes, expected", [
    (("unrolled",), ("never",), [(2, 8, "1f1b", "unrolled", "never")]),
    (("stage_functions",), ("except_last", "always"),
     [(2, 8, "1f1b", "stage_functions", "except_last"),
      (2, 8, "1f1b", "stage_functions", "always")]),
    # The loop keeps only stage inputs: it runs "always" alone.
    (("unrolled", "loop"), ("never", "always"),
     [(2, 8, "1f1b", "unrolled", "never"), (2, 8, "1f1b", "unrolled", "always"),
      (2, 8, "1f1b", "loop", "always")]),
    (("loop",), ("never",), []),
])
def test_grid_configs_run_every_recompute_mode_each_execution_can(executions, recomputes,
                                                                  expected):
    assert schedules.grid_configs([2], [8], ["1f1b"], executions, recomputes) == expected


def _summary_row(schedule, speedup, ideal_sim, recompute=None, execution="unrolled"):
    return {"num_devices": 2, "num_microbatches": 8, "schedule": schedule,
            "execution": execution, "recompute": recompute, "speedup": speedup,
            "ideal_sim": ideal_sim, "ratio_to_ideal": speedup / ideal_sim,
            "result": {"timeline": None}}


def test_recompute_cost_reads_the_pairs_timed_in_one_child():
    rows = [_summary_row("1f1b", 1.30, 48 / 34, "except_last", "stage_functions"),
            _summary_row("gpipe", 1.30, 48 / 35, "except_last")]  # not compared
    rows[0]["result"]["recompute_pairs"] = {"always": 1.02, "never": 0.8}
    assert schedules.recompute_cost(rows) == [
        {"num_devices": 2, "num_microbatches": 8, "schedule": "1f1b",
         "execution": "stage_functions", "recompute": "except_last", "against": mode,
         "measured": measured, "simulated": pytest.approx(simulated)}
        # Simulated makespans (F=1, B=2): except_last 34, always 36, never 27.
        for mode, measured, simulated in (("always", 1.02, 34 / 36), ("never", 0.8, 34 / 27))]


def test_summaries_keep_recompute_modes_apart():
    rows = [_summary_row("1f1b", 1.6, 1.78, "never"), _summary_row("zbh1", 1.8, 1.92, "never"),
            _summary_row("1f1b", 1.2, 1.33, "always"), _summary_row("zbh1", 1.5, 1.41, "always"),
            _summary_row("1f1b", 1.1, 1.33, "always", "loop")]
    assert [(e["recompute"], e["zbh1_over_1f1b"]) for e in schedules.zero_bubble_summary(rows)] \
        == [("always", pytest.approx(1.5 / 1.2)), ("never", pytest.approx(1.8 / 1.6))]
    # The loop (always) against the unrolled form under the same mode only.
    assert schedules.loop_throughput(rows) == [
        {"num_devices": 2, "num_microbatches": 8, "schedule": "1f1b",
         "loop_over_unrolled": pytest.approx(1.1 / 1.2)}]


def test_zero_bubble_summary_adds_the_split_gain_where_zbh1_was_recorded():
    def row(schedule, speedup, ideal_sim, stage_ms=None):
        return {"num_devices": 2, "num_microbatches": 8, "schedule": schedule,
                "speedup": speedup, "ideal_sim": ideal_sim, "ratio_to_ideal": speedup / ideal_sim,
                "result": {"timeline": None if stage_ms is None else {"stage_ms": stage_ms}}}

    costs = {"forward": [1, 1], "backward": [2, 2], "weight": [1, 1]}
    rows = [row("1f1b", 1.6, 1.78), row("zbh1", 1.8, 1.92, costs)]
    entry, = schedules.zero_bubble_summary(rows)
    assert entry["zbh1_over_1f1b"] == pytest.approx(1.8 / 1.6)
    assert entry["zbh1_over_1f1b_simulated_on_zbh1_costs"] == pytest.approx(
        schedules.split_gain(costs, 2, 8))
    rows[1]["result"]["timeline"] = None  # not recorded (no --timeline)
    entry, = schedules.zero_bubble_summary(rows)
    assert "zbh1_over_1f1b_simulated_on_zbh1_costs" not in entry


def _timed_row(plain_ms, step_ms, span_ms, ideal_sim, stage_ms=None, k=2, m=8):
    """A `run_config` row as --timeline writes it (the numbers ratio_factors reads)."""
    timeline = None if stage_ms is None else {"stage_ms": stage_ms, "span_ms": span_ms}
    return {"num_devices": k, "num_microbatches": m, "schedule": "1f1b",
            "ideal_sim": ideal_sim, "ratio_to_ideal": plain_ms / step_ms / ideal_sim,
            "result": {"plain": {"step_ms": plain_ms}, "tfpipe": {"step_ms": step_ms},
                       "timeline": timeline}}


@pytest.mark.parametrize("plain_ms, step_ms, span_ms, ideal_sim, expected", [
    # K=2, M=8, stages F=1, B=2 ms: 8 * 6 / 2 = 24 ms of actions per device.
    # As simulated (busy 24/27 of 27 ms; ideal_sim 2*24/27), the plain step
    # 48 ms = 2 * 24, the timed step the span: every factor 1.
    (48.0, 27.0, 27.0, 2 * 24 / 27, dict(busy=1.0, rest=1.0, work=1.0, span=1.0)),
    # The same span, micro-batches costing 20% more than the plain step.
    (40.0, 27.0, 27.0, 2 * 24 / 27, dict(busy=1.0, rest=40 / 48, work=40 / 48, span=1.0)),
    # A bigger bubble (span 30 for the same work), timed step = span.
    (48.0, 30.0, 30.0, 2 * 24 / 27, dict(busy=27 / 30, rest=1.0, work=1.0, span=1.0)),
    # The timed step 10% longer than the recorded span (the update).
    (48.0, 29.7, 27.0, 2 * 24 / 27, dict(busy=1.0, rest=27 / 29.7, work=1.0, span=27 / 29.7)),
])
def test_ratio_factors_multiply_to_measured_over_ideal(plain_ms, step_ms, span_ms, ideal_sim,
                                                       expected):
    row = _timed_row(plain_ms, step_ms, span_ms, ideal_sim,
                     {"forward": [1.0, 1.0], "backward": [2.0, 2.0], "weight": [0.0, 0.0]})
    factors = schedules.ratio_factors(row)
    assert factors == pytest.approx(expected)
    assert factors["busy"] * factors["rest"] == pytest.approx(row["ratio_to_ideal"])
    assert factors["work"] * factors["span"] == pytest.approx(factors["rest"])


def test_ratio_factors_need_a_recorded_step_and_explain_prints_those_rows(tmp_path):
    recorded = _timed_row(40.0, 27.0, 27.0, 2 * 24 / 27,
                          {"forward": [1.0, 1.0], "backward": [2.0, 2.0], "weight": [0.0, 0.0]})
    unrecorded = _timed_row(40.0, 27.0, 27.0, 2 * 24 / 27, m=4)  # no --timeline
    assert schedules.ratio_factors(unrecorded) is None
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"speedup": [recorded, unrecorded]}))
    header, line = schedules.explain(path).splitlines()
    assert header.split() == ["K", "M", "schedule", "measured/ideal", "busy", "rest", "work",
                              "span"]
    assert line.split() == ["2", "8", "1f1b", f"{recorded['ratio_to_ideal']:.3f}", "1.000",
                            f"{40 / 48:.3f}", f"{40 / 48:.3f}", "1.000"]


@pytest.mark.parametrize("stage_ms, m, expected", [
    # F = I = W = 1 on both stages: the simulator's own ratio, 1F1B 3M + 3 (M + 1
    # with F=1, B=2 on 2 devices) over ZB-H1's 3M + 1.
    ({"forward": [1, 1], "backward": [2, 2], "weight": [1, 1]}, 8, 27 / 25),
    ({"forward": [1, 1], "backward": [2, 2], "weight": [1, 1]}, 4, 15 / 13),
    # W costs nothing: no split gain.
    ({"forward": [1, 1], "backward": [2, 2], "weight": [0, 0]}, 8, 1.0),
])
def test_split_gain_simulates_both_schedules_on_the_same_costs(stage_ms, m, expected):
    assert schedules.split_gain(stage_ms, 2, m) == pytest.approx(expected)


def test_measure_trace_loop_in_process():
    result = schedules.measure_trace(2, 2, "loop", batch=8, width=4, layers=2, steps=1)
    assert result["ops_total"] > result["ops"]  # the while body is a nested function
    assert result["trace_s"] > 0 and result["first_call_s"] > 0
    # trace_s is the median of three fresh traces of the same model.
    assert len(result["trace_runs_s"]) == 3
    assert result["trace_s"] == sorted(result["trace_runs_s"])[1]


@pytest.mark.slow  # builds MobileNetV2 four times: ~60 s
@pytest.mark.parametrize("pipelined, execution, build_optimizer, recompute, resolved", [
    (False, None, False, None, None), (False, None, True, None, None),
    (True, "stage_functions", False, None, "except_last"),
    (True, "stage_functions", False, "always", "always")])
def test_first_step_times_the_set_up_the_first_fit_and_each_later_step(
        pipelined, execution, build_optimizer, recompute, resolved):
    result = first_step.measure_first_fit(2, execution, stages=2, batch=4, pipelined=pipelined,
                                          steps=3, build_optimizer=build_optimizer,
                                          recompute=recompute)
    assert result["setup_s"] > 0 and result["first_fit_s"] > 0
    assert result["recompute"] == resolved
    # The second fit runs 4 steps; its first (iterator set-up) is left out.
    assert len(result["steps_ms"]) == 3 and all(t > 0 for t in result["steps_ms"])
    assert result["step_ms"] == sorted(result["steps_ms"])[1]  # the median
    json.dumps(result)


def test_first_step_refuses_to_build_a_pipelined_models_optimizer():
    with pytest.raises(ValueError, match="build_optimizer=True is for plain Keras"):
        first_step.measure_first_fit(2, "unrolled", stages=2, batch=4, build_optimizer=True)


@pytest.mark.parametrize("build_optimizer, traces", [(False, 2), (True, 1)])
def test_plain_keras_traces_its_first_step_twice_unless_the_optimizer_is_built(
        build_optimizer, traces):
    # What the two baselines of benchmarks.first_step differ by: Keras builds
    # the optimizer's slots inside the first fit's trace, and a tf.function
    # that creates variables is traced again.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse", jit_compile=False)
    if build_optimizer:
        model.optimizer.build(model.trainable_variables)
    calls = []
    train_step = model.train_step
    model.train_step = lambda data: calls.append(1) or train_step(data)
    model.fit(np.ones((4, 3), "float32"), np.ones((4, 2), "float32"), batch_size=4, verbose=0)
    assert len(calls) == traces


def _first_step_row(execution, setup_s, first_fit_s):
    return dict(execution=execution, num_microbatches=1, onednn="default", setup_s=setup_s,
                first_fit_s=first_fit_s, step_ms=5.0)


@pytest.mark.parametrize("plain, built, row, expected", [
    # plain: 1 s set-up, 20 s first fit; plain_built: 2 s, 10 s; the row: 4 s, 30 s.
    ((1.0, 20.0), (2.0, 10.0), (4.0, 30.0), (1.5, 3.0, 34.0 / 21.0)),
    # A baseline that failed leaves its ratios empty, not the others.
    ((1.0, 20.0), (2.0, None), (4.0, 30.0), (1.5, None, 34.0 / 21.0)),
    ((None, None), (2.0, 10.0), (4.0, 30.0), (None, 3.0, None)),
])
def test_first_step_rows_over_each_baseline(plain, built, row, expected):
    rows = first_step.over_baselines([_first_step_row("plain", *plain),
                                      _first_step_row("plain_built", *built),
                                      _first_step_row("stage_functions", *row)])
    got = rows[-1]
    assert got["first_fit_over_plain"] == pytest.approx(expected[0])
    assert got["first_fit_over_plain_built"] == pytest.approx(expected[1])
    assert got["wait_over_plain"] == pytest.approx(expected[2])


@pytest.mark.parametrize("onednn", [("on",), ("default", "OFF")])
def test_first_step_names_an_unknown_onednn_setting(onednn):
    with pytest.raises(ValueError, match=r"onednn: '(on|OFF)' is not one of \['default', 'off'\]"):
        first_step.grid([1], [], onednn=onednn, log=lambda line: None)


def test_first_step_table_has_a_onednn_column_only_for_several_settings():
    row = first_step.over_baselines([_first_step_row("plain", 1.0, 2.0)])[0]
    one = first_step.table([{**row, "onednn": "default"}])
    both = first_step.table([{**row, "onednn": "default"}, {**row, "onednn": "off"}])
    assert "oneDNN" not in one
    assert both.splitlines()[0].split("|")[3].strip() == "oneDNN"
    assert "| off |" in both


@pytest.mark.parametrize("measure, runtime_mib, kills_at", [
    ("process", 500.0, 600.0),  # cap = runtime + budget; the child is killed past it
    ("tensors", 500.0, None),   # cap = budget on live tensors; the runtime does not count
])
def test_largest_model_search_finds_the_boundary(monkeypatch, measure, runtime_mib, kills_at):
    calls = []

    def fake_run_memory(layers, rss_limit_mib, measure, **kwargs):
        calls.append((layers, rss_limit_mib, measure))
        tensors = 7.0 * layers  # 7 MiB of live tensors per layer
        process = runtime_mib + tensors + 3.0 * layers  # plus the graph on the host
        if rss_limit_mib is not None and process > rss_limit_mib:
            return {"error": "rss_limit"}
        return {"peak_mib": process, "tensor_peak_mib": tensors}

    monkeypatch.setattr(memory, "run_memory", fake_run_memory)
    found = memory.largest_model("never", budget_mib=100, runtime_mib=runtime_mib, width=8,
                                 batch=8, num_microbatches=1, log=lambda *_: None,
                                 measure=measure)
    # process: 10 * 10 = 100 <= 100 < 110; tensors: 7 * 14 = 98 <= 100 < 105
    assert found["layers"] == {"process": 10, "tensors": 14}[measure]
    assert found["params"] == memory.params(found["layers"], 8)
    assert found["measure"] == measure
    assert {(limit, m) for _, limit, m in calls} == {(kills_at, measure)}
    assert len(calls) <= 8


def test_capacity_search_names_an_unknown_measure():
    with pytest.raises(ValueError, match=r"measure='rss'.*'process', 'tensors'"):
        memory.capacity(100, width=8, batch=8, num_microbatches=1, measure="rss")


@pytest.mark.parametrize("text, measures", [
    ("process", ["process"]), ("process, tensors", ["process", "tensors"]), ("", []),
])
def test_capacity_measure_flag_parses(text, measures):
    assert memory.parse_measures(text) == measures


@pytest.mark.parametrize("text", ["tensor", "process,rss"])
def test_capacity_measure_flag_names_a_bad_value(text):
    with pytest.raises(ValueError, match=r"--capacity_measure=.*not in \('process', 'tensors'\)"):
        memory.parse_measures(text)


@pytest.mark.parametrize("measure, header", [
    ("process", "| process peak MiB | cap MiB (runtime + budget) |"),
    ("tensors", "| tensor peak MiB | cap MiB (budget) |"),
])
def test_capacity_table_names_what_the_budget_holds(measure, header):
    found = {"layers": 3, "params": memory.params(3, 8), "peak_mib_at_layers": 90.0,
             "cap_mib": 100.0, "probes": [{}, {}]}
    at_limit = dict(found, layers=12, params=memory.params(12, 8), at_search_limit=True)
    table = memory.capacity_table({"measure": measure,
                                   "modes": {"never": found, "always": at_limit},
                                   "ratios": {"never": 1.0, "always": 4.5}})
    assert header in table.splitlines()[0]
    assert "| never | 3 | 0.001M |" in table
    # the search stopped at its largest count: the row is a lower bound
    assert "| always | >= 12 |" in table and "| >= 4.50 |" in table


@pytest.mark.parametrize("result, line", [
    ({"error": "Traceback (most recent call last):\n  ...\nValueError: 3 layers\n"},
     "ValueError: 3 layers"),
    ({"error": "rss_limit", "rss_limit_mib": 900}, "rss_limit"),
    ({"peak_mib": 1.0}, None),  # the child succeeded
])
def test_a_childs_error_line_is_its_last_line(result, line):
    assert common.error_line(result) == line


@pytest.mark.parametrize("target, layers", [
    (0, 1), (memory.params(10, 8), 10), (memory.params(10, 8) + 1, 11),
    (4 * memory.params(33, 128), 131),  # the process search's goal model (never: 33)
])
def test_layers_for_params_is_the_fewest_with_that_many(target, layers):
    assert memory.layers_for_params(target, 8 if target < 10**5 else 128) == layers


def _fake_children(monkeypatch, runtime_mib=500.0, per_layer_mib=3.0):
    """run_memory and the runtime child as numbers: the host pays
    `per_layer_mib` per layer (plain Keras 1.5x that), activations 1 MiB per
    layer per 64 rows."""
    calls = []

    def fake_run_memory(layers, batch, plain=False, rss_limit_mib=None, **kwargs):
        calls.append(dict(kwargs, layers=layers, batch=batch, plain=plain))
        host = per_layer_mib * layers * (1.5 if plain else 1.0)
        process = runtime_mib + host + layers * batch / 64
        if rss_limit_mib is not None and process > rss_limit_mib:
            return {"error": "rss_limit"}
        return {"peak_mib": process, "trace_mib": host / 2}

    monkeypatch.setattr(memory, "run_memory", fake_run_memory)
    monkeypatch.setattr(common, "run_child", lambda *a, **k: {"peak_mib": runtime_mib})
    return calls


def test_host_floor_is_each_models_peak_above_the_runtime_at_64_rows(monkeypatch):
    calls = _fake_children(monkeypatch)
    floor = memory.host_floor(40, width=8, num_microbatches=4, runtime_mib=500.0,
                              budget_mib=150, segment_layers=(8,),
                              executions=("unrolled", "stage_functions"), log=lambda *_: None)
    rows = [(r["name"], r["execution"], r["peak_mib"], r["fits"]) for r in floor["rows"]]
    # 3 MiB per layer (4.5 plain) + 1 MiB per layer of activations at 64 rows
    assert rows == [("plain Keras", None, 220.0, False)] + [
        (name, execution, 160.0, False) for execution in ("unrolled", "stage_functions")
        for name in ("never", "always", "always/segments of 8")]
    assert {c["batch"] for c in calls} == {memory.HOST_FLOOR_BATCH}
    assert [c.get("execution") for c in calls] == [None] + ["unrolled"] * 3 + [
        "stage_functions"] * 3
    assert [c["plain"] for c in calls] == [True] + [False] * 6
    assert calls[3]["segment_layers"] == 8 and calls[3]["recompute"] == "always"
    table = memory.host_floor_table(floor)
    assert "| plain Keras | - | 40 |" in table and "| 220.0 | 90.0 | no |" in table
    assert "within 150 MiB" in table.splitlines()[0]


@pytest.mark.parametrize("measure, ratio, floor_layers", [
    ("process", 4, memory.layers_for_params(4 * memory.params(10, 8), 8)),
    ("process", 0, None),   # not asked for
    ("tensors", 4, None),   # the tensor measure has no host to pay for
])
def test_capacity_measures_the_host_floor_of_the_goal_model(monkeypatch, measure, ratio,
                                                            floor_layers):
    calls = _fake_children(monkeypatch, per_layer_mib=3.0)
    # process: 3 + 1024 / 64 = 19 MiB per layer against 190 MiB -> never fits 10 layers
    result = memory.capacity(190, width=8, batch=1024, num_microbatches=4, measure=measure,
                             host_floor_ratio=ratio, log=lambda *_: None,
                             execution="stage_functions")
    # every probe of the search steps the execution asked for
    assert {c["execution"] for c in calls if c["batch"] == 1024} == {"stage_functions"}
    assert result["model"]["execution"] == result["never"]["execution"] == "stage_functions"
    floor = result["host_floor"]
    if floor_layers is None:
        assert floor is None
        return
    assert result["never"]["layers"] == 10
    assert floor["layers"] == floor_layers and floor["ratio"] == 4
    assert floor["rows"][0] == dict(floor["rows"][0], name="plain Keras",
                                    peak_mib=4.5 * floor_layers + floor_layers)


@pytest.mark.parametrize("text, flag, most, expected", [
    ("unrolled", "--host_floor_executions", None, ["unrolled"]),
    ("unrolled, stage_functions", "--host_floor_executions", None,
     ["unrolled", "stage_functions"]),
    ("loop", "--host_floor_executions", None, "a comma-separated subset of"),
    ("", "--host_floor_executions", None, "a comma-separated subset of"),
    ("stage_functions", "--capacity_execution", 1, ["stage_functions"]),
    ("unrolled,stage_functions", "--capacity_execution", 1, "one of"),
])
def test_executions_flags_parse_or_name_the_flag_and_the_choices(text, flag, most, expected):
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=rf"{flag}=.*expected {expected} "
                                             r"\('unrolled', 'stage_functions'\)"):
            memory.parse_executions(text, flag, most)
    else:
        assert memory.parse_executions(text, flag, most) == expected


@pytest.mark.slow  # ~6-19 s each: a benchmark's own machinery, run in CI's slow step
@pytest.mark.parametrize("plain, execution", [
    (True, "unrolled"), (False, "unrolled"), (False, "stage_functions")])
def test_memory_child_steps_plain_keras_and_the_pipelined_model_alike(plain, execution):
    result = memory.run_memory(layers=4, width=16, batch=64, num_microbatches=4,
                               recompute="always", steps=2, segment_layers=2,
                               execution=execution, plain=plain)
    assert "error" not in result, result.get("stderr_tail")
    assert result["params"] == memory.params(4, 16)
    assert result["config"]["plain"] is plain
    assert result["peak_mib"] > result["runtime_mib"] > 0
    assert result["trace_mib"] is not None and result["run_mib"] is not None
    assert 0.0 < result["loss"] < 10.0


@pytest.mark.slow  # ~6-19 s each: a benchmark's own machinery, run in CI's slow step
def test_run_suite_memory_in_children(tmp_path):
    build_md = tmp_path / "BUILD.md"
    build_md.write_text(f"## Benchmarks\n{common.BEGIN_MARKER}\n{common.END_MARKER}\ntail\n")
    suites = {"tiny": {"memory": dict(layers=2, width=16, batch=64, microbatches=(2,),
                                      recompute=("always",), steps=2, parallel=2)}}
    data = run.run_suite("tiny", only=["memory"], out_dir=tmp_path, build_md=build_md,
                         suites=suites, log=lambda *_: None)
    grid = data["results"]["memory"]
    assert "error" not in grid["baseline"], grid["baseline"].get("stderr_tail")
    (row,) = grid["rows"]
    assert "error" not in row["result"], row["result"].get("stderr_tail")
    assert row["peak_mib"] > 0 and row["run_mib"] is not None and row["run_mib"] >= 0
    assert row["result"]["params"] == memory.params(2, 16)
    saved = json.loads((tmp_path / "suite_tiny.json").read_text())
    assert saved["machine"]["cpu_count"] >= 1 and "processor" in saved["machine"]
    assert (tmp_path / "suite_tiny_memory.png").stat().st_size > 0
    text = build_md.read_text()
    assert text.startswith("## Benchmarks\n") and text.endswith(f"{common.END_MARKER}\ntail\n")
    assert "| always | 2 |" in text


@pytest.mark.slow  # ~6-19 s each: a benchmark's own machinery, run in CI's slow step
@pytest.mark.parametrize("execution", ["unrolled", "stage_functions"])
def test_tensor_measure_sees_what_recompute_frees(execution):
    # 4 x Dense(256) on 4096 rows: each layer's activations are 4 MiB for the
    # whole batch; without recompute all 4 stay for the backward pass. A
    # replay that ran as soon as its input existed, not at backward time,
    # would hold as much (stage functions without their gate: 23.9 MiB,
    # the same as "never"; 14.5 with it).
    model = dict(layers=4, width=256, batch=4096, num_microbatches=4, steps=2,
                 execution=execution)
    peaks = {}
    for recompute in ("never", "always"):
        result = memory.run_memory(measure="tensors", recompute=recompute, **model)
        assert "error" not in result, result.get("stderr_tail")
        peaks[recompute] = result["tensor_peak_mib"]
    assert peaks["never"] >= 16.0
    assert peaks["always"] < peaks["never"] - 6.0, peaks  # replays 1 MiB per layer


@pytest.mark.slow  # ~6-19 s each: a benchmark's own machinery, run in CI's slow step
def test_child_errors_come_back_as_dicts():
    result = common.run_child("benchmarks.memory:measure_memory",
                              {"layers": 3, "width": 4, "batch": 8, "num_devices": 2},
                              devices=2, timeout=120)
    assert "error" in result and "equal stages" in result["error"]
