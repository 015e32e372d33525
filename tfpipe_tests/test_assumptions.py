"""What micro-batching assumes of a model is checked on the model in hand
(`tfpipe.assumptions`), on models from outside tfpipe's other tests:

- a forward that writes variables (keras' SpectralNormalization, a stateful
  LSTM, a layer counting its calls inside a `tf.cond`) is refused where the
  pipeline would write other than once a step (M > 1, or a replay), before
  any update, and trains as plain Keras where it writes once;
- a loss added in `call` that is not a mean over rows (a sum over rows, keras-
  hub Mixtral's router load-balancing loss, a random loss added only in
  training) is refused with its numbers, or trained with GPipe's meaning when
  asked (`call_losses="per_microbatch"`, checked against an oracle); a mean
  over rows behind dropout is accepted (decided in inference).
Every refusal here was a silent difference from plain Keras before.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe_tests import helpers

TOL = 1e-5
DEVICES = ["/CPU:0", "/CPU:1"]


class CountsCalls(keras.layers.Layer):
    """Counts its training calls in a non-trainable variable, the write inside
    a `tf.cond` (a function body the reader has to enter)."""

    def build(self, input_shape):
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="count")

    def call(self, x, training=False):
        if training:
            tf.cond(tf.size(x) > 0, lambda: tf.identity(self.count.value.assign_add(1.0)),
                    lambda: tf.identity(self.count.value))
        return x


def _spectral():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    h = keras.layers.SpectralNormalization(keras.layers.Dense(8), name="spectral")(h)
    return keras.Model(inputs, keras.layers.Dense(3)(h))


def _counter():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = CountsCalls(name="counter")(keras.layers.Dense(8, activation="relu")(inputs))
    return keras.Model(inputs, keras.layers.Dense(3)(h))


def _stateful_lstm():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5, 8), batch_size=8)
    h = keras.layers.LSTM(4, stateful=True, return_sequences=True, name="lstm")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))


def _rows(n=16, steps=None):
    rng = np.random.default_rng(0)
    shape = (n, 8) if steps is None else (n, steps, 8)
    return rng.normal(size=shape).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


WRITERS = {"spectral": (_spectral, _rows), "counter": (_counter, _rows),
           "stateful_lstm": (_stateful_lstm, lambda: _rows(16, 5))}


def _pipelined(model, m, recompute=None, execution=None, call_losses=None):
    given = {} if call_losses is None else {"call_losses": call_losses}
    strategy = tfpipe.PipelineStrategy(num_microbatches=m, devices=DEVICES, recompute=recompute,
                                       execution=execution, **given)
    with strategy.scope():
        pipelined = tfpipe.PipelinedModel.from_model(model)
        pipelined.compile(optimizer="sgd", loss="mse")
    return pipelined


# (model, M, recompute, execution, call, refusal or None: trains as plain Keras).
# Each writer refused at M > 1 (fit and evaluate) and under a replay, in every
# execution, and exact where it writes once a step.
WRITES = [
    ("spectral", 2, None, "unrolled", "fit",
     r"Stage \d: SpectralNormalization 'spectral' writes 'spectral/(vector_u|dense\w*/kernel)'.*"
     r"num_microbatches=2 the write would happen 2 times a step.*num_microbatches=1"),
    ("spectral", 1, "always", "stage_functions", "fit",
     r"SpectralNormalization 'spectral' writes .*recompute='always' replays the forward.*"
     r"recompute='never' or 'except_last'"),
    ("spectral", 1, None, "loop", "fit", r"recompute='always' replays the forward.*the loop "
                                         r"always recomputes"),
    ("counter", 4, None, "stage_functions", "fit",
     r"CountsCalls 'counter' writes 'counter/count' in its forward \(AssignAddVariableOp"),
    ("stateful_lstm", 2, None, "unrolled", "fit",
     r"LSTM 'lstm' writes an untracked variable.*once per micro-batch.*num_microbatches=1"),
    ("stateful_lstm", 2, None, "stage_functions", "evaluate", r"LSTM 'lstm' writes"),
    ("spectral", 1, "never", "unrolled", "fit", None),
    ("spectral", 1, None, "stage_functions", "fit", None),
    ("counter", 1, "except_last", "unrolled", "fit", None),
    ("stateful_lstm", 1, "never", "stage_functions", "fit", None),
]


@pytest.mark.parametrize("name, m, recompute, execution, call, refusal", WRITES)
def test_a_forward_that_writes_variables_is_refused_or_exact(name, m, recompute, execution,
                                                             call, refusal):
    make, data = WRITERS[name]
    x, y = data()
    model = make()
    pipelined = _pipelined(model, m, recompute, execution)
    before = [v.numpy().copy() for v in model.variables]
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            getattr(pipelined, call)(x, y, batch_size=8, verbose=0)
        assert int(pipelined.optimizer.iterations.numpy()) == 0
        assert helpers.max_abs_diff(before, [v.numpy() for v in model.variables]) == 0.0
        return
    plain = make()
    plain.compile(optimizer="sgd", loss="mse")
    plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)  # two steps
    pipelined.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    # Every variable, the written ones (vector_u, the count) included.
    assert helpers.max_abs_diff([v.numpy() for v in plain.variables],
                                [v.numpy() for v in model.variables]) < TOL


@keras.saving.register_keras_serializable(package="tfpipe_tests")
class SumOverRows(keras.layers.Layer):
    """Adds a penalty summed over the batch's rows: not a mean over rows."""

    def call(self, x):
        self.add_loss(1e-2 * tf.reduce_sum(tf.square(x)))
        return x


