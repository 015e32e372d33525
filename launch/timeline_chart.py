"""The Gantt chart of a measured pipeline step (`tfpipe.timeline.Timeline`),
drawn with matplotlib: the trainer's `--timeline` PNG and TensorBoard image
(`tfpipe.timeline.PipelineTimeline(..., chart=png)`)."""

import io

from matplotlib import colors
from matplotlib import figure as mpl_figure
from matplotlib import patches
from matplotlib.backends import backend_agg

from tfpipe import actions

# Bar colours per action kind, and the text colour that reads on each.
COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#8c8c8c"}
_DPI = 110


def figure(timeline):
    """The Gantt chart of a `tfpipe.timeline.Timeline` as a matplotlib
    `Figure` (Agg canvas, no pyplot): a row per device, a bar per action
    coloured by kind, the figures in a caption, and a bar's label ("B0.2")
    only where it fits."""
    d_count = len(timeline.devices)
    title = (f"{timeline.schedule}, M={timeline.num_microbatches}, {d_count} device(s): one "
             f"measured training step, {timeline.span_ms:.2f} ms"
             + (" (all devices at once)" if d_count > 1 else ""))
    overlap = timeline.overlap_text()
    caption = [
        f"Bubble: measured {timeline.measured_bubble:.1%} (idle share of the devices over the "
        f"span); predicted from measured stage costs {timeline.predicted_bubble:.1%} (the "
        f"schedule simulated with these F/B/I/W times);",
        f"schedule's ideal with F=1, B=2: {timeline.ideal_bubble:.1%} (the schedule alone). "
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
    span_end = max((e.end_ms for e in timeline.events), default=1.0)
    ax.set_xlim(0, span_end if span_end > 0 else 1.0)
    ax.set_ylim(d_count - 0.5, -0.5)  # device 0 on top
    ax.set_yticks(range(d_count))
    ax.set_yticklabels([f"device {d}" for d in range(d_count)], fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_xlabel("time in the step (ms)", fontsize=8)
    for d in range(d_count):
        for kind, colour in COLOURS.items():
            bars = [(e.start_ms, max(e.end_ms - e.start_ms, 1e-9)) for e in timeline.events
                    if e.device == d and e.kind == kind]
            if bars:
                ax.broken_barh(bars, (d - 0.4, 0.8), facecolors=colour,
                               edgecolor="white", linewidth=0.5)
    kinds = sorted({e.kind for e in timeline.events}, key="FBIW".index)
    axes_height = height * ax.get_position().height  # inches
    ax.legend(handles=[patches.Patch(facecolor=COLOURS[k],
                                     label=f"{k}: {actions.KINDS[k].description}")
                       for k in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -axis / axes_height),
              ncol=len(kinds), fontsize=8, frameon=False)
    for i, text in enumerate(caption):
        fig.text(0.01, (line * (len(caption) - i - 1) + 0.06) / height, text,
                 fontsize=7.5, va="bottom")
    _label_bars(timeline, fig, ax)
    return fig

def _label_bars(timeline, fig, ax):
    """Adds each bar's label if its rendered extent fits inside the bar."""
    renderer = fig.canvas.get_renderer()
    pad = 2.0  # pixels kept free on each side
    for e in timeline.events:
        (x0, y0), (x1, y1) = ax.transData.transform(
            [(e.start_ms, e.device - 0.4), (e.end_ms, e.device + 0.4)])
        width, height = abs(x1 - x0), abs(y1 - y0)
        if width < 2 * pad + 4:  # no character fits: skip the measuring
            continue
        text = ax.text((e.start_ms + e.end_ms) / 2, e.device, e.name, ha="center",
                       va="center", fontsize=7, color=text_colour(COLOURS[e.kind]))
        extent = text.get_window_extent(renderer)
        if extent.width > width - 2 * pad or extent.height > height - pad:
            text.remove()

def png(timeline, path=None):
    """The Gantt chart (`figure`) as PNG bytes; writes `path` if given."""
    buffer = io.BytesIO()
    figure(timeline).savefig(buffer, format="png", dpi=_DPI)
    data = buffer.getvalue()
    if path is not None:
        with open(path, "wb") as f:
            f.write(data)
    return data


def text_colour(background):
    """"#111111" or "white", whichever has the higher WCAG contrast on the
    colour `background` (a matplotlib colour)."""
    def luminance(colour):
        channels = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
                    for c in colors.to_rgb(colour)]
        return 0.2126 * channels[0] + 0.7152 * channels[1] + 0.0722 * channels[2]

    def contrast(a, b):
        high, low = sorted((luminance(a), luminance(b)), reverse=True)
        return (high + 0.05) / (low + 0.05)

    return max(("#111111", "white"), key=lambda c: contrast(c, background))
