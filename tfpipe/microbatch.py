"""Scatter a batch into M equal micro-batches along axis 0, and gather back.

A batch whose size N is not a multiple of M (the partial last batch of an
epoch) is padded with zero rows up to the next multiple; the padded rows get
sample weight 0 and the loss is rescaled so the result is exactly that of the
unpadded batch. `tf.split` alone would fail on such a batch at run time.
"""

import tensorflow as tf


def _tensors(structure):
    return [t for t in tf.nest.flatten(structure) if t is not None]


def static_batch_size(structure):
    """Axis-0 size of the first tensor in `structure` if known when tracing."""
    for t in _tensors(structure):
        if t.shape.rank:
            return t.shape[0]
    return None


def batch_size(structure):
    """Axis-0 size of the first tensor in `structure`, as a scalar int32 tensor."""
    for t in _tensors(structure):
        return tf.shape(t)[0]
    raise ValueError("A batch must contain at least one tensor.")


class Scatter:
    """How one batch of N rows is cut into M micro-batches of b rows each.

    Attributes:
      num_microbatches: M.
      needs_padding: whether N may not be a multiple of M (decided when
        tracing from the static batch size; then rows are padded at run time).
      real_size: N as a float32 scalar tensor.
      padded_size: M * b as a float32 scalar tensor.
    """

    def __init__(self, reference, num_microbatches):
        self.num_microbatches = int(num_microbatches)
        static = static_batch_size(reference)
        self.needs_padding = self.num_microbatches > 1 and (
            static is None or static % self.num_microbatches != 0
        )
        n = batch_size(reference)
        self._n = n
        m = self.num_microbatches
        self._pad = (m - n % m) % m if self.needs_padding else tf.constant(0, tf.int32)
        self.real_size = tf.cast(n, tf.float32)
        self.padded_size = tf.cast(n + self._pad, tf.float32)

    def real_rows(self, m):
        """Real (not padded) rows in micro-batch m: an int32 scalar in [0, b]."""
        b = (self._n + self._pad) // self.num_microbatches
        return tf.clip_by_value(self._n - tf.cast(m, tf.int32) * b, 0, b)

    def mask(self):
        """Float32 (N + pad,) vector: 1 for real rows, 0 for padding."""
        return tf.concat([tf.ones([self._n]), tf.zeros([self._pad])], axis=0)

    def _pad_tensor(self, t):
        if not self.needs_padding:
            return t
        t = tf.convert_to_tensor(t)
        paddings = tf.concat(
            [[[0, self._pad]], tf.zeros([tf.rank(t) - 1, 2], tf.int32)], axis=0
        )
        return tf.pad(t, paddings)

    def split(self, structure):
        """Returns M structures like `structure`, each with b rows."""
        m = self.num_microbatches
        if structure is None:
            return [None] * m
        if m == 1:
            return [structure]
        flat = tf.nest.flatten(structure)
        pieces = [
            [None] * m if t is None else tf.split(self._pad_tensor(t), m, axis=0)
            for t in flat
        ]
        return [tf.nest.pack_sequence_as(structure, [p[i] for p in pieces]) for i in range(m)]

    def merge(self, microbatches):
        """Concatenates M structures along axis 0 and drops padded rows."""
        if self.num_microbatches == 1:
            return microbatches[0]

        def cat(*parts):
            joined = tf.concat(parts, axis=0)
            return joined[: self._n] if self.needs_padding else joined

        return tf.nest.map_structure(cat, *microbatches)

    def stack(self, structure):
        """`structure` with each tensor reshaped to (M, b, ...): the loop form's input."""
        if structure is None:
            return None
        m = self.num_microbatches

        def one(t):
            if t is None:
                return None
            t = self._pad_tensor(t)
            shape = tf.concat([[m, -1], tf.shape(t)[1:]], axis=0)
            out = tf.reshape(t, shape)
            static = t.shape[0]
            b = static // m if static is not None and not self.needs_padding else None
            out.set_shape(tf.TensorShape([m, b]).concatenate(t.shape[1:]))
            return out

        return tf.nest.map_structure(one, structure)

    def unstack(self, structure):
        """Inverse of `stack` for (M, b, ...) outputs: (N, ...), padding dropped."""

        def one(t):
            joined = tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], axis=0))
            joined.set_shape(tf.TensorShape([None]).concatenate(t.shape[2:]))
            return joined[: self._n] if self.needs_padding else joined

        return tf.nest.map_structure(one, structure)
