"""A measured pipeline timeline: when each action ran in one real training step.

`record_step(model, x, y)` runs one training step as `fit` runs it and stamps
each action inside the running step (`tf.timestamp()`, host clock) when it
starts and ends; the stamps are not chained to each other
(`_internal.unordered_timestamp`), so two devices' actions overlap exactly
when they ran at once. A `Timeline` holds the figures (`FIGURES`) and writes a
Chrome trace (chrome://tracing or Perfetto draws it as a Gantt chart);
`PipelineTimeline` records one during `fit`. (`launch.timeline_chart` draws
a PNG Gantt chart with matplotlib, for the trainer; the library needs none.)
On GPUs the stamps mark when the executor saw the kernels' inputs and
outputs, not when the kernels ran (use the TensorFlow profiler there).
"""

import dataclasses
import json
import os

import keras
import tensorflow as tf

from tfpipe import actions
from tfpipe import schedules

# What each figure means, in the words the chart, the Chrome trace and
# TensorBoard show (keys: the `Timeline` attributes).
FIGURES = {
    "measured_bubble": "measured bubble: idle share of the D devices over the step's span, "
        "1 - (sum of all action times) / (D x span), from timestamps taken in the running step",
    "predicted_bubble": "predicted from measured stage costs: the schedule simulated with "
        "each stage's mean measured F, B, I, W times (no transfers, no contention, no "
        "scheduling delays)",
    "ideal_bubble": "schedule's ideal with F=1, B=2: the schedule's own bubble with F = 1, "
        "B = 2 (I = W = 1) on every stage; depends only on the schedule, M and D",
    "overlap_ms": "overlap: milliseconds during which two or more devices had an action running",
    "predicted_overlap_ms": "predicted overlap: the same in the step simulated from measured "
        "stage costs (0: the schedule never runs two devices at once)",
}



@dataclasses.dataclass
class Event:
    """One action: `kind` ("F", "B", "I" or "W", `actions.KINDS`) of
    `stage` on `microbatch`, on `device`."""

    device: int
    kind: str
    stage: int
    microbatch: int
    start_ms: float
    end_ms: float

    @property
    def name(self):
        return f"{self.kind}{self.stage}.{self.microbatch}"


@dataclasses.dataclass
class Timeline:
    """A measured step. Times in milliseconds from the step's first start.

    Attributes:
      events: every action, in start order.
      devices: the D device names.
      schedule: the schedule's name; num_microbatches: M.
      measured_bubble, predicted_bubble, ideal_bubble, predicted_overlap_ms:
        the figures, as `FIGURES` explains them.
    """

    events: list
    devices: list
    schedule: str
    num_microbatches: int
    measured_bubble: float
    predicted_bubble: float
    ideal_bubble: float
    predicted_overlap_ms: float = 0.0

    @property
    def span_ms(self):
        return max(e.end_ms for e in self.events) - min(e.start_ms for e in self.events)

    @property
    def overlap_ms(self):
        """Milliseconds during which two or more devices had an action running."""
        per_device = [[] for _ in self.devices]
        for e in self.events:
            per_device[e.device].append((e.start_ms, e.end_ms))
        return overlap_ms(per_device)

    def summary(self):
        """The figures in one line (the trainer prints it)."""
        return (f"measured bubble {self.measured_bubble:.1%}; predicted from measured stage "
                f"costs {self.predicted_bubble:.1%}; schedule's ideal with F=1, B=2: "
                f"{self.ideal_bubble:.1%}; {self.overlap_text()}")

    def overlap_text(self):
        if len(self.devices) < 2:
            return "overlap: none possible (one device)"
        if self.predicted_overlap_ms <= 0.0:
            # (A backward may still start on its input gradient while the next
            # stage computes its weight gradients: the measured figure stays.)
            return (f"overlap {self.overlap_ms:.1f} ms, none predicted: this schedule runs "
                    f"one action at a time with M={self.num_microbatches}")
        return (f"overlap (2+ devices busy) {self.overlap_ms:.1f} of {self.span_ms:.1f} ms, "
                f"predicted {self.predicted_overlap_ms:.1f} ms")

    def metadata(self):
        """The figures and what each means (a JSON-ready dict)."""
        return {"schedule": self.schedule, "num_microbatches": self.num_microbatches,
                "devices": list(self.devices), "span_ms": self.span_ms,
                "measured_bubble": self.measured_bubble, "predicted_bubble": self.predicted_bubble,
                "ideal_bubble": self.ideal_bubble, "overlap_ms": self.overlap_ms,
                "predicted_overlap_ms": self.predicted_overlap_ms,
                "summary": self.summary(), "figures": dict(FIGURES)}

    def to_chrome_trace(self, path):
        """Writes a Chrome trace JSON (one row per device, `metadata()` in
        `otherData`); returns `path`."""
        trace = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": d,
                  "args": {"name": f"device {d}: {name}"}}
                 for d, name in enumerate(self.devices)]
        for e in self.events:
            trace.append({
                "name": e.name, "cat": actions.KINDS[e.kind].description,
                "ph": "X", "pid": 0, "tid": e.device,
                "ts": e.start_ms * 1e3, "dur": max(e.end_ms - e.start_ms, 0.0) * 1e3,
                "args": {"stage": e.stage, "microbatch": e.microbatch},
            })
        with open(path, "w") as f:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms",
                       "otherData": self.metadata()}, f)
        return path


