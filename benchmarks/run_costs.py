"""What launch.train's bookkeeping costs as a run grows: `python -m benchmarks.run_costs`.

For a run that has recorded N steps (a checkpoint every `--every` steps, as
the trainer writes them: history segments, TensorBoard files, a checkpoint
of the main job's 59,146 parameters), it times, in seconds:

  save          one checkpoint save (`CheckpointStore.save`: the history
                segment of the last `--every` steps, the variables, the
                manifest, rotation) and the TensorBoard rotation after it
  resume        what `--resume` does before its first step: read the record
                of what the run wrote (`launch.outputs.Record`), find and
                verify the newest checkpoint (its whole history chain read
                and checked), restore the history, trim the TensorBoard
                logs, the epoch means
  end           the end of the run: history.json and loss.png
  whole history the old design's per-save cost: the whole history
                serialised and hashed into every manifest (measured here on
                the same history, for the ratio)

Only the TensorBoard files a resume can touch are written (the last
`steps_per_file` + `--every` steps); older ones are never read at a resume.

    python -m benchmarks.run_costs                        # N = 10k, 100k, 300k; ~2 min
    python -m benchmarks.run_costs --steps=300000 --every=100
"""

import os
import pathlib
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

from launch import checkpoints  # noqa: E402
from launch import history as history_lib  # noqa: E402
from launch import outputs  # noqa: E402
from launch import segments  # noqa: E402
from launch.files import canonical  # noqa: E402

PARAMS = 59_146  # the main job's 4-stage MLP
STEPS_PER_EPOCH = 23


def _entry(step, rng):
    return {"step": step, "rows": 64, "loss": float(rng.random()),
            "accuracy": float(rng.random())}


def measure(steps, every, workdir):
    """The costs (seconds) for a run of `steps` recorded steps, built in `workdir`."""
    workdir = pathlib.Path(workdir)
    rng = np.random.default_rng(0)
    run = {"model": "mlp", "steps_per_epoch": STEPS_PER_EPOCH, "batch_size": 64}
    history = history_lib.RunHistory(workdir / "history.json", run,
                                     changes=[{"step": 0, "learning_rate": 1e-3}])
    ckpt_dir = workdir / "checkpoints"
    record = outputs.Record(workdir)  # what the run wrote: a line per file
    store = checkpoints.CheckpointStore(
        ckpt_dir, tf.train.Checkpoint(w=tf.Variable(tf.zeros([PARAMS]))), record=record)
    board = history_lib.TensorBoardLog(workdir / "tensorboard", record)
    logged_from = steps - board.steps_per_file - every
    for step in range(1, steps + 1):  # the run so far: a segment per save
        history.steps.append(_entry(step, rng))
        if step % STEPS_PER_EPOCH == 0:
            history.epochs.append({"epoch": step // STEPS_PER_EPOCH, "step": step,
                                   "val_loss": 1.0})
        if step > logged_from:
            board.step(history.steps[-1])
        if step % every == 0 and step < steps:
            history.mark_saved(segments.write(ckpt_dir / outputs.HISTORY_SEGMENTS, step,
                                              history.tail(), history.saved_ref, record))
            if step > logged_from:
                board.rotate(step)
    board.close()
    out = {"steps": steps, "every": every}
    start = time.perf_counter()
    store.save(steps, history)
    board.rotate(steps)
    out["save_s"] = time.perf_counter() - start
    start = time.perf_counter()
    record = store.record = outputs.Record(workdir)  # a resume reads the record back
    found = store.find()
    restored = history_lib.RunHistory.from_json(
        workdir / "history.json", store.restore(found.step, found.manifest),
        saved_ref=found.manifest["history_ref"])
    board.resume(found.step - every // 2)  # a resume before the newest steps trims a file
    restored.per_epoch()
    out["resume_s"] = time.perf_counter() - start
    assert len(restored.steps) == steps
    start = time.perf_counter()
    restored.save(record)
    restored.plot_loss(workdir / "loss.png", record)
    out["end_s"] = time.perf_counter() - start
    start = time.perf_counter()
    text = canonical(history.to_json())
    tf.io.gfile.GFile(str(workdir / "whole.json"), "w").write(text)
    out["whole_history_s"] = time.perf_counter() - start
    out["history_mib"] = len(text) / 2**20
    return out


def table(rows):
    lines = ["| steps | save s | resume s | end s (history.json, loss.png) | whole history "
             "per save s (old) | history MiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['steps']:,} | {r['save_s']:.3f} | {r['resume_s']:.3f} | "
                     f"{r['end_s']:.2f} | {r['whole_history_s']:.3f} | {r['history_mib']:.1f} |")
    return "\n".join(lines)


flags.DEFINE_list("steps", ["10000", "100000", "300000"], "Recorded steps of each run.")
flags.DEFINE_integer("every", 100, "Steps between checkpoints (--checkpoint_every).")


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)  # no INFO lines from TF's savers
    rows = []
    for steps in [int(s) for s in flags.FLAGS.steps]:
        workdir = tempfile.mkdtemp(prefix="run_costs_")
        try:
            rows.append(measure(steps, flags.FLAGS.every, workdir))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print(f"steps={steps:,} done", file=sys.stderr, flush=True)
    print(table(rows))


if __name__ == "__main__":
    app.run(main)
