"""A measured pipeline timeline: when each stage ran in one real training step.

`record_step(model, x, y)` runs one training step's forward and backward
through the model's schedule with a `tf.timestamp()` taken as each action
starts (its inputs exist and its device finished the previous action) and
ends (its outputs exist). The result is a `Timeline`: per device, the actions
with start and end times in milliseconds, the measured bubble fraction, and
the bubble the schedule simulator predicts for the measured per-stage costs.
It writes a Chrome trace (`chrome://tracing`, Perfetto) and a PNG Gantt chart.

`PipelineTimeline` is a Keras callback doing the same at the end of `fit`
(or every N epochs), into files and TensorBoard.

Timestamps are host times: exact on CPU devices; on GPUs they mark when the
executor saw the kernels' inputs and outputs, not when the kernels ran (use
the TensorFlow profiler there).
"""

import dataclasses
import io
import json
import os

import keras
import tensorflow as tf

from tfpipe import engine
from tfpipe import loss as loss_lib
from tfpipe import schedules


@dataclasses.dataclass
class Event:
    """One action: `kind` ("F", "B", "I" or "W", `schedules.KINDS`) of
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
      measured_bubble: 1 - busy / (D * span), from the measured times.
      simulated_bubble: what `schedules.simulate` predicts for this schedule
        with each stage's measured mean F and B durations.
      ideal_bubble: the simulator with F = 1, B = 2 for every device.
    """

    events: list
    devices: list
    schedule: str
    num_microbatches: int
    measured_bubble: float
    simulated_bubble: float
    ideal_bubble: float

    @property
    def span_ms(self):
        return max(e.end_ms for e in self.events) - min(e.start_ms for e in self.events)

    def to_chrome_trace(self, path):
        """Writes a Chrome trace JSON (one row per device); returns `path`."""
        trace = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": d,
                  "args": {"name": f"device {d}: {name}"}}
                 for d, name in enumerate(self.devices)]
        for e in self.events:
            trace.append({
                "name": e.name, "cat": schedules.KINDS[e.kind].description,
                "ph": "X", "pid": 0, "tid": e.device,
                "ts": e.start_ms * 1e3, "dur": max(e.end_ms - e.start_ms, 0.0) * 1e3,
                "args": {"stage": e.stage, "microbatch": e.microbatch},
            })
        meta = {"schedule": self.schedule, "num_microbatches": self.num_microbatches,
                "measured_bubble": self.measured_bubble,
                "simulated_bubble": self.simulated_bubble}
        with open(path, "w") as f:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms", "otherData": meta}, f)
        return path

    def plot(self, path=None):
        """A Gantt chart (PNG). Writes `path` if given; returns the PNG bytes."""
        try:  # an extra: the library itself needs only TensorFlow and Keras
            import matplotlib  # pylint: disable=import-outside-toplevel
        except ImportError as err:
            raise ImportError("Timeline.plot draws with matplotlib, which is not installed: "
                              "pip install 'tfpipe[plot]' (or matplotlib)") from err
        matplotlib.use("Agg")
        from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel

        d_count = len(self.devices)
        fig, ax = plt.subplots(figsize=(10, 0.6 * d_count + 1.6))
        colours = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#8c8c8c"}
        for kind in sorted({e.kind for e in self.events}, key="FBIW".index):
            ax.broken_barh([], (0, 0), facecolors=colours[kind],
                           label=f"{kind}: {schedules.KINDS[kind].description}")
        for e in self.events:
            width = max(e.end_ms - e.start_ms, 1e-6)
            ax.broken_barh([(e.start_ms, width)], (e.device - 0.4, 0.8),
                           facecolors=colours[e.kind], edgecolor="white", linewidth=0.5)
            if width > self.span_ms / 60:
                ax.text(e.start_ms + width / 2, e.device, e.name, ha="center",
                        va="center", fontsize=7, color="white")
        ax.set_yticks(range(d_count))
        ax.set_yticklabels([f"device {d}" for d in range(d_count)])
        ax.invert_yaxis()
        ax.legend(loc="upper right", fontsize=7, ncol=4)
        ax.set_xlabel("time in the step (ms)")
        ax.set_title(
            f"{self.schedule}, M={self.num_microbatches}: bubble measured "
            f"{self.measured_bubble:.1%}, simulated {self.simulated_bubble:.1%} "
            f"(F=1, B=2: {self.ideal_bubble:.1%})", fontsize=9)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=110)
        plt.close(fig)
        data = buffer.getvalue()
        if path is not None:
            with open(path, "wb") as f:
                f.write(data)
        return data