def overlap_ms(intervals):
    """Time covered by two or more of the D lists of (start, end) intervals
    (one list per device; a device's own intervals are merged first)."""
    points = []
    for device in intervals:
        merged = []
        for start, end in sorted(device):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            elif end > start:
                merged.append([start, end])
        for start, end in merged:
            points += [(start, 1), (end, -1)]
    total, busy, previous = 0.0, 0, None
    for time, change in sorted(points):  # at a tie, an end (-1) before a start
        if busy >= 2:
            total += time - previous
        busy += change
        previous = time
    return total


def stage_costs(events, num_stages):
    """Each stage's mean measured (forward, backward, weight) ms from a
    `Timeline`'s events: lists of K floats, as `schedules.simulate` takes them
    (backward is B, or I + W; weight is W, 0.0 where none)."""
    def mean(kind):
        costs = []
        for k in range(num_stages):
            durations = [e.end_ms - e.start_ms for e in events if e.stage == k and e.kind == kind]
            costs.append(sum(durations) / len(durations) if durations else 0.0)
        return costs

    forward, weight = mean("F"), mean("W")
    backward = [b + i + w for b, i, w in zip(mean("B"), mean("I"), weight)]
    return forward, backward, weight


def record_step(model, x, y=None, sample_weight=None, repeats=2):
    """Runs and times one training step of a compiled `PipelinedModel` as
    `fit` runs it, but applies no update and restores all non-trainable state.

    `x, y, sample_weight`: one batch, a multiple of M rows; `repeats`: runs
    of the step (the first traces; the last is kept). Returns a `Timeline`.
    """
    if not getattr(model, "compiled", False) or not model.built:
        raise ValueError("record_step needs a built, compiled PipelinedModel "
                         "(call model.compile and model.build or fit first).")
    if model.pipeline_host.timing_refusal is not None:
        raise ValueError(f"record_step({model.name!r}): {model.pipeline_host.timing_refusal}")
    model.check_batch_size(None, int(tf.nest.flatten(x)[0].shape[0]), "record_step")
    # The model's own pipeline: its trace options (a benchmark's one stream
    # per device, `serialize_ops`) apply to the recording too.
    pipeline = model.pipeline
    state = list(model.non_trainable_variables)
    meta = []  # filled once, when the step is traced: what each timestamp pair is

    @tf.function(jit_compile=False)
    def step(data):
        saved = [tf.identity(v.value) for v in state]
        events = []
        result = pipeline.train(model.split_batch(data), model.loss_split(), timeline=events)
        with tf.control_dependencies([e["end"] for e in events] + [result.loss]):
            for var, value in zip(state, saved):
                var.assign(value)
            starts = tf.stack([e["start"] for e in events])
            ends = tf.stack([e["end"] for e in events])
        meta[:] = [{key: e[key] for key in ("device", "kind", "stage", "microbatch")}
                   for e in events]
        # Returned so that they are computed: Grappler prunes work that only
        # control dependencies (the timestamps) wait for.
        return starts, ends, (result.y_pred, result.loss,
                              [g for g in result.grads if g is not None])

    data = (x,) if y is None else ((x, y) if sample_weight is None else (x, y, sample_weight))
    data = tf.nest.map_structure(tf.convert_to_tensor, data)
    starts = ends = None
    for _ in range(max(1, repeats)):
        starts, ends, _ = step(data)
    t0 = float(tf.reduce_min(starts))
    events = sorted(
        (Event(int(m["device"]), m["kind"], int(m["stage"]), int(m["microbatch"]),
               (float(s) - t0) * 1e3, (float(e) - t0) * 1e3)
         for m, s, e in zip(meta, starts.numpy(), ends.numpy())),
        key=lambda e: (e.start_ms, e.device))
    d_count, k_count = len(model.pipeline_devices), len(model.stages)
    span = max(e.end_ms for e in events)
    busy = sum(e.end_ms - e.start_ms for e in events)
    forward, backward, weight = stage_costs(events, k_count)
    m_count = model.num_microbatches
    predicted = schedules.simulate(model.schedule, m_count, d_count, forward, backward,
                                   weight_cost=weight)
    ideal = schedules.simulate(model.schedule, m_count, d_count)
    predicted_overlap = overlap_ms([[(s, e) for _, s, e in row] for row in predicted.timeline])
    return Timeline(events, [str(d) for d in model.pipeline_devices], model.schedule.name, m_count,
                    measured_bubble=1.0 - busy / (d_count * span) if span else 0.0,
                    predicted_bubble=predicted.bubble_fraction,
                    ideal_bubble=ideal.bubble_fraction,
                    predicted_overlap_ms=predicted_overlap)


