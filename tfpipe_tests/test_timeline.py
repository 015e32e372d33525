"""A measured timeline of one real step: order, overlap, figures, chart and files."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe import actions
from tfpipe import schedules
from tfpipe import timeline as timeline_lib
from launch import timeline_chart
from tfpipe_tests import helpers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(schedule, execution="unrolled", m=4):
    devices = ["/CPU:0", "/CPU:1"]
    strategy = tfpipe.PipelineStrategy(devices=devices, num_microbatches=m, schedule=schedule,
                                       execution=execution)
    n_stages = strategy.num_stages
    layers = [keras.layers.Dense(16, activation="relu") for _ in range(n_stages - 1)]
    layers.insert(1, keras.layers.BatchNormalization())
    layers.append(keras.layers.Dense(3))
    with strategy.scope():
        model = tfpipe.PipelinedModel.from_model(
            helpers.reference(layers, (8,)),
            balance=[2] + [1] * (n_stages - 1))
        model.compile(optimizer="adam", loss="mse")
    return model


_INTERLEAVED = schedules.Interleaved(2)
RECORDED = [
    ("gpipe", "unrolled"), ("1f1b", "unrolled"), (_INTERLEAVED, "unrolled"),
    ("zbh1", "unrolled"), ("zbv", "unrolled"),
    # Stage functions (tfpipe's choice from M=8 on) stamp each call.
    ("gpipe", "stage_functions"), ("1f1b", "stage_functions"),
    (_INTERLEAVED, "stage_functions"),
    # The loop form stamps its actions too (no barrier between ticks).
    ("1f1b", "loop"), ("zbh1", "loop"), ("zbv", "loop")]


# The default suite runs each execution once, and the split schedules (CI's slow
# step runs every row).
@pytest.mark.parametrize("schedule, execution", helpers.in_default_suite(RECORDED, default=[
    ("zbv", "unrolled"), ("zbh1", "unrolled"), (_INTERLEAVED, "stage_functions"),
    ("1f1b", "loop")]))
def test_record_step_follows_the_schedule_and_changes_nothing(schedule, execution):
    model = _model(schedule, execution)
    x, y = helpers.regression_data(n=16)
    before = [v.numpy() for v in model.variables]
    timeline = tfpipe.timeline.record_step(model, x, y)
    assert helpers.max_abs_diff(before, [v.numpy() for v in model.variables]) == 0.0

    m, d, k = 4, 2, len(model.stages)
    table = model.schedule.actions(m, d)
    ran = {a for row in table for a in row}
    assert len(timeline.events) == len(ran)
    finished = {}
    for dev in range(d):
        mine = sorted((e for e in timeline.events if e.device == dev), key=lambda e: e.start_ms)
        # Each device ran exactly its row of the table, in order, one at a time.
        assert [e.name for e in mine] == [str(a) for a in table[dev]]
        for prev, cur in zip(mine, mine[1:]):
            assert cur.start_ms >= prev.end_ms
        assert all(e.end_ms >= e.start_ms for e in mine)
        finished.update({e.name: e for e in mine})
    for e in timeline.events:  # and once what it reads is being made: it waits
        # for those tensors only (B0.m for B1.m's input gradient, not its dW).
        action = actions.Action(e.kind, e.stage, e.microbatch)
        for dep in actions.KINDS[e.kind].dependencies(action, k, ran):
            assert e.start_ms >= finished[str(dep)].start_ms, (e.name, str(dep))
    assert 0.0 <= timeline.measured_bubble < 1.0
    assert 0.0 <= timeline.predicted_bubble < 1.0
    assert timeline.ideal_bubble == pytest.approx(
        schedules.simulate(model.schedule, m, d).bubble_fraction)
    assert timeline.predicted_overlap_ms > 0.0  # M=4 on 2 devices: the schedule overlaps


@pytest.mark.parametrize("schedule", helpers.in_default_suite(["1f1b", "zbh1", "zbv"],
                                                              default=["zbh1"]))
def test_record_step_with_one_stream_per_device(schedule):
    # The benchmarks' stream emulation (serialize_ops) chains each device's ops
    # in run order. A split W's weight half, made at I, waits for W's start
    # stamp: chained before it, the step had "nodes in a cycle".
    model = _model(schedule)
    model.set_trace_options(serialize_ops=True)
    x, y = helpers.regression_data(n=16)
    timeline = tfpipe.timeline.record_step(model, x, y)
    table = model.schedule.actions(4, 2)
    for dev in range(2):
        mine = sorted((e for e in timeline.events if e.device == dev), key=lambda e: e.start_ms)
        assert [e.name for e in mine] == [str(a) for a in table[dev]]
        for prev, cur in zip(mine, mine[1:]):
            assert cur.start_ms >= prev.end_ms


@pytest.mark.parametrize("events, expected", [
    # Means per stage; a stage with no action of a kind costs 0.
    ([(0, "F", 0, 0, 0.0, 2.0), (0, "F", 0, 1, 2.0, 6.0), (1, "B", 1, 0, 3.0, 9.0)],
     ([3.0, 0.0], [0.0, 6.0], [0.0, 0.0])),
    # Split: backward is I + W, weight is W (stage 0 has no I).
    ([(0, "I", 1, 0, 0.0, 1.0), (0, "W", 1, 0, 1.0, 4.0), (0, "W", 0, 0, 4.0, 6.0)],
     ([0.0, 0.0], [2.0, 4.0], [2.0, 3.0])),
])
def test_stage_costs_are_what_the_simulator_takes(events, expected):
    events = [timeline_lib.Event(*e) for e in events]
    assert timeline_lib.stage_costs(events, 2) == tuple(list(map(pytest.approx, c)) for c in expected)


def _wide_model(schedule, execution, m, width=512, layers=4):
    """Two stages with enough work per micro-batch (a few ms) to run at once."""
    strategy = tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"], num_microbatches=m,
                                       schedule=schedule, execution=execution)
    dense = [keras.layers.Dense(width, activation="relu") for _ in range(layers)]
    with strategy.scope():
        model = tfpipe.PipelinedModel.from_model(
            helpers.reference(dense + [keras.layers.Dense(3)], (width,)),
            balance=[layers // 2, layers - layers // 2 + 1])
        model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("schedule, execution", [("gpipe", "unrolled"), ("1f1b", "loop")])
def test_two_devices_work_at_once_in_a_recorded_step(schedule, execution):
    # GPipe/1F1B with K=2, M=4: device 0's forwards of micro-batches 1-3 can run
    # while device 1 runs F1.0 and on. The stamps must not serialise the step
    # (tf.function chained every tf.timestamp in trace order: overlap was 0).
    model = _wide_model(schedule, execution, m=4)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 512)).astype("float32")
    y = np.zeros((256, 3), "float32")
    for _ in range(3):  # a loaded 2-core machine may still delay one device
        timeline = timeline_lib.record_step(model, x, y)
        if timeline.overlap_ms > 0.0:
            break
    assert timeline.overlap_ms > 0.0, timeline.summary()
    assert timeline.overlap_ms <= timeline.span_ms
    assert timeline.predicted_overlap_ms > 0.0
    assert "overlap (2+ devices busy)" in timeline.summary()


def _timeline(events, devices=2, schedule="1f1b", m=4, predicted_overlap_ms=1.0):
    return timeline_lib.Timeline([timeline_lib.Event(*e) for e in events],
                            [f"/device:CPU:{d}" for d in range(devices)], schedule, m,
                            measured_bubble=0.5, predicted_bubble=0.25, ideal_bubble=0.2,
                            predicted_overlap_ms=predicted_overlap_ms)


@pytest.mark.parametrize("intervals, expected", [
    ([[(0, 4)], [(1, 3)]], 2.0),                       # nested
    ([[(0, 2), (2, 4)], [(1, 3)]], 2.0),               # back-to-back on one device
    ([[(0, 2)], [(2, 4)]], 0.0),                       # touching only
    ([[(0, 3)], [(1, 4)], [(2, 5)]], 3.0),             # 2+ busy from 1 to 4
    ([[(0, 5)], []], 0.0),                             # one device idle
])
def test_overlap_counts_time_with_two_or_more_devices_busy(intervals, expected):
    assert timeline_lib.overlap_ms(intervals) == pytest.approx(expected)


@pytest.mark.parametrize("devices, predicted_overlap_ms, text", [
    (1, 0.0, "overlap: none possible (one device)"),
    (2, 0.0, "none predicted: this schedule runs one action at a time with M=4"),
    (2, 1.5, "overlap (2+ devices busy) 1.0 of 4.0 ms, predicted 1.5 ms"),
])
def test_summary_names_each_figure_and_says_when_overlap_cannot_happen(
        devices, predicted_overlap_ms, text):
    events = [(0, "F", 0, 0, 0.0, 2.0), (devices - 1, "B", 0, 0, 1.0, 4.0)]
    summary = _timeline(events, devices, predicted_overlap_ms=predicted_overlap_ms).summary()
    assert summary.startswith("measured bubble 50.0%; predicted from measured stage costs "
                              "25.0%; schedule's ideal with F=1, B=2: 20.0%; ")
    assert text in summary
    assert "simulated" not in summary


def test_gantt_chart_labels_fit_their_bars_and_read_on_their_colour():
    # Device 0: eight 0.3 ms forwards (too narrow for "F0.3"), then an I and a
    # W; device 1: two wide bars. Every kind appears once in the legend.
    events = [(0, "F", 0, m, 0.3 * m, 0.3 * (m + 1)) for m in range(8)]
    events += [(1, "F", 1, 0, 0.3, 12.0), (1, "B", 1, 0, 12.0, 40.0),
               (0, "I", 0, 0, 40.0, 40.8), (0, "W", 0, 0, 41.0, 60.0)]
    timeline = _timeline(events, m=8)
    fig = timeline_chart.figure(timeline)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    labels = {t.get_text(): t for t in ax.texts}
    assert sorted(labels) == ["B1.0", "F1.0", "W0.0"]  # the narrow ones are left out
    for e in timeline.events:
        if e.name not in labels:
            continue
        text = labels[e.name]
        box = text.get_window_extent(renderer)
        (x0, y0), (x1, y1) = ax.transData.transform(
            [(e.start_ms, e.device + 0.4), (e.end_ms, e.device - 0.4)])
        assert x0 <= box.x0 and box.x1 <= x1, e.name  # inside the bar, in pixels
        assert y0 <= box.y0 and box.y1 <= y1, e.name
        colour = timeline_chart.COLOURS[e.kind]
        assert _contrast(text.get_color(), colour) >= 4.5, e.name  # WCAG AA
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        f"{k}: {actions.KINDS[k].description}" for k in "FBIW"]
    caption = " ".join(t.get_text() for t in fig.texts)
    for name in ("measured 50.0%", "predicted from measured stage costs 25.0%",
                 "schedule's ideal with F=1, B=2: 20.0%", "Overlap (2+ devices busy)"):
        assert name in caption
    assert timeline_chart.png(timeline)[:8] == b"\x89PNG\r\n\x1a\n"


def _contrast(a, b):
    from matplotlib import colors  # pylint: disable=import-outside-toplevel

    def luminance(colour):
        c = [v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4
             for v in colors.to_rgb(colour)]
        return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]

    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def test_chrome_trace_png_and_callback(tmp_path):
    model = _model("1f1b")
    x, y = helpers.regression_data(n=32)
    timeline = tfpipe.timeline.record_step(model, x[:16], y[:16])
    trace = json.load(open(timeline.to_chrome_trace(str(tmp_path / "t.json"))))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(timeline.events)
    assert {e["tid"] for e in spans} == {0, 1}
    meta = trace["otherData"]
    assert meta["schedule"] == "1f1b"
    assert meta["measured_bubble"] == timeline.measured_bubble
    assert meta["predicted_bubble"] == timeline.predicted_bubble
    assert meta["ideal_bubble"] == timeline.ideal_bubble
    assert meta["overlap_ms"] == timeline.overlap_ms
    assert meta["figures"]["predicted_bubble"].startswith("predicted from measured stage costs")
    assert meta["figures"]["ideal_bubble"].startswith("schedule's ideal with F=1, B=2")
    png = timeline_chart.png(timeline, str(tmp_path / "t.png"))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The library writes the Chrome trace and the scalars; a chart function adds
    # the PNG and TensorBoard's image.
    scalars = {tag: timeline_lib.FIGURES[name] for tag, name in timeline_lib.SCALARS}
    runs = ((None, ["timeline_epoch2.json"]),
            (timeline_chart.png, ["timeline_epoch2.json", "timeline_epoch2.png"]))
    callbacks = [tfpipe.timeline.PipelineTimeline(
        x[:16], y[:16], log_dir=str(tmp_path / str(bool(chart)) / "tl"),
        tensorboard_dir=str(tmp_path / str(bool(chart)) / "tb"), chart=chart)
        for chart, _ in runs]
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=callbacks)
    for (chart, files), callback in zip(runs, callbacks):
        run = tmp_path / str(bool(chart))
        assert [p.rsplit("/", 1)[1] for p in callback.paths] == files
        assert sorted(p.name for p in (run / "tl").iterdir()) == files
        written = {}
        for path in (run / "tb").glob("events.out.tfevents.*"):
            for event in tf.compat.v1.train.summary_iterator(str(path)):
                for value in event.summary.value:
                    written[value.tag] = value.metadata.summary_description
        image = {"pipeline/timeline": callback.timelines[-1].summary()} if chart else {}
        assert written == {**image, **scalars}
    assert sorted(written) == ["pipeline/bubble_measured",
                               "pipeline/bubble_predicted_from_stage_costs",
                               "pipeline/bubble_schedule_ideal_F1_B2",
                               "pipeline/overlap_ms", "pipeline/overlap_predicted_ms",
                               "pipeline/timeline"]


def test_record_step_times_a_ragged_batch_and_leaves_the_model_unchanged():
    # 10 rows for M = 4: micro-batches of 3, 3, 2 and 2 rows.
    model = _model("gpipe")
    x, y = helpers.regression_data(n=10)
    before = [w.numpy() for w in model.weights]
    timeline = tfpipe.timeline.record_step(model, x, y)
    assert len(timeline.events) == 2 * len(model.stages) * 4  # F and B per stage and micro-batch
    for a, b in zip(before, model.weights):
        np.testing.assert_array_equal(a, b.numpy())


_TRANSFORMER_RECORDING = textwrap.dedent("""
    import numpy as np
    import keras
    import tfpipe
    tfpipe.testing.use_logical_cpus(2)
    from models import transformer_lm
    rng = np.random.default_rng(0)
    x = rng.integers(0, 32, size=(8, 16)).astype("int32")
    y = rng.integers(0, 32, size=(8, 16)).astype("int32")
    for schedule, execution in [("gpipe", "unrolled"), ("zbh1", "unrolled"), ("1f1b", "loop")]:
        strategy = tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"], num_microbatches=4,
                                           schedule=schedule, execution=execution)
        with strategy.scope():
            model = tfpipe.PipelinedModel(
                transformer_lm.transformer_stages(2, num_layers=2, width=16, num_heads=2,
                                                  vocab_size=32, seq_len=16),
                input_shape=(None, 16), input_dtype="int32")
            model.compile(optimizer="adam",
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        timeline = tfpipe.timeline.record_step(model, x, y)
        print(schedule, execution, len(timeline.events), flush=True)
""")


@pytest.mark.slow  # about 80 s on 2 cores: three transformer steps traced twice each
def test_recording_after_a_transformer_run_logs_no_grappler_errors():
    # Reported: five "E0000 ... layout failed: INVALID_ARGUMENT: The graph
    # couldn't be sorted in topological order" lines after the transformer run.
    # (test_packaging's clean-stderr run checks the MLP main job, timeline included.)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", _TRANSFORMER_RECORDING], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["gpipe unrolled 16", "zbh1 unrolled 24",
                                           "1f1b loop 16"]
    errors = [line for line in proc.stderr.splitlines()
              if line.startswith("E0000") or "layout failed" in line]
    assert errors == []
