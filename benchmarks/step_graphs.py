"""Whether two trees trace the same training step: `python -m benchmarks.step_graphs`.

A refactor that must not change speed (issue 42's no-regression rule) can be
checked without timing noise: if the traced step graph is the same, op for op,
the step is the same. For each configuration a child process (this tree, and
each `--tree`) traces one `train_step` on 2 logical CPUs and fingerprints its
graph by position, not by name (names carry per-process counters): per op, its
type, its device, its inputs (producing op's position, output index) and its
control inputs' positions. Function bodies (stage functions', the loop's) are
compared through the call and While ops that hold them, not op by op.

    python -m benchmarks.step_graphs --tree=start=/tmp/base   # seconds per tree

The table says, per configuration, each tree's op count and whether its
fingerprint equals this tree's.
"""

import hashlib

from benchmarks import common

# (model, schedule, execution, recompute): both models, every execution, the
# recompute modes, and a split backward (ZB-H1).
CONFIGS = [
    ("mlp", "gpipe", "unrolled", "never"),
    ("mlp", "1f1b", "unrolled", "always"),
    ("mlp", "gpipe", "stage_functions", "except_last"),
    ("mlp", "gpipe", "loop", "always"),
    ("transformer", "gpipe", "unrolled", "never"),
    ("transformer", "zbh1", "unrolled", "except_last"),
    ("transformer", "1f1b", "stage_functions", "except_last"),
]


def fingerprint(graph):
    """(op count, hex digest) of `graph`'s ops by position (see the module docstring)."""
    ops = graph.get_operations()
    position = {id(op): n for n, op in enumerate(ops)}
    signature = [(op.type, op.device,
                  tuple((position.get(id(t.op)), t.value_index) for t in op.inputs),
                  tuple(sorted(position.get(id(c)) for c in op.control_inputs)))
                 for op in ops]
    return len(ops), hashlib.sha256(repr(signature).encode()).hexdigest()[:16]


def measure(model, schedule, execution, recompute):
    """Traces one training step (M=4, K=2) in this process; {"ops", "fingerprint"}."""
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(0)
    # The MLP has BatchNorm and an activity regulariser: moments and call losses.
    pipelined, specs = common.two_stage_pipeline(
        model, [keras.Sequential([keras.layers.Dense(8), keras.layers.BatchNormalization()]),
                keras.layers.Dense(4, activity_regularizer="l2")],
        num_microbatches=4, schedule=schedule, execution=execution, recompute=recompute,
        call_losses="per_microbatch")
    step = tf.function(lambda x, y: pipelined.train_step((x, y)), autograph=False)
    with common.call_scope(pipelined):
        ops, digest = fingerprint(step.get_concrete_function(*specs).graph)
    return {"ops": ops, "fingerprint": digest}


def main(argv):
    from absl import flags  # pylint: disable=import-outside-toplevel
    f = flags.FLAGS
    info, start = common.begin(argv)
    trees = common.parse_trees(f.tree)
    rows = []
    for model, schedule, execution, recompute in CONFIGS:
        row = {"model": model, "schedule": schedule, "execution": execution,
               "recompute": recompute}
        for label, path in trees:
            result = common.run_child("benchmarks.step_graphs:measure", dict(
                model=model, schedule=schedule, execution=execution, recompute=recompute),
                devices=2, tree=path, timeout=600)
            if "error" in result:
                raise SystemExit(f"step_graphs: {label}, {row}: {result['error']}")
            row[f"{label} ops"] = result["ops"]
            row[f"{label} fingerprint"] = result["fingerprint"]
        current = row[f"{trees[0][0]} fingerprint"]
        row["same"] = all(row[f"{label} fingerprint"] == current for label, _ in trees)
        rows.append(row)
    columns = [("model", "model", 0), ("schedule", "schedule", 0),
               ("execution", "execution", 0), ("recompute", "recompute", 0),
               *[(f"{label} ops", f"{label} ops", 0) for label, _ in trees],
               ("same graph", "same", 0)]
    common.finish(f.out, info, start, rows,
                  f"traced training step, K=2, M=4: {', '.join(l for l, _ in trees)}",
                  common.markdown_table(columns, rows),
                  trees={label: path for label, path in trees})
    if not all(row["same"] for row in rows):
        raise SystemExit(1)


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_multi_string("tree", [], "Other checkouts to compare: LABEL=PATH.")
    flags.DEFINE_string("out", str(common.RESULTS_DIR / "step_graphs.json"), "JSON output.")


if __name__ == "__main__":
    from absl import app as _app
    _define_flags()
    _app.run(main)