class NoisyPenalty(keras.layers.Layer):
    """Adds, in training only, a mean-over-rows penalty of its noisy input."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed = keras.random.SeedGenerator(1)

    def call(self, x, training=False):
        if training:
            noisy = x + keras.random.normal(tf.shape(x), seed=self.seed)
            self.add_loss(1e-2 * tf.reduce_mean(tf.square(noisy)))
        return x


def _with(layer):
    def make():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        h = keras.layers.Dense(8, activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.Dense(3)(layer()(h)))
    return make


def _dropout_then_activity():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dropout(0.3)(keras.layers.Dense(8, activation="relu")(inputs))
    h = keras.layers.Dense(8, activity_regularizer="l2", name="regularised")(h)
    return keras.Model(inputs, keras.layers.Dense(3)(h))


def _mixtral(coefficient):
    def make():
        keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is not installed")
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.MixtralBackbone(
            vocabulary_size=16, num_layers=2, num_query_heads=2, num_key_value_heads=1,
            hidden_dim=16, intermediate_dim=16, num_experts=4, top_k=2,
            router_aux_loss_coef=coefficient, dtype="float32")
        # Untied: the output embedding is never read (test_outside_models).
        backbone.token_embedding.reverse_embeddings.trainable = False
        return backbone
    return make


def _tokens():
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(1, 16, (16, 6)).astype("int32"),
         "padding_mask": np.ones((16, 6), "int32")}
    return x, rng.normal(size=(16, 6, 16)).astype("float32")


CALL_LOSS_MODELS = {
    "sum_over_rows": (_with(lambda: SumOverRows(name="sum_over_rows")), _rows),
    "noisy_in_training": (_with(lambda: NoisyPenalty(name="noisy")), _rows),
    "dropout_then_activity": (_dropout_then_activity, _rows),
    "mixtral": (_mixtral(0.5), _tokens),
    "mixtral_without_aux": (_mixtral(0.0), _tokens),
}
# (model, M, refusal, or "exact": plain Keras' weights, or "trains": no refusal)
CALL_LOSSES = [
    ("sum_over_rows", 2, r"Stage \d: the loss SumOverRows 'sum_over_rows' adds in its call is "
                         r"not a mean over rows: on micro-batches 0 and 1 of the first batch "
                         r"together \(4 \+ 4 rows\) it is [0-9.]+, but the row-weighted mean of "
                         r"its values on each alone is [0-9.]+ .*call_losses='per_microbatch'"),
    ("mixtral", 2, r"MixtralSparseMoeBlock '\w+' adds in its call is not a mean over rows"),
    ("noisy_in_training", 4, r"NoisyPenalty 'noisy' adds a loss in its call whose value depends "
                             r"on random draws.*only in training.*call_losses='per_microbatch'"),
    ("dropout_then_activity", 4, "trains"),
    ("mixtral_without_aux", 2, "exact"),
]


@pytest.mark.parametrize("name, m, expected", CALL_LOSSES)
def test_a_call_loss_must_be_a_mean_over_rows(name, m, expected):
    make, data = CALL_LOSS_MODELS[name]
    x, y = data()
    model = make()
    pipelined = _pipelined(model, m)
    before = [v.numpy().copy() for v in model.variables]
    if expected not in ("trains", "exact"):
        with pytest.raises(ValueError, match=expected):
            pipelined.fit(x, y, batch_size=8, verbose=0)
        assert helpers.max_abs_diff(before, [v.numpy() for v in model.variables]) == 0.0
        return
    history = pipelined.fit(x, y, batch_size=8, shuffle=False, verbose=0).history
    assert np.isfinite(history["loss"]).all()
    if expected == "exact":
        plain = make()
        plain.compile(optimizer="sgd", loss="mse")
        plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        assert helpers.max_abs_diff(plain.get_weights(), model.get_weights()) < TOL


def _per_microbatch_oracle(model, x, y, batch_size, m):
    """GPipe's meaning in plain TF: the compiled loss on the whole batch plus
    each micro-batch's call losses weighted by its rows, one SGD step."""
    optimizer = keras.optimizers.SGD()
    for start in range(0, len(x), batch_size):
        xb, yb = x[start:start + batch_size], y[start:start + batch_size]
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(yb, model(xb, training=True))
            total = tf.reduce_mean(loss)
            for rows in np.array_split(np.arange(len(xb)), m):
                model(xb[rows], training=True)
                total += tf.add_n(model.losses) * (len(rows) / len(xb))
        grads = tape.gradient(total, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))


def test_per_microbatch_call_losses_train_gpipes_meaning_and_say_so(tmp_path):
    """The opt-in trains each micro-batch's call loss weighted by its rows (an
    oracle in plain TF), and is kept in the config, summary and saved file."""
    make = CALL_LOSS_MODELS["sum_over_rows"][0]
    x, y = _rows()
    model = make()
    pipelined = _pipelined(model, 2, call_losses="per_microbatch")
    pipelined.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    oracle = make()
    _per_microbatch_oracle(oracle, x, y, 8, 2)
    assert helpers.max_abs_diff(oracle.get_weights(), model.get_weights()) < TOL
    lines = []
    pipelined.summary(print_fn=lines.append)
    assert "call_losses=per_microbatch" in "\n".join(lines)
    path = str(tmp_path / "per_microbatch.keras")
    pipelined.save(path)
    with tfpipe.PipelineStrategy(num_microbatches=2, devices=DEVICES).scope():
        assert tfpipe.load_model(path).call_losses == "per_microbatch"
    with pytest.raises(ValueError, match=r"Unknown call_losses 'per_row'. Use 'checked'"):
        tfpipe.PipelineStrategy(call_losses="per_row")
