"""Scatter a batch into M micro-batches along axis 0, and gather back.

A batch of N rows is cut into M contiguous micro-batches whose sizes differ by
at most one row (micro-batch m has `N // M + (m < N % M)` rows); nothing is
padded, so a ragged batch is exact. With N < M some micro-batches have no
rows: such one runs on a copy of row 0 with weight 0 (`real(m)` and
`fraction(m)` are 0, `merge` leaves it out), since empty tensors break some
kernels. Dense, sparse (first dense dimension) and ragged (rows) tensors are
cut; m is a Python int (the unrolled step) or an int32 tensor (the loop step).
"""

import tensorflow as tf

from tfpipe import _internal
from tfpipe import replicas


def _leaves(structure):
    return [t for t in tf.nest.flatten(structure) if t is not None]


def _check_leaf(t, where):
    if isinstance(t, (tf.Tensor, tf.SparseTensor, tf.RaggedTensor, tf.Variable)):
        return
    raise ValueError(
        f"{where}: tfpipe splits every input along axis 0 into micro-batches and "
        f"supports dense tensors, tf.SparseTensor and tf.RaggedTensor; got "
        f"{type(t).__name__}. Convert it to one of those (or to a NumPy array).")


def _rows(t):
    """Axis-0 size of a tensor, SparseTensor or RaggedTensor (int32 scalar)."""
    if isinstance(t, tf.SparseTensor):
        return tf.cast(t.dense_shape[0], tf.int32)
    if isinstance(t, tf.RaggedTensor):
        return tf.cast(t.nrows(), tf.int32)
    return tf.shape(t, out_type=tf.int32)[0]


def _static_rows(t):
    shape = t.shape
    return shape[0] if shape.rank else None


def concat_with_metadata(parts):
    """`tf.concat(parts, 0)` that keeps the parts' Keras masks and logits."""
    joined = tf.concat(parts, axis=0)
    masks = [_internal.get_keras_mask(p) for p in parts]
    if all(m is not None for m in masks):
        _internal.set_keras_mask(joined, tf.concat(masks, axis=0))
    logits = [_internal.get_keras_logits(p) for p in parts]
    if all(l is not None for l in logits):
        _internal.set_keras_logits(joined, tf.concat(logits, axis=0))
    return joined


def slice_with_metadata(tensor, rows):
    """`tensor[:rows]` with its Keras mask and logits cut alike."""
    out = tensor[:rows]
    mask = _internal.get_keras_mask(tensor)
    if mask is not None:
        _internal.set_keras_mask(out, mask[:rows])
    logits = _internal.get_keras_logits(tensor)
    if logits is not None:
        _internal.set_keras_logits(out, logits[:rows])
    return out


