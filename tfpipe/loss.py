"""The compiled Keras loss, split exactly over micro-batches.

Keras reduces each compiled loss j over the whole batch as
L_j = sum_e (l_e * w_e) / D_j, where w_e merges the sample weight and any
Keras mask, and D_j is 1 ("sum"), the element count, the *valid* element
count under a mask, or the summed sample weights ("mean_with_sample_weight").
Averaging each micro-batch's own Keras loss is wrong under a mask, so each
micro-batch m contributes its numerator S_jm and divisor part D_jm, and
L_j = (sum_m S_jm) / (sum_m D_jm) is exactly Keras' value; micro-batch m's
gradient is seeded with weight_j / D_j.

D_j must be known before the last stage's first backward. "rows" terms (no
mask) know it at once; "counted" terms only after every forward, so only
GPipe seeds them exactly, except a single counted term without call losses,
seeded with weight_j and divided by D_j at the end (`Plan.final_scale`);
other combinations raise a `ValueError` before any step runs. Weight
regularisers are added once per step; call losses (activity regularisers,
`add_loss`) are taken as means over the micro-batch's rows and weighted by its
share of the batch. A loss returning one number per batch (rank 0) raises.
"""

import math

import keras
import tensorflow as tf

from tfpipe import _internal
from tfpipe import replicas

SUM = "sum"          # D = 1: numerators add up
ROWS = "rows"        # D = N * elements per row, known before the step
COUNTED = "counted"  # D = sum of per-micro-batch parts, known after the last forward

_MEANS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


class Term:
    """One compiled loss: its Keras `Loss`, weight, name and where it reads."""

    def __init__(self, path, loss, weight, name):
        self.path, self.loss, self.weight, self.name = tuple(path), loss, weight, name
        self.kind = None  # SUM, ROWS or COUNTED, set by `LossSplit.classify`
        self.per_row = None  # elements per row (ROWS)

    def describe(self):
        return getattr(self.loss, "name", None) or type(self.loss).__name__


def resolve(path, structure):
    """`structure[path[0]][path[1]]...`."""
    for key in path:
        structure = structure[key]
    return structure


def _reconcile(compile_loss, y_true, y_pred):
    """y_true arranged like y_pred, as `keras` `CompileLoss.call` arranges it."""
    tree = keras.tree
    if not tree.is_nested(y_true) and not tree.is_nested(y_pred):
        return y_true, y_pred
    try:
        tree.assert_same_structure(y_pred, y_true)
        return y_true, y_pred
    except (ValueError, TypeError):
        pass
    names = compile_loss.output_names or []
    if not tree.is_nested(y_true) and hasattr(y_pred, "__len__") and len(y_pred) == 1:
        y_true = [y_true]
    elif isinstance(y_pred, (list, tuple)) and isinstance(y_true, dict) \
            and set(names) == set(y_true):
        y_true = [y_true[name] for name in names]
    try:
        return tree.pack_sequence_as(y_pred, tree.flatten(y_true)), y_pred
    except (ValueError, TypeError):
        pass
    # A loss for some outputs only (e.g. loss=["mse", None]): the labels
    # are those outputs', in order, as Keras reads them.
    flat_loss = tree.flatten(_internal.user_loss(compile_loss))
    flat_true = tree.flatten(y_true)
    given = [i for i, l in enumerate(flat_loss) if l is not None]
    if len(flat_loss) == len(tree.flatten(y_pred)) and len(flat_true) == len(given):
        placed = [None] * len(flat_loss)
        for i, t in zip(given, flat_true):
            placed[i] = t
        return tree.pack_sequence_as(y_pred, placed), y_pred
    raise ValueError(
        f"The labels do not match the model's outputs: y has structure "
        f"{tree.map_structure(lambda _: '*', y_true)} but the outputs are "
        f"{tree.map_structure(lambda _: '*', y_pred)}. Pass one label per output "
        f"(a list in output order, or a dict keyed by output name).")


