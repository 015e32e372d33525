"""Side-effect-free stage replay, for re-materialisation.

A replay restores the stage's seed state to what it was before that
micro-batch's forward (same dropout masks) and puts every non-trainable
variable back afterwards (no state updated twice). `tf.recompute_grad` does
neither, and runs the backward off the stage's device.
"""

import tensorflow as tf

from tfpipe import _internal


class StageState:
    """The RNG and non-trainable state of one stage, for exact replays."""

    def __init__(self, stage):
        self._stage = stage

    def seed_variables(self):
        """The stage's seed-generator state variables (looked up when tracing:
        they exist only once the stage is built)."""
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
