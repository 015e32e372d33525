"""Helpers for tests and development on one machine: logical CPU devices, and
an observer that counts stage calls while a step is traced."""

import tensorflow as tf


def use_logical_cpus(n):
    """Splits the physical CPU into `n` logical devices (`/device:CPU:0..n-1`)
    before TensorFlow initialises its devices; again with the same `n`, a no-op.

    >>> tfpipe.testing.use_logical_cpus(4)  # doctest: +SKIP

    Raises:
      ValueError: `n` is not a positive integer.
      RuntimeError: TensorFlow already initialised with a different count.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"use_logical_cpus(n) needs a positive integer n, got {n!r}.")
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu)
    if configured is not None and len(configured) == n:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have == n:
            return
        raise RuntimeError(
            f"use_logical_cpus({n}): TensorFlow is already initialised with {have} "
            f"logical CPU device(s), and the count cannot change in a running "
            f"process. Call tfpipe.testing.use_logical_cpus({n}) before any "
            f"TensorFlow op runs (e.g. at the top of the script or in conftest.py)."
        ) from None


class StageCalls:
    """A trace observer (`PipelinedModel.set_trace_options(observer=...)`):
    counts the calls of each stage's layer while steps are traced, replays
    included (`per_stage[k]`), and those traced inside an XLA program
    (`in_xla[k]`).

    >>> calls = tfpipe.testing.StageCalls()      # doctest: +SKIP
    >>> model.set_trace_options(observer=calls)  # doctest: +SKIP
    >>> model.fit(x, y); calls.per_stage          # doctest: +SKIP
    [7, 7, 7, 7]
    """

    def __init__(self):
        self.counts = {}
        self.in_xla = {}  # k -> calls traced inside an XLA program

    def on_stage_call(self, k, in_xla=False):
        self.counts[k] = self.counts.get(k, 0) + 1
        self.in_xla[k] = self.in_xla.get(k, 0) + int(bool(in_xla))

    @property
    def per_stage(self):
        """Calls per stage, stages 0..K-1 (K: the highest stage called + 1)."""
        return [self.counts.get(k, 0) for k in range(1 + max(self.counts, default=-1))]