class LossSplit:
    """A model's compiled loss (its Keras `CompileLoss`, or None: only stage
    losses) as per-micro-batch numerators and divisors."""

    def __init__(self, compile_loss):
        self._keras_loss = compile_loss
        self.terms = []
        self._built = False

    def build(self, y_true, y_pred):
        """Resolves the terms for these structures (micro-batch tensors)."""
        if self._built or self._keras_loss is None:
            self._built = True
            return
        if y_true is None:
            raise ValueError(
                "The model was compiled with a loss but the data has no labels (y). "
                "Pass y to fit/evaluate, or compile without a loss.")
        y_true, y_pred = _reconcile(self._keras_loss, y_true, y_pred)
        if not self._keras_loss.built:
            self._keras_loss.build(y_true, y_pred)
        self.terms = [Term(*t) for t in _internal.compiled_loss_terms(self._keras_loss)]
        for term in self.terms:
            reduction = getattr(term.loss, "reduction", "sum_over_batch_size")
            if reduction not in _MEANS + (SUM,):
                raise ValueError(
                    f"Loss {term.describe()!r} uses reduction={reduction!r}, which "
                    f"returns unreduced values; tfpipe needs a reduced loss to sum "
                    f"over micro-batches. Use reduction='sum_over_batch_size' (the "
                    f"Keras default), 'mean', 'mean_with_sample_weight' or 'sum'.")
        self._built = True

    @property
    def trackers(self):
        """Keras' per-output loss metrics (`<output>_loss`), aligned with `terms`
        (only when there are several terms, as in Keras)."""
        if self._keras_loss is None or len(self.terms) < 2:
            return []
        return list(self._keras_loss.metrics)

    def arrange(self, y_true, y_pred, sample_weight):
        """(y_true, y_pred, sample_weight) arranged like the built structures."""
        y_true, y_pred = _reconcile(self._keras_loss, y_true, y_pred)
        true_struct, pred_struct = _internal.compiled_loss_structures(self._keras_loss)
        tree = keras.tree
        if pred_struct is not None:
            try:
                tree.assert_same_structure(pred_struct, y_pred)
            except (ValueError, TypeError):
                y_pred = tree.pack_sequence_as(pred_struct, tree.flatten(y_pred))
            try:
                tree.assert_same_structure(true_struct, y_true)
            except (ValueError, TypeError):
                y_true = tree.pack_sequence_as(true_struct, tree.flatten(y_true))
        return y_true, y_pred, sample_weight

    def parts(self, y_true, y_pred, sample_weight):
        """Per term, (numerator S, divisor part D, elements per row) of one
        micro-batch; D is None for "sum" terms. `y_pred` must be the last
        stage's output itself (Keras' masks and logits ride on it)."""
        if not self.terms:
            return []
        y_true, y_pred, sample_weight = self.arrange(y_true, y_pred, sample_weight)
        out = []
        for term in self.terms:
            y_t, y_p = resolve(term.path, y_true), resolve(term.path, y_pred)
            sw = (resolve(term.path, sample_weight)
                  if sample_weight is not None and keras.tree.is_nested(sample_weight)
                  else sample_weight)
            out.append(_term_parts(term, y_t, y_p, sw))
        return out

    def batch_values(self, y_true, y_pred, sample_weight):
        """(total data loss, [L_j]) of a whole batch in one piece, as Keras
        computes it (evaluation); with replicas, this replica's share."""
        self.build(y_true, y_pred)
        parts = self.parts(y_true, y_pred, sample_weight)
        dtype = tf.float64 if any(s.dtype == tf.float64 for s, _, _ in parts) else tf.float32
        per_term, total = [], tf.zeros((), dtype)
        for term, (s, d, _) in zip(self.terms, parts):
            s = tf.cast(s, dtype)
            d = None if d is None else replicas.sum_over_replicas(tf.cast(d, dtype))
            value = s if d is None else tf.math.divide_no_nan(s, d)
            per_term.append(value)
            weight = 1.0 if term.weight is None else float(term.weight)
            total = total + value * weight
        return total, per_term

    def classify(self, y_true, y_pred, sample_weight):
        """Sets each term's kind from one traced micro-batch (batch dim None);
        returns the terms' numerators on it."""
        if not self.terms:
            return []
        parts = self.parts(y_true, y_pred, sample_weight)
        for term, (_, divisor, per_row) in zip(self.terms, parts):
            if divisor is None:
                term.kind = SUM
            elif per_row is not None:
                term.kind, term.per_row = ROWS, per_row
            else:
                term.kind = COUNTED
        return [numerator for numerator, _, _ in parts]

    @property
    def counted(self):
        return [t for t in self.terms if t.kind == COUNTED]


