"""Models tfpipe did not write, as users bring them, for the exactness table.

Each `Pattern` builds a fresh Keras model from stock layers (softmax and
sigmoid heads with Keras' default losses, masks, wrappers, nested models,
adapted preprocessing layers, `Lambda`, a custom layer without `get_config`,
shared layers, several inputs and outputs, regularisers, sparse inputs), its
data, and how it is compiled. `test_real_models` trains each one pipelined and
plainly and compares the weights and Keras' history.
"""

import dataclasses
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

N = 46  # rows: batches of 16, 16 and a ragged 14 (micro-batches of 4, 4, 3, 3 at M = 4)


@dataclasses.dataclass
class Pattern:
    """A model from outside tfpipe.

    Attributes:
      name: the table row's id.
      build: () -> a fresh, built Keras model (same weights for the same seed).
      data: () -> (x, y, sample_weight or None), or (a batched
        tf.data.Dataset, None, None).
      compile: kwargs of `model.compile` (an optimizer is added if missing).
      balances: the cuts to try (None: tfpipe balances by parameters).
      batch_size: of fit/evaluate.
    """

    name: str
    build: Callable
    data: Callable
    compile: dict
    balances: tuple = (None,)
    batch_size: int = 16

    def __str__(self):
        return self.name


def _rng(seed=0):
    return np.random.default_rng(seed)


def _features(n=N, d=6, seed=0):
    return _rng(seed).normal(size=(n, d)).astype("float32")


def _classes(n=N, k=3, seed=1):
    return _rng(seed).integers(0, k, size=(n,))


# -- heads and losses ----------------------------------------------------------


def _mlp(head_units, activation):
    def build():
        return keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(head_units, activation=activation),
        ])
    return build


def crossentropy(name, loss, head, metrics=("accuracy",)):
    """A classifier whose head is `head` ("softmax", "sigmoid" or "logits")."""
    binary = "binary" in name
    units = 1 if binary else 3
    activation = {"softmax": "softmax", "sigmoid": "sigmoid", "logits": None}[head]

    def data():
        labels = _classes(k=2 if binary else 3)
        if binary:
            y = labels[:, None].astype("float32")
        elif "sparse" in name:
            y = labels
        else:
            y = np.eye(3, dtype="float32")[labels]
        return _features(), y, None

    return Pattern(f"{name}-{head}", _mlp(units, activation), data,
                   dict(loss=loss, metrics=list(metrics)))


def _xent(cls, head, **kwargs):
    return cls(from_logits=head == "logits", **kwargs)


def crossentropy_patterns():
    """Every built-in crossentropy, with a softmax/sigmoid head and with logits."""
    out = [crossentropy("sparse_categorical_crossentropy", "sparse_categorical_crossentropy",
                        "softmax")]
    for head in ("softmax", "logits"):
        out.append(crossentropy("categorical_crossentropy",
                                _xent(keras.losses.CategoricalCrossentropy, head), head))
        out.append(crossentropy("categorical_label_smoothing",
                                _xent(keras.losses.CategoricalCrossentropy, head,
                                      label_smoothing=0.1), head))
        out.append(crossentropy("categorical_focal",
                                _xent(keras.losses.CategoricalFocalCrossentropy, head), head))
    out.append(crossentropy("sparse_categorical", _xent(
        keras.losses.SparseCategoricalCrossentropy, "logits"), "logits"))
    for head in ("sigmoid", "logits"):
        out.append(crossentropy("binary_crossentropy",
                                _xent(keras.losses.BinaryCrossentropy, head), head,
                                metrics=("accuracy", "auc")))
        out.append(crossentropy("binary_label_smoothing",
                                _xent(keras.losses.BinaryCrossentropy, head,
                                      label_smoothing=0.1), head))
        out.append(crossentropy("binary_focal",
                                _xent(keras.losses.BinaryFocalCrossentropy, head), head))
    return out


# -- sequences and masks -------------------------------------------------------


