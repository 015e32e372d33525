"""A measured pipeline timeline: when each action ran in one real training step.

`record_step(model, x, y)` runs one training step as `fit` runs it and stamps
each action inside the running step (`tf.timestamp()`, host clock) when it
starts and ends; the stamps are not chained to each other
(`_internal.unordered_timestamp`), so two devices' actions overlap exactly
when they ran at once. A `Timeline` holds the figures (`FIGURES`) and draws a
Chrome trace and a Gantt chart; `PipelineTimeline` records one during `fit`.
On GPUs the stamps mark when the executor saw the kernels' inputs and
outputs, not when the kernels ran (use the TensorFlow profiler there).
"""

import dataclasses
import io
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

# Bar colours per action kind, and the text colour that reads on each.
_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#8c8c8c"}
_DPI = 110


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
                f"{self.ideal_bubble:.1%}; {self._overlap_text()}")

    def _overlap_text(self):
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

    def figure(self):
        """The Gantt chart as a matplotlib `Figure` (Agg canvas, no pyplot): a
        row per device, a bar per action coloured by kind, the figures in a
        caption, and a bar's label ("B0.2") only where it fits."""
        try:  # an extra: the library itself needs only TensorFlow and Keras
            # pylint: disable=import-outside-toplevel
            from matplotlib import figure as mpl_figure
            from matplotlib import patches
            from matplotlib.backends import backend_agg
        except ImportError as err:
            raise ImportError("Timeline.plot draws with matplotlib, which is not installed: "
                              "pip install 'tfpipe[plot]' (or matplotlib)") from err

        d_count = len(self.devices)
        title = (f"{self.schedule}, M={self.num_microbatches}, {d_count} device(s): one "
                 f"measured training step, {self.span_ms:.2f} ms"
                 + (" (all devices at once)" if d_count > 1 else ""))
        overlap = self._overlap_text()
        caption = [
            f"Bubble: measured {self.measured_bubble:.1%} (idle share of the devices over the "
            f"span); predicted from measured stage costs {self.predicted_bubble:.1%} (the "
            f"schedule simulated with these F/B/I/W times);",
            f"schedule's ideal with F=1, B=2: {self.ideal_bubble:.1%} (the schedule alone). "
            f"{overlap[0].upper() + overlap[1:]}.",
            "A bar runs from the action's start (inputs ready, device free) to its outputs "
            "existing (host clock). Labels: kind stage.micro-batch, drawn where they fit.",
        ]
        # Inches: title, rows, x axis, legend, caption lines.
        top, row, axis, legend, line = 0.35, 0.55, 0.42, 0.3, 0.17
        below = axis + legend + line * len(caption) + 0.08
        height = top + max(row * d_count, 1.0) + below
        fig = mpl_figure.Figure(figsize=(10, height), dpi=_DPI)
        backend_agg.FigureCanvasAgg(fig)
        ax = fig.add_axes((0.1, below / height, 0.88, 1 - (below + top) / height))
        ax.set_title(title, fontsize=9)
        span_end = max((e.end_ms for e in self.events), default=1.0)
        ax.set_xlim(0, span_end if span_end > 0 else 1.0)
        ax.set_ylim(d_count - 0.5, -0.5)  # device 0 on top
        ax.set_yticks(range(d_count))
        ax.set_yticklabels([f"device {d}" for d in range(d_count)], fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_xlabel("time in the step (ms)", fontsize=8)
        for d in range(d_count):
            for kind, colour in _COLOURS.items():
                bars = [(e.start_ms, max(e.end_ms - e.start_ms, 1e-9)) for e in self.events
                        if e.device == d and e.kind == kind]
                if bars:
                    ax.broken_barh(bars, (d - 0.4, 0.8), facecolors=colour,
                                   edgecolor="white", linewidth=0.5)
        kinds = sorted({e.kind for e in self.events}, key="FBIW".index)
        axes_height = height * ax.get_position().height  # inches
        ax.legend(handles=[patches.Patch(facecolor=_COLOURS[k],
                                         label=f"{k}: {actions.KINDS[k].description}")
                           for k in kinds],
                  loc="upper center", bbox_to_anchor=(0.5, -axis / axes_height),
                  ncol=len(kinds), fontsize=8, frameon=False)
        for i, text in enumerate(caption):
            fig.text(0.01, (line * (len(caption) - i - 1) + 0.06) / height, text,
                     fontsize=7.5, va="bottom")
        self._label_bars(fig, ax)
        return fig

    def _label_bars(self, fig, ax):
        """Adds each bar's label if its rendered extent fits inside the bar."""
        renderer = fig.canvas.get_renderer()
        pad = 2.0  # pixels kept free on each side
        for e in self.events:
            (x0, y0), (x1, y1) = ax.transData.transform(
                [(e.start_ms, e.device - 0.4), (e.end_ms, e.device + 0.4)])
            width, height = abs(x1 - x0), abs(y1 - y0)
            if width < 2 * pad + 4:  # no character fits: skip the measuring
                continue
            text = ax.text((e.start_ms + e.end_ms) / 2, e.device, e.name, ha="center",
                           va="center", fontsize=7, color=text_colour(_COLOURS[e.kind]))
            extent = text.get_window_extent(renderer)
            if extent.width > width - 2 * pad or extent.height > height - pad:
                text.remove()

    def plot(self, path=None):
        """The Gantt chart (`figure()`) as PNG bytes; writes `path` if given."""
        buffer = io.BytesIO()
        self.figure().savefig(buffer, format="png", dpi=_DPI)
        data = buffer.getvalue()
        if path is not None:
            with open(path, "wb") as f:
                f.write(data)
        return data


def text_colour(background):
    """"#111111" or "white", whichever has the higher WCAG contrast on the
    colour `background` (a matplotlib colour)."""
    from matplotlib import colors  # pylint: disable=import-outside-toplevel

    def luminance(colour):
        channels = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
                    for c in colors.to_rgb(colour)]
        return 0.2126 * channels[0] + 0.7152 * channels[1] + 0.0722 * channels[2]

    def contrast(a, b):
        high, low = sorted((luminance(a), luminance(b)), reverse=True)
        return (high + 0.05) / (low + 0.05)

    return max(("#111111", "white"), key=lambda c: contrast(c, background))


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
    training ends (0), into `timeline_epoch{E}.json` (Chrome trace) and `.png`
    in `log_dir`, and, with `tensorboard_dir`, the PNG as an image
    ("pipeline/timeline") and the figures as scalars (`SCALARS`) at step E.

    >>> cb = PipelineTimeline(x[:64], y[:64], "/tmp/run")   # doctest: +SKIP
    >>> model.fit(x, y, batch_size=64, callbacks=[cb])       # doctest: +SKIP
    """

    def __init__(self, x, y=None, log_dir=".", sample_weight=None, every_n_epochs=0,
                 tensorboard_dir=None):
        super().__init__()
        self._timed_batch = (x, y, sample_weight)
        self.log_dir = log_dir
        self.every_n_epochs = every_n_epochs
        self.tensorboard_dir = tensorboard_dir
        self.timelines = []
        self.paths = []
        self._epochs = 0

    def record(self, epoch):
        """Times one step now and writes its files (as at the end of `epoch`)."""
        timeline = record_step(self.model, *self._timed_batch)
        os.makedirs(self.log_dir, exist_ok=True)
        stem = os.path.join(self.log_dir, f"timeline_epoch{epoch}")
        timeline.to_chrome_trace(stem + ".json")
        png = timeline.plot(stem + ".png")
        self.timelines.append(timeline)
        self.paths += [stem + ".json", stem + ".png"]
        if self.tensorboard_dir:
            writer = tf.summary.create_file_writer(self.tensorboard_dir)
            with writer.as_default():
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