def _term_parts(term, y_true, y_pred, sample_weight):
    """(S, D, elements per row or None) of one term on one micro-batch,
    following `keras.losses.Loss.__call__` without its final division."""
    loss = term.loss
    ops = keras.ops
    in_mask = _internal.get_keras_mask(y_pred)
    y_pred = keras.tree.map_structure(lambda x: ops.convert_to_tensor(x, dtype=loss.dtype), y_pred)
    y_true = keras.tree.map_structure(lambda x: ops.convert_to_tensor(x, dtype=loss.dtype), y_true)
    values = loss.call(y_true, y_pred)
    if len(values.shape) == 0:
        raise ValueError(
            f"Loss {term.describe()!r} returned a single number for its whole batch "
            f"(shape ()). tfpipe splits each batch into micro-batches and needs one "
            f"loss value per sample (shape (batch,) or (batch, ...)) to weight them "
            f"exactly: return the per-sample values (e.g. ops.mean(..., axis=-1)) and "
            f"let Keras reduce them with the loss's reduction.")
    out_mask = _internal.get_keras_mask(values)
    mask = in_mask if out_mask is None else (out_mask if in_mask is None else in_mask & out_mask)
    dtype = values.dtype
    weights = None
    if mask is not None:
        weights = ops.cast(mask, dtype)
    if sample_weight is not None:
        sw = ops.cast(sample_weight, dtype)
        if weights is not None:
            weights, sw = _same_rank(weights, sw)
            weights = sw * weights
        else:
            weights = sw
    valid = None if mask is None else ops.sum(ops.cast(mask, dtype))
    if weights is not None:
        values, weights = _same_rank(values, ops.cast(weights, dtype))
        values = values * weights
    numerator = ops.sum(values)
    reduction = getattr(loss, "reduction", "sum_over_batch_size")
    if reduction == SUM:
        return numerator, None, None
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        return numerator, ops.sum(weights), None
    if valid is not None:
        return numerator, valid, None
    count = ops.cast(ops.prod(ops.convert_to_tensor(ops.shape(values), dtype="int32")), dtype)
    trailing = values.shape[1:]
    per_row = None
    if values.shape[0] is None and all(d is not None for d in trailing):
        per_row = int(math.prod(trailing))
    return numerator, count, per_row


def _same_rank(x1, x2):
    """Keras' `squeeze_or_expand_to_same_rank` (last dimension of size 1)."""
    ops = keras.ops
    r1, r2 = len(x1.shape), len(x2.shape)
    if r1 == r2 + 1 and x1.shape[-1] == 1:
        if r2 == 1:
            x2 = ops.expand_dims(x2, axis=-1)
        else:
            x1 = ops.squeeze(x1, axis=-1)
    if r2 == r1 + 1 and x2.shape[-1] == 1:
        if r1 == 1:
            x1 = ops.expand_dims(x1, axis=-1)
        else:
            x2 = ops.squeeze(x2, axis=-1)
    return x1, x2


class NeedsForwardsFirst(ValueError):
    """A loss this schedule cannot split: only a schedule that runs every
    forward before the first backward (GPipe) can."""