def _tokens(n=N, length=7, vocab=20, seed=2):
    rng = _rng(seed)
    x = rng.integers(1, vocab, size=(n, length))
    x[::2, 4:] = 0   # padding (mask_zero)
    x[1::3, 6:] = 0
    return x.astype("int32")


def masked_sequence():
    """Embedding(mask_zero) -> LSTM -> per-token softmax: the mask must cross
    every cut, and the loss averages over real tokens only."""
    def build():
        inputs = keras.Input((7,), dtype="int32")
        h = keras.layers.Embedding(20, 6, mask_zero=True)(inputs)
        h = keras.layers.LSTM(5, return_sequences=True)(h)
        h = keras.layers.Dense(6, activation="relu")(h)
        return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))

    def data():
        return _tokens(), _rng(3).integers(0, 3, size=(N, 7)), None

    # Units: embedding, not_equal (the mask), lstm, dense, dense.
    return Pattern("masked_sequence", build, data,
                   dict(loss="sparse_categorical_crossentropy", metrics=["accuracy"]),
                   balances=([1, 4], [3, 2], [4, 1], [1, 2, 1, 1]))


def ignore_class():
    """Per-token labels with an ignored class: averaged over the kept tokens."""
    def build():
        return keras.Sequential([keras.Input((5, 4)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(4, activation="softmax")])

    def data():
        y = _rng(4).integers(0, 4, size=(N, 5))
        y[:, :2] = 3  # many ignored tokens, unevenly over rows below
        y[::3, 2:] = 3
        return _rng(5).normal(size=(N, 5, 4)).astype("float32"), y, None

    return Pattern("ignore_class", build, data, dict(
        loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=3),
        metrics=["accuracy"]), balances=([1, 2],))


# -- nested layers and wrappers ------------------------------------------------


def wrappers():
    """TimeDistributed, Bidirectional and a nested Sequential; the balances put
    each of them in the first, a middle and the last stage."""
    def build():
        inputs = keras.Input((5, 3))
        h = keras.layers.TimeDistributed(keras.layers.Dense(4), name="td")(inputs)
        h = keras.layers.Bidirectional(keras.layers.LSTM(3, return_sequences=True),
                                       name="bilstm")(h)
        nested = keras.Sequential([keras.layers.Dense(4, activation="relu"),
                                   keras.layers.Dense(4)], name="nested")
        h = nested(h)
        h = keras.layers.Bidirectional(keras.layers.GRU(3), name="bigru")(h)
        return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(h))

    def data():
        x = _rng(6).normal(size=(N, 5, 3)).astype("float32")
        return x, _classes(k=2)[:, None].astype("float32"), None

    # Units: td, bilstm, nested/dense, nested/dense_1, bigru, head.
    return Pattern("wrappers", build, data,
                   dict(loss="binary_crossentropy", metrics=["accuracy"]),
                   balances=([1, 5], [2, 2, 2], [4, 2], [1, 1, 3, 1]))


def nested_functional():
    """A functional sub-model called inside a functional model."""
    def build():
        inner_in = keras.Input((6,))
        inner = keras.Model(inner_in, keras.layers.Dense(5, activation="relu")(
            keras.layers.Dense(5)(inner_in)), name="inner")
        inputs = keras.Input((6,))
        h = inner(inputs)
        h = keras.layers.Dense(4, activation="relu")(h)
        return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))

    return Pattern("nested_functional", build, lambda: (_features(), _classes(), None),
                   dict(loss="sparse_categorical_crossentropy", metrics=["accuracy"]),
                   balances=([1, 3], [2, 2]))


# -- preprocessing, Lambda, custom layers ------------------------------------


