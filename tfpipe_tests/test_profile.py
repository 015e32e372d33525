"""A measured timeline of one real step: order, files, and no side effects."""

import json

import keras
import numpy as np
import pytest

import tfpipe
from tfpipe import schedules
from tfpipe_tests import helpers


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


@pytest.mark.parametrize("schedule, execution", [
    ("gpipe", "unrolled"), ("1f1b", "unrolled"), (schedules.Interleaved(2), "unrolled"),
    ("zbh1", "unrolled"), ("zbv", "unrolled"),
    # The loop form stamps its actions too (no barrier between ticks).
    ("1f1b", "loop"), ("zbh1", "loop"), ("zbv", "loop")])
def test_record_step_follows_the_schedule_and_changes_nothing(schedule, execution):
    model = _model(schedule, execution)
    x, y = helpers.regression_data(n=16)
    before = [v.numpy() for v in model.variables]
    timeline = tfpipe.profile.record_step(model, x, y)
    assert helpers.max_abs_diff(before, [v.numpy() for v in model.variables]) == 0.0

    m, d, k = 4, 2, len(model.stages)
    table = model.schedule.actions(m, d)
    actions = {a for row in table for a in row}
    assert len(timeline.events) == len(actions)
    finished = {}
    for dev in range(d):
        mine = sorted((e for e in timeline.events if e.device == dev), key=lambda e: e.start_ms)
        # Each device ran exactly its row of the table, in order, one at a time.
        assert [e.name for e in mine] == [str(a) for a in table[dev]]
        for prev, cur in zip(mine, mine[1:]):
            assert cur.start_ms >= prev.end_ms
        finished.update({e.name: e for e in mine})
    for e in timeline.events:  # and after its inputs
        action = schedules.Action(e.kind, e.stage, e.microbatch)
        for dep in schedules.KINDS[e.kind].dependencies(action, k, actions):
            assert e.start_ms >= finished[str(dep)].end_ms, (e.name, str(dep))
    assert 0.0 <= timeline.measured_bubble < 1.0
    assert 0.0 <= timeline.simulated_bubble < 1.0
    assert timeline.ideal_bubble == pytest.approx(
        schedules.simulate(model.schedule, m, d).bubble_fraction)


def test_chrome_trace_png_and_callback(tmp_path):
    model = _model("1f1b")
    x, y = helpers.regression_data(n=32)
    timeline = tfpipe.profile.record_step(model, x[:16], y[:16])
    trace = json.load(open(timeline.to_chrome_trace(str(tmp_path / "t.json"))))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(timeline.events)
    assert {e["tid"] for e in spans} == {0, 1}
    assert trace["otherData"]["schedule"] == "1f1b"
    assert timeline.plot(str(tmp_path / "t.png"))[:8] == b"\x89PNG\r\n\x1a\n"

    callback = tfpipe.profile.PipelineTimeline(x[:16], y[:16], log_dir=str(tmp_path / "tl"),
                                               tensorboard_dir=str(tmp_path / "tb"))
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[callback])
    assert [p.rsplit("/", 1)[1] for p in callback.paths] == ["timeline_epoch2.json",
                                                             "timeline_epoch2.png"]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_record_step_times_a_ragged_batch_and_leaves_the_model_unchanged():
    # 10 rows for M = 4: micro-batches of 3, 3, 2 and 2 rows.
    model = _model("gpipe")
    x, y = helpers.regression_data(n=10)
    before = [w.numpy() for w in model.weights]
    timeline = tfpipe.profile.record_step(model, x, y)
    assert len(timeline.events) == 2 * len(model.stages) * 4  # F and B per stage and micro-batch
    for a, b in zip(before, model.weights):
        np.testing.assert_array_equal(a, b.numpy())