class Plan:
    """How one step seeds the last stage's backward, and what it reports.

    Args:
      split: the `LossSplit`, built and classified; num_rows: N, the global
        batch's rows (int32 scalar tensor).
      forwards_first: the schedule runs every forward of the last stage
        before its first backward (GPipe does); call_losses: a stage adds
        losses while it runs; in_loop: the backwards run in a
        `tf.while_loop`, where a count cannot be summed over replicas;
      dtype: what seeds and values are computed in (float64 in a float64
      model: exact to its precision).
    Raises ValueError if a counted term cannot be seeded exactly.
    """

    def __init__(self, split, num_rows, forwards_first, call_losses, in_loop=False,
                 dtype=tf.float32):
        self.split = split
        self.terms = split.terms
        self.dtype = dtype
        self._rows = tf.cast(num_rows, dtype)
        counted = split.counted
        # A sum over replicas is a synchronisation point, which TF's
        # distribution machinery refuses inside a while loop's body.
        late = not forwards_first or (in_loop and replicas.num_replicas() > 1)
        # Deferred: seed with the weight alone; divide every gradient by D at the end.
        self.deferred = bool(counted) and late
        if self.deferred and (len(self.terms) > 1 or call_losses):
            names = [t.describe() for t in counted]
            losses = ("several compiled losses" if len(self.terms) > 1
                      else "losses added by layers during the call")
            when = ("this schedule starts backward passes before that" if not forwards_first
                    else "with data-parallel replicas the loop execution cannot sum it over "
                         "the replicas before its backward passes")
            fix = ("schedule='gpipe' (every forward before the first backward)"
                   if not forwards_first else "execution='unrolled'")
            raise (NeedsForwardsFirst if not forwards_first else ValueError)(
                f"Loss {names} is averaged over the elements its mask or sample "
                f"weights leave (e.g. masked tokens, ignore_class), a count known only "
                f"after every micro-batch's forward pass; {when}, and with {losses} the "
                f"gradients cannot be rescaled afterwards. Use {fix}, or reduction='sum'.")

    @staticmethod
    def _weight(term):
        return 1.0 if term.weight is None else float(term.weight)

    def _divisor(self, term, counted_sum):
        if term.kind == SUM:
            return None
        if term.kind == ROWS:
            return self._rows * float(term.per_row)
        # This replica's count: the divisor is the global batch's.
        return replicas.sum_over_replicas(tf.cast(counted_sum, self.dtype))

    def seeds(self, divisor_sums):
        """Per term, the seed (in `dtype`) of its numerator in every micro-
        batch's backward. `divisor_sums[j]`: the summed D_jm of a counted
        term (else unused; may be None)."""
        out = []
        for term, counted_sum in zip(self.terms, divisor_sums):
            divisor = None if self.deferred else self._divisor(term, counted_sum)
            weight = tf.constant(self._weight(term), self.dtype)
            out.append(weight if divisor is None else tf.math.divide_no_nan(weight, divisor))
        return out

    def final_scale(self, divisor_sums):
        """The factor every accumulated data gradient is multiplied by (None: 1)."""
        if not self.deferred:
            return None
        term = self.split.counted[0]
        return tf.math.divide_no_nan(tf.constant(1.0, self.dtype), self._divisor(
            term, divisor_sums[self.terms.index(term)]))

    def values(self, numerator_sums, divisor_sums):
        """(total data loss, [L_j per term]) for the step, as Keras reports them."""
        per_term, total = [], tf.zeros((), self.dtype)
        for term, s, counted_sum in zip(self.terms, numerator_sums, divisor_sums):
            s = tf.cast(s, self.dtype)
            divisor = self._divisor(term, counted_sum)
            value = s if divisor is None else tf.math.divide_no_nan(s, divisor)
            per_term.append(value)
            total = total + value * self._weight(term)
        return total, per_term