# TensorBoard scalars: (tag, Timeline attribute).
SCALARS = (("pipeline/bubble_measured", "measured_bubble"),
           ("pipeline/bubble_predicted_from_stage_costs", "predicted_bubble"),
           ("pipeline/bubble_schedule_ideal_F1_B2", "ideal_bubble"),
           ("pipeline/overlap_ms", "overlap_ms"),
           ("pipeline/overlap_predicted_ms", "predicted_overlap_ms"))


class PipelineTimeline(keras.callbacks.Callback):
    """Records a `Timeline` of one step on the batch `x, y, sample_weight` (a
    multiple of M rows) after every `every_n_epochs`-th epoch, or only when
    training ends (0), into `timeline_epoch{E}.json` (Chrome trace) in
    `log_dir`, and, with `tensorboard_dir`, the figures as scalars
    (`SCALARS`) at step E. With `chart`, a function of a `Timeline` that
    returns PNG bytes (`launch.timeline_chart.png`), also
    `timeline_epoch{E}.png` and that image in TensorBoard ("pipeline/timeline").

    >>> cb = PipelineTimeline(x[:64], y[:64], "/tmp/run")   # doctest: +SKIP
    >>> model.fit(x, y, batch_size=64, callbacks=[cb])       # doctest: +SKIP
    """

    def __init__(self, x, y=None, log_dir=".", sample_weight=None, every_n_epochs=0,
                 tensorboard_dir=None, chart=None):
        super().__init__()
        self._timed_batch = (x, y, sample_weight)
        self.log_dir = log_dir
        self.every_n_epochs = every_n_epochs
        self.tensorboard_dir = tensorboard_dir
        self.chart = chart
        self.timelines = []
        self.paths = []
        self._epochs = 0

    def record(self, epoch):
        """Times one step now and writes its files (as at the end of `epoch`)."""
        timeline = record_step(self.model, *self._timed_batch)
        os.makedirs(self.log_dir, exist_ok=True)
        stem = os.path.join(self.log_dir, f"timeline_epoch{epoch}")
        self.paths.append(timeline.to_chrome_trace(stem + ".json"))
        png = None
        if self.chart is not None:
            png = self.chart(timeline)
            with open(stem + ".png", "wb") as f:
                f.write(png)
            self.paths.append(stem + ".png")
        self.timelines.append(timeline)
        if self.tensorboard_dir:
            writer = tf.summary.create_file_writer(self.tensorboard_dir)
            with writer.as_default():
                if png is not None:
                    image = tf.image.decode_png(png, channels=4)[tf.newaxis]
                    tf.summary.image("pipeline/timeline", image, step=epoch,
                                     description=timeline.summary())
                for tag, attribute in SCALARS:
                    tf.summary.scalar(tag, getattr(timeline, attribute), step=epoch,
                                      description=FIGURES[attribute])
            writer.flush()

    def on_epoch_end(self, epoch, logs=None):
        self._epochs = epoch + 1
        if self.every_n_epochs and (epoch + 1) % self.every_n_epochs == 0:
            self.record(epoch + 1)

    def on_train_end(self, logs=None):
        if not self.every_n_epochs:
            self.record(self._epochs)
