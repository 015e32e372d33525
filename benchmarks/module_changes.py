"""How often one traced training step crosses between tfpipe's modules, per
action and outside the action loop: `python -m benchmarks.module_changes`.

Issue 42's measure of "state lives apart from compute": a module change is a
Python call from a function of one tfpipe module into a function of another
(calls into TensorFlow or Keras, and calls within a module, do not count;
neither do returns). While the step is traced once (`sys.setprofile`), each
change is charged to the action being run (`runtime.Interpreter.run`, nested
calls included) or, outside every action, to the step's set-up and end. A
2-stage model on 2 logical CPUs, traced in this process (no timing).

    python -m benchmarks.module_changes                        # a few seconds
    python -m benchmarks.module_changes --schedule=zbh1 --execution=stage_functions
"""

import collections
import statistics
import sys

from benchmarks import common

MODELS = ("mlp", "transformer")


def _module_of(frame):
    """The tfpipe module name of a frame's code, or None (not tfpipe's)."""
    name = frame.f_globals.get("__name__", "")
    return name if name == "tfpipe" or name.startswith("tfpipe.") else None


def count(model, x_spec, y_spec):
    """Traces `model.train_step` once; returns ({action kind: [changes per
    action]}, changes outside the actions)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    per_action = collections.defaultdict(list)
    state = {"action": None, "depth": 0, "outside": 0}
    run_code = tfpipe.runtime.Interpreter.run.__code__

    def profile(frame, event, arg):
        del arg
        if event == "call" and frame.f_code is run_code:
            if state["action"] is None:
                action = frame.f_locals["action"]
                state["action"] = [action.kind, 0]
                state["run_frame"] = frame
        elif event == "return" and state["action"] is not None and \
                frame is state.get("run_frame"):
            kind, changes = state["action"]
            per_action[kind].append(changes)
            state["action"] = None
            return
        if event != "call":
            return
        callee, caller = _module_of(frame), frame.f_back and _module_of(frame.f_back)
        if callee and caller and callee != caller:
            if state["action"] is not None:
                state["action"][1] += 1
            else:
                state["outside"] += 1

    step = tf.function(lambda a, b: model.train_step((a, b)), autograph=False)
    with common.call_scope(model):
        sys.setprofile(profile)
        try:
            step.get_concrete_function(x_spec, y_spec)
        finally:
            sys.setprofile(None)
    return dict(per_action), state["outside"]


def measure(schedule="gpipe", execution="unrolled", num_microbatches=4, model="mlp"):
    """One count (in this process, 2 logical CPUs); a dict row per action kind
    and one for the set-up and end."""
    import keras  # pylint: disable=import-outside-toplevel
    pipelined, specs = common.two_stage_pipeline(
        model, [keras.layers.Dense(8), keras.layers.Dense(4)], schedule=schedule,
        num_microbatches=num_microbatches, recompute="never", execution=execution)
    per_action, outside = count(pipelined, *specs)
    rows = [{"part": f"action {kind}", "actions": len(v), "mean": statistics.mean(v),
             "max": max(v), "total": sum(v)} for kind, v in sorted(per_action.items())]
    rows.append({"part": "outside the actions", "actions": None, "mean": None, "max": None,
                 "total": outside})
    return {"rows": rows, "execution": pipelined.execution}


def main(argv):
    from absl import flags  # pylint: disable=import-outside-toplevel
    f = flags.FLAGS
    info, start = common.begin(argv)
    result = common.run_child("benchmarks.module_changes:measure", dict(
        schedule=f.schedule, execution=f.execution, num_microbatches=f.microbatches,
        model=f.model), devices=2, inter_op=2)
    if "error" in result:
        raise SystemExit(f"module_changes: the child failed: {result['error']}")
    rows = result["rows"]
    table = common.markdown_table(
        [("part", "part", 0), ("actions", "actions", 0), ("changes per action (mean)", "mean", 1),
         ("max", "max", 0), ("total", "total", 0)], rows)
    common.finish(f.out, info, start, rows,
                  f"tfpipe module changes while one step is traced: {f.model}, K=2, "
                  f"M={f.microbatches}, {f.schedule}, {result['execution']}", table,
                  config={"schedule": f.schedule, "execution": f.execution,
                          "num_microbatches": f.microbatches, "model": f.model})


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_string("schedule", "gpipe", "The schedule.")
    flags.DEFINE_enum("execution", "unrolled", ["unrolled", "stage_functions", "loop"],
                      "The execution.")
    flags.DEFINE_integer("microbatches", 4, "M.", lower_bound=1)
    flags.DEFINE_enum("model", "mlp", MODELS, "Two Dense stages, or a 2-block transformer.")
    flags.DEFINE_string("out", str(common.RESULTS_DIR / "module_changes.json"), "JSON output.")


if __name__ == "__main__":
    from absl import app as _app
    _define_flags()
    _app.run(main)
