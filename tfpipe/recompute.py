"""Side-effect-free stage replay, for re-materialisation.

GPipe keeps only each stage's input for a micro-batch and recomputes the
stage's activations during the backward pass. tfpipe does the recompute itself
rather than through `tf.recompute_grad`, for two reasons measured on TF 2.21:
`tf.recompute_grad` replays stochastic layers with an advanced seed (a different
dropout mask than the forward used, so wrong gradients), and it runs the
backward wherever the enclosing tape is, not on the stage's device.

A replay here (1) restores the stage's seed-generator state to what it was
before that micro-batch's forward, so dropout masks are identical, and (2) puts
every non-trainable variable (seed states, BatchNorm moving statistics) back
afterwards, so a recompute never updates state twice. Which micro-batches
replay is the policy's (`tfpipe.actions.is_recomputed`, pure Python, so the
simulator prices it too).
"""

import tensorflow as tf

from tfpipe import _internal


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