def preprocessing():
    """Adapted Normalization and IntegerLookup, and a TextVectorization on strings."""
    words = np.resize(np.array(["red green blue", "blue sky", "green red red", "sky"]), N)
    numbers = _features(d=3) * 5.0 + 3.0
    ids = _rng(7).integers(0, 10, size=(N, 4))

    def build():
        num_in = keras.Input((3,), name="numbers")
        ids_in = keras.Input((4,), dtype="int64", name="ids")
        text_in = keras.Input((1,), dtype="string", name="text")
        norm = keras.layers.Normalization()
        norm.adapt(numbers)
        lookup = keras.layers.IntegerLookup()
        lookup.adapt(ids)
        vectorize = keras.layers.TextVectorization(max_tokens=8, output_sequence_length=3)
        vectorize.adapt(words)
        a = keras.layers.Dense(4)(norm(num_in))
        b = keras.layers.Flatten()(keras.layers.Embedding(12, 2)(lookup(ids_in)))
        c = keras.layers.Flatten()(keras.layers.Embedding(8, 2)(vectorize(text_in)))
        h = keras.layers.Concatenate()([a, b, c])
        return keras.Model([num_in, ids_in, text_in],
                           keras.layers.Dense(1, activation="sigmoid")(h))

    def data():
        text = tf.constant(words[:, None])  # Keras' array adapter takes no NumPy str arrays
        return [numbers, ids, text], _classes(k=2)[:, None].astype("float32"), None

    return Pattern("preprocessing", build, data, dict(loss="binary_crossentropy"))


