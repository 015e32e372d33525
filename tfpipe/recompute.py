"""Re-materialisation policies and side-effect-free stage replay.

GPipe keeps only each stage's input for a micro-batch and recomputes the
stage's activations during the backward pass. tfpipe does the recompute itself
rather than through `tf.recompute_grad`, for two reasons measured on TF 2.21:
`tf.recompute_grad` replays stochastic layers with an advanced seed (a different
dropout mask than the forward used, so wrong gradients), and it runs the
backward wherever the enclosing tape is, not on the stage's device.

A replay here (1) restores the stage's seed-generator state to what it was
before that micro-batch's forward, so dropout masks are identical, and (2) puts
every non-trainable variable (seed states, BatchNorm moving statistics) back
afterwards, so a recompute never updates state twice.
"""

import tensorflow as tf

from tfpipe import _internal
from tfpipe import schedules

# The policies and which micro-batches each replays are the schedule
# arithmetic's (pure Python, so the simulator prices them without TensorFlow).
RECOMPUTE_MODES = schedules.RECOMPUTE_MODES
should_recompute = schedules.is_recomputed
validate = schedules.validate_recompute


EXECUTIONS = ("unrolled", "stage_functions", "loop")


def resolve(mode, execution):
    """The recompute mode to use: `mode`, or the default for `execution`.

    The unrolled step (with or without stage functions) defaults to
    "except_last"; the loop form keeps only
    stage inputs, so it is always "always" (and rejects other modes).
    """
    if execution not in EXECUTIONS:
        raise ValueError(
            f"Unknown execution {execution!r}. Use 'unrolled' (every action traced; "
            f"all recompute modes), 'stage_functions' (every action called, each stage "
            f"traced once as a tf.function; all recompute modes) or 'loop' (a "
            f"tf.while_loop over clock ticks; graph size independent of "
            f"num_microbatches; recompute='always'), or leave it unset (None) for "
            f"tfpipe's choice (tfpipe.config.default_execution)."
        )
    if mode is None:
        return "always" if execution == "loop" else "except_last"
    mode = validate(mode)
    if execution == "loop" and mode != "always":
        raise ValueError(
            f"execution='loop' keeps only stage inputs and recomputes every stage in "
            f"the backward pass, so it needs recompute='always' (got recompute="
            f"{mode!r}). Use recompute='always' (or leave it unset), or "
            f"execution='unrolled' for {mode!r}."
        )
    return mode


class StageState:
    """The RNG and non-trainable state of one stage, for exact replays."""

    def __init__(self, stage):
        self._stage = stage

    def seed_variables(self):
        """The stage's seed-generator state variables."""
        # Looked up when tracing, not at construction: a stage's variables
        # exist only once it is built.
        return [g.state for g in _internal.seed_generators(self._stage)]

    def snapshot_seeds(self):
        """Current seed states; pass to `replay` to redraw the same masks."""
        return [tf.identity(v.value) for v in self.seed_variables()]

    def replay(self, seeds, fn):
        """Runs `fn()` with seeds set to `seeds`; restores all state after."""
        state_vars = list(self._stage.non_trainable_variables)
        saved = [tf.identity(v.value) for v in state_vars]
        for var, value in zip(self.seed_variables(), seeds):
            var.assign(value)
        result = fn()
        for var, value in zip(state_vars, saved):
            var.assign(value)
        return result