def _stage_costs(events, num_stages, kind):
    costs = []
    for k in range(num_stages):
        durations = [e.end_ms - e.start_ms for e in events if e.stage == k and e.kind == kind]
        costs.append(sum(durations) / len(durations) if durations else 0.0)
    return costs


def record_step(model, x, y=None, sample_weight=None, repeats=2):
    """Runs and times one training step of a compiled `PipelinedModel`.

    The forward and backward run exactly as in `fit` (same schedule, devices,
    recompute and execution: both backends stamp each action), but no
    optimizer update is applied, and all
    non-trainable state (BatchNorm statistics, RNG seeds) is restored after,
    so the model is unchanged.

    Args:
      model: a built, compiled `tfpipe.PipelinedModel`.
      x, y, sample_weight: one batch (arrays or tensors), its size a multiple
        of the model's num_microbatches.
      repeats: runs of the step; the first traces the graph, the last is kept.
    Returns:
      A `Timeline`.
    """
    if not getattr(model, "compiled", False) or not model.built:
        raise ValueError("record_step needs a built, compiled PipelinedModel "
                         "(call model.compile and model.build or fit first).")
    model._check_batch(int(tf.nest.flatten(x)[0].shape[0]), None, "record_step")  # pylint: disable=protected-access
    pipeline = engine.Pipeline(model.stages, model.pipeline_devices, model.pipeline_config)
    state = list(model.non_trainable_variables)
    meta = []  # filled once, when the step is traced: what each timestamp pair is

    @tf.function(jit_compile=False)
    def step(data):
        saved = [tf.identity(v.value) for v in state]
        batch = model._batch(data)  # pylint: disable=protected-access
        events = []
        result = pipeline.train(batch, loss_lib.LossSplit(model._compile_loss),  # pylint: disable=protected-access
                                timeline=events)
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
    forward = _stage_costs(events, k_count, "F")
    weight = _stage_costs(events, k_count, "W")
    # A split backward's cost is its I plus its W.
    backward = [b + i + w for b, i, w in zip(_stage_costs(events, k_count, "B"),
                                             _stage_costs(events, k_count, "I"), weight)]
    m_count = model.num_microbatches
    simulated = schedules.simulate(model.schedule, m_count, d_count, forward, backward,
                                   weight_cost=weight)
    ideal = schedules.simulate(model.schedule, m_count, d_count)
    return Timeline(events, list(model.pipeline_devices), model.schedule.name, m_count,
                    1.0 - busy / (d_count * span) if span else 0.0,
                    simulated.bubble_fraction, ideal.bubble_fraction)


class PipelineTimeline(keras.callbacks.Callback):
    """Records a `Timeline` of one step on a fixed batch during `fit`.

    Writes `timeline_epoch{E}.json` (Chrome trace) and `.png` into `log_dir`,
    and, if `tensorboard_dir` is given, the PNG as an image and the measured
    and simulated bubble as scalars ("pipeline/...") at step E.

    Args:
      x, y, sample_weight: the batch to time (a multiple of M rows).
      log_dir: folder for the trace and chart.
      every_n_epochs: record after every N-th epoch; 0 records only when
        training ends.
      tensorboard_dir: optional TensorBoard log folder.

    >>> cb = PipelineTimeline(x[:64], y[:64], "/tmp/run")   # doctest: +SKIP
    >>> model.fit(x, y, batch_size=64, callbacks=[cb])       # doctest: +SKIP
    """

    def __init__(self, x, y=None, log_dir=".", sample_weight=None, every_n_epochs=0,
                 tensorboard_dir=None):
        super().__init__()
        self._batch = (x, y, sample_weight)
        self.log_dir = log_dir
        self.every_n_epochs = every_n_epochs
        self.tensorboard_dir = tensorboard_dir
        self.timelines = []
        self.paths = []
        self._epochs = 0

    def _record(self, epoch):
        timeline = record_step(self.model, *self._batch)
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
                tf.summary.image("pipeline/timeline", image, step=epoch)
                tf.summary.scalar("pipeline/bubble_measured", timeline.measured_bubble,
                                  step=epoch)
                tf.summary.scalar("pipeline/bubble_simulated", timeline.simulated_bubble,
                                  step=epoch)
            writer.flush()

    def on_epoch_end(self, epoch, logs=None):
        self._epochs = epoch + 1
        if self.every_n_epochs and (epoch + 1) % self.every_n_epochs == 0:
            self._record(epoch + 1)

    def on_train_end(self, logs=None):
        if not self.every_n_epochs:
            self._record(self._epochs)