class ScaleNoConfig(keras.layers.Layer):
    """A custom layer with a required constructor argument and no get_config."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w * self.factor


def lambda_and_custom():
    def build():
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5),
                                 keras.layers.Lambda(lambda t: t * 2.0 + 1.0),
                                 ScaleNoConfig(0.5),
                                 keras.layers.Dense(3, activation="softmax")])

    return Pattern("lambda_and_custom", build, lambda: (_features(), _classes(), None),
                   dict(loss="sparse_categorical_crossentropy"), balances=([1, 1, 1, 1],))


# -- shared weights ------------------------------------------------------------


def shared_layer():
    """A siamese encoder called on two inputs, then once more later: one
    layer at three nodes, across stages."""
    def build():
        a, b = keras.Input((6,), name="a"), keras.Input((6,), name="b")
        encoder = keras.layers.Dense(6, activation="relu", name="encoder")
        h = keras.layers.Concatenate()([encoder(a), keras.layers.Dense(6)(encoder(b))])
        h = encoder(keras.layers.Dense(6)(h))
        return keras.Model([a, b], keras.layers.Dense(1, activation="sigmoid")(h))

    def data():
        x = _features()
        return [x, x[::-1].copy()], _classes(k=2)[:, None].astype("float32"), None

    # Units: encoder(a), encoder(b), dense, concatenate, dense, encoder, head.
    return Pattern("shared_layer", build, data, dict(loss="binary_crossentropy"),
                   balances=([1, 2, 2, 2], [3, 4]))


# -- several inputs and outputs ------------------------------------------------


def _two_heads():
    inputs = keras.Input((6,), name="features")
    h = keras.layers.Dense(8, activation="relu")(inputs)
    h = keras.layers.Dense(8, activation="relu")(h)
    cls = keras.layers.Dense(3, activation="softmax", name="cls")(h)
    reg = keras.layers.Dense(1, name="reg")(h)
    return keras.Model(inputs, [cls, reg])


def multi_output(style):
    """List outputs with dict or list losses, loss_weights and metrics: Keras'
    history keys (`cls_loss`, `reg_mae`, ...) must come out the same."""
    def data():
        y_cls, y_reg = _classes(), _rng(8).normal(size=(N, 1)).astype("float32")
        y = {"cls": y_cls, "reg": y_reg} if style == "dict" else [y_cls, y_reg]
        return _features(), y, None

    if style == "dict":
        compile_kwargs = dict(loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                              loss_weights={"cls": 1.0, "reg": 0.5},
                              metrics={"cls": ["accuracy"], "reg": ["mae"]})
    else:
        compile_kwargs = dict(loss=["sparse_categorical_crossentropy", "mse"],
                              loss_weights=[2.0, 1.0], metrics=[["accuracy"], ["mae"]])
    return Pattern(f"multi_output_{style}", _two_heads, data, compile_kwargs)


def dict_inputs():
    """List inputs fed as a dict keyed by the Input names."""
    def build():
        left, right = keras.Input((6,), name="left"), keras.Input((6,), name="right")
        h = keras.layers.Concatenate()([keras.layers.Dense(4)(left), keras.layers.Dense(4)(right)])
        return keras.Model([left, right], keras.layers.Dense(1, activation="sigmoid")(h))

    def data():
        x = _features()
        return ({"right": x * 2.0, "left": x}, _classes(k=2)[:, None].astype("float32"), None)

    return Pattern("dict_inputs", build, data, dict(loss="binary_crossentropy"))


# -- stage losses, sample weights, reductions ---------------------------------


class AddsLoss(keras.layers.Layer):
    """A layer that adds a loss while it runs (a mean over its rows)."""

    def call(self, x):
        self.add_loss(0.01 * keras.ops.mean(keras.ops.sum(keras.ops.square(x), axis=-1)))
        return x


def stage_losses():
    """Weight and activity regularisers and add_loss, on a ragged last batch."""
    def build():
        return keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu", kernel_regularizer="l2"),
            keras.layers.Dense(8, activation="relu", activity_regularizer="l2"),
            AddsLoss(),
            keras.layers.Dense(3, activation="softmax", bias_regularizer="l1")])

    return Pattern("stage_losses", build, lambda: (_features(), _classes(), None),
                   dict(loss="sparse_categorical_crossentropy"))


def sample_weights(reduction):
    def build():
        return _mlp(3, None)()

    def data():
        return (_features(), _rng(9).normal(size=(N, 3)).astype("float32"),
                np.linspace(0.1, 2.0, N).astype("float32"))

    return Pattern(f"sample_weights_{reduction}", build, data,
                   dict(loss=keras.losses.MeanSquaredError(reduction=reduction),
                        weighted_metrics=["mae"]))


def sparse_input():
    """A tf.SparseTensor input (Keras multiplies it by the kernel sparsely)."""
    dense = ((_rng(10).random((N, 10)) < 0.3) * _rng(11).normal(size=(N, 10))).astype("float32")

    def build():
        inputs = keras.Input((10,), sparse=True)
        h = keras.layers.Dense(6, activation="relu")(inputs)
        h = keras.layers.Dense(4, activation="relu")(h)
        return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(h))

    def data():
        y = _classes(k=2)[:, None].astype("float32")
        return tf.data.Dataset.from_tensor_slices((tf.sparse.from_dense(dense), y)).batch(16), \
            None, None

    return Pattern("sparse_input", build, data, dict(loss="binary_crossentropy"))


def ragged_input():
    """A tf.RaggedTensor input of token lists of different lengths."""
    lengths = _rng(12).integers(1, 6, size=N)
    values = _rng(13).integers(1, 20, size=int(lengths.sum()))

    def build():
        inputs = keras.Input((None,), ragged=True, dtype="int32")
        h = keras.layers.Lambda(
            lambda t: tf.stack([tf.cast(tf.reduce_sum(t, axis=1), "float32") / 50.0,
                                tf.cast(t.row_lengths(), "float32") / 5.0], axis=1),
            output_shape=(2,))(inputs)
        h = keras.layers.Dense(6, activation="relu")(h)
        return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(h))

    def data():
        x = tf.RaggedTensor.from_row_lengths(values.astype("int32"), lengths)
        y = _classes(k=2)[:, None].astype("float32")
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(16), None, None

    return Pattern("ragged_input", build, data, dict(loss="binary_crossentropy"))


def all_patterns():
    return (crossentropy_patterns() + [
        masked_sequence(), ignore_class(), wrappers(), nested_functional(), preprocessing(),
        lambda_and_custom(), shared_layer(), multi_output("dict"), multi_output("list"),
        dict_inputs(), stage_losses(), sample_weights("sum_over_batch_size"),
        sample_weights("sum"), sample_weights("mean_with_sample_weight"), sparse_input(),
        ragged_input()])