class Split:
    """How one batch of N rows is cut into M micro-batches.

    `reference` is a nest of tensors whose first leaf gives N; `name` says
    what the batch is in error messages.

    Attributes:
      num_rows: N, an int32 scalar tensor.
      total_rows: the global batch's rows, of which this batch is one
        replica's share (N with one replica); `fraction` is relative to it.
      static_rows: N when known while tracing, else None.
      static_size: every micro-batch's rows when N is static and a multiple
        of M, else None.
    """

    def __init__(self, reference, num_microbatches, name="the batch"):
        self.num_microbatches = int(num_microbatches)
        leaves = _leaves(reference)
        if not leaves:
            raise ValueError(f"{name} has no tensors to split into micro-batches.")
        for t in leaves:
            _check_leaf(t, name)
        self.num_rows = _rows(leaves[0])
        self.total_rows = self.num_rows
        self.static_rows = _static_rows(leaves[0])
        m = self.num_microbatches
        if self.static_rows is not None and self.static_rows % m == 0:
            self.static_size = self.static_rows // m
        else:
            self.static_size = None
        self._base = self.num_rows // m
        self._extra = self.num_rows % m
        self.equal_size = None
        self._made = {}  # (what, m, graph): a size made for a Python int m

    def assume_equal(self):
        """From now on every micro-batch has exactly N / M rows, with sizes XLA
        knows when it compiles (the loop step under `jit_compile=True`). N
        must be a multiple of M (`tfpipe.xla.check_static_batch`)."""
        self.equal_size = self._base

    def _once(self, what, m, make):
        # A Python int m (the unrolled step) asks for the same sizes from
        # several actions: each is made once per trace, not once per action.
        if not isinstance(m, int):
            return make(m)
        key = (what, m, tf.compat.v1.get_default_graph())
        if key not in self._made:
            self._made[key] = make(m)
        return self._made[key]

    def size(self, m):
        """Rows of micro-batch m (m int or tensor): a Python int when N is
        static and a multiple of M, else an int32 scalar tensor."""
        if self.equal_size is not None:
            return self.equal_size
        if self.static_size is not None:
            return self.static_size
        return self._once("size", m, lambda m: self._base + tf.cast(
            tf.cast(m, tf.int32) < self._extra, tf.int32))

    def start(self, m):
        """First row of micro-batch m: a Python int when m is one and the
        sizes are static, else an int32 scalar tensor."""
        if self.static_size is not None and isinstance(m, int):
            return m * self.static_size
        if self.equal_size is not None:
            return tf.cast(m, tf.int32) * self.equal_size
        return self._once("start", m, lambda m: tf.cast(m, tf.int32) * self._base
                          + tf.minimum(tf.cast(m, tf.int32), self._extra))

    def fraction(self, m, dtype=tf.float32):
        """Micro-batch m's share of the (global) batch, rows / `total_rows`
        (a `dtype` scalar; 0 if there are no rows)."""
        return self._once(("fraction", tf.as_dtype(dtype).name), m,
                          lambda m: tf.math.divide_no_nan(tf.cast(self.size(m), dtype),
                                                          tf.cast(self.total_rows, dtype)))

    def real(self, m):
        """1.0 if micro-batch m has rows, 0.0 if it stands in for an empty one
        (a Python float when no micro-batch can be empty)."""
        if self.static_size or self.equal_size is not None:
            return 1.0
        return self._once("real", m, lambda m: tf.cast(self.size(m) > 0, tf.float32))

    def _taken(self, m):
        """(start, rows) actually read for micro-batch m: an empty one reads row 0."""
        size = self.size(m)
        if self.static_size or self.equal_size is not None:  # never empty
            return self.start(m), size
        empty = size < 1
        return tf.where(empty, 0, self.start(m)), tf.where(empty, 1, size)

    def take(self, structure, m):
        """Micro-batch m of `structure` (same nest; None leaves stay None)."""
        if structure is None:
            return None
        if self.num_microbatches == 1:
            return structure
        start, size = self._taken(m)

        def one(t):
            if t is None:
                return None
            if isinstance(t, tf.SparseTensor):
                rank = tf.shape(t.dense_shape, out_type=tf.int64)[0]
                begin = tf.concat([[tf.cast(start, tf.int64)], tf.zeros([rank - 1], tf.int64)], 0)
                extent = tf.concat([[tf.cast(size, tf.int64)], t.dense_shape[1:]], 0)
                return tf.sparse.slice(t, begin, extent)
            if isinstance(t, tf.RaggedTensor):
                return t[start:start + size]
            t = tf.convert_to_tensor(t)
            if self.equal_size is not None:
                # (M, N / M, ...) then row m: sizes XLA knows, and a loud
                # compile error, never dropped rows, if N is not a multiple of M.
                shape = tf.concat([[self.num_microbatches, self.equal_size], tf.shape(t)[1:]], 0)
                out = tf.gather(tf.reshape(t, shape), tf.cast(m, tf.int32))
                out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
                return out
            out = t[start:start + size]
            if self.static_size is not None:
                out.set_shape(tf.TensorShape([self.static_size]).concatenate(t.shape[1:]))
            return out

        return tf.nest.map_structure(one, structure)

    def take_all(self, structure):
        """Every micro-batch of `structure` when the sizes are static: a list
        of M nests like `take(structure, m)` gives, each dense tensor cut by
        one `tf.split`."""
        num = self.num_microbatches
        if structure is None:
            return [None] * num

        def pieces(t):
            if isinstance(t, (tf.SparseTensor, tf.RaggedTensor)) or t is None:
                return [self.take(t, m) for m in range(num)]
            return tf.split(tf.convert_to_tensor(t), num)

        per_leaf = [pieces(t) for t in tf.nest.flatten(structure)]
        return [tf.nest.pack_sequence_as(structure, [leaf[m] for leaf in per_leaf])
                for m in range(num)]

    def keep_real(self, structure, m):
        """Micro-batch m's outputs without the stand-in row of an empty one
        (Keras masks and logits cut alike)."""
        if self.num_microbatches == 1 or self.static_size or self.equal_size is not None:
            return structure
        size = self.size(m)
        return tf.nest.map_structure(
            lambda t: slice_with_metadata(t, size) if isinstance(t, tf.Tensor) else t,
            structure)

    def merge(self, microbatches):
        """Concatenates M structures along axis 0, rows in order, with their
        Keras masks and logits (metrics see what they would on the batch)."""
        if self.num_microbatches == 1:
            return microbatches[0]
        microbatches = [self.keep_real(s, m) for m, s in enumerate(microbatches)]

        def cat(*parts):
            if isinstance(parts[0], tf.SparseTensor):
                return tf.sparse.concat(0, list(parts))
            return concat_with_metadata(list(parts))

        return tf.nest.map_structure(cat, *microbatches)


class Batch:
    """One batch (x, y, sample_weight) and the `Split` that cuts it.
    `sample`: None, or a function returning an eager `Batch` of real rows of
    the same data, for the checks that need values while a step is traced
    (`tfpipe.assumptions.check_call_losses`). `cut_at_once`: cut every
    micro-batch with one split op per tensor where sizes are static (the
    stage-functions execution asks for it)."""

    def __init__(self, x, y=None, sample_weight=None, num_microbatches=1, sample=None,
                 cut_at_once=False):
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.sample = sample
        self.split = Split(x, num_microbatches, "the inputs (x)")
        # This replica's rows within the global batch (tfpipe.replicas).
        self.split.total_rows = replicas.sum_over_replicas(self.split.num_rows)
        for name, part in (("the labels (y)", y), ("the sample weights", sample_weight)):
            for t in _leaves(part):
                _check_leaf(t, name)
        self._cache = {}
        # Cut every micro-batch at once (`Split.take_all`) when sizes are
        # static: for a stage-function step only (with inlined stages it
        # broke grappler's layout optimiser on a transformer's step).
        self.cut_at_once = cut_at_once

    @property
    def num_microbatches(self):
        return self.split.num_microbatches

    def micro(self, m):
        """(x, y, sample_weight) of micro-batch m (made once for an int m)."""
        if isinstance(m, int) and m in self._cache:
            return self._cache[m]
        if (self.cut_at_once and isinstance(m, int) and self.split.static_size
                and self.num_microbatches > 1):
            # One split op per dense tensor rather than a slice (and its 3
            # constants) per micro-batch.
            parts = [self.split.take_all(part) for part in (self.x, self.y, self.sample_weight)]
            for i, result in enumerate(zip(*parts)):
                self._cache[i] = result
            return self._cache[m]
        take = self.split.take
        result = (take(self.x, m), take(self.y, m), take(self.sample_weight, m))
        if isinstance(m, int):
            self._cache[m] = result
        return result

