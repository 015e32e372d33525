"""Models from outside that tfpipe cannot train as their own `fit` would are
refused with the way out, never trained silently wrong:

- a trainable variable no gradient reaches (keras-hub's untied Llama output
  embedding, a layer's spare weight): one refusal in every execution, before
  any optimizer touches a variable (no AdamW decay, no slots);
- a model class overriding a Keras hook tfpipe does not run (`train_step`,
  `test_step`, `predict_step`, `compute_loss`, `compute_metrics`, `call`),
  from `from_model` and from `load_model`;
- a subclassed model, whose error says how to pipeline it; both ways it
  names train as the plain model does.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe import graph as graph_lib
from tfpipe_tests import helpers

TOL = 1e-5


def _llama():
    keras_hub = pytest.importorskip(
        "keras_hub", reason="keras-hub is not installed (pip install -e '.[test]' installs it)")
    keras.utils.set_random_seed(0)
    # tie_word_embeddings=False (the default): `reverse_embeddings` is a
    # trainable weight that the backbone's output never reads.
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=16, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, dtype="float32")


def _llama_data():
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(1, 16, (16, 6)).astype("int32"),
         "padding_mask": np.ones((16, 6), "int32")}
    return x, rng.normal(size=(16, 6, 16)).astype("float32")


class WithSpareWeight(keras.layers.Layer):
    """A layer with a trainable weight its call never reads."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 4), name="kernel")
        self.spare = self.add_weight(shape=(3, 3), name="spare")

    def call(self, x):
        return x @ self.kernel


def _spare():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = WithSpareWeight(name="with_spare")(keras.layers.Dense(6)(inputs))
    return keras.Model(inputs, keras.layers.Dense(2)(h))


def _spare_data():
    return helpers.regression_data(n=32, outputs=2)


MODELS = {"llama": (_llama, _llama_data, "token_embedding/reverse_embeddings"),
          "spare_weight": (_spare, _spare_data, "with_spare/spare")}


# Every execution x every optimizer once (eager: run_eagerly=True), the two
# models taking turns. Before the fix, stage functions handed the optimizer a
# scalar zero: SGD crashed, Adam trained on, AdamW decayed the unused weight.
@pytest.mark.parametrize("model_name, execution, optimizer", [
    ("llama", "unrolled", "sgd"),
    ("llama", "loop", "adam"),
    ("llama", "stage_functions", "adamw"),
    ("spare_weight", "stage_functions", "sgd"),
    ("spare_weight", "stage_functions", "adam"),
    ("spare_weight", "unrolled", "adamw"),
    ("spare_weight", "loop", "sgd"),
    ("llama", "unrolled", "adam"),
    ("spare_weight", "loop", "adamw"),
    ("spare_weight", "eager", "adamw"),
])
def test_a_variable_no_gradient_reaches_is_refused_before_any_update(model_name, execution,
                                                                      optimizer):
    make, data, path = MODELS[model_name]
    model = make()
    eager = execution == "eager"
    strategy = tfpipe.PipelineStrategy(num_microbatches=2, devices=["/CPU:0", "/CPU:1"],
                                       execution=None if eager else execution)
    with strategy.scope():
        pipelined = tfpipe.PipelinedModel.from_model(model)
        pipelined.compile(optimizer=optimizer, loss="mse", run_eagerly=eager)
    before = [v.numpy().copy() for v in model.variables]
    x, y = data()
    with pytest.raises(ValueError, match=rf"No gradient reaches 1 trainable variable\(s\).*"
                                         rf"\['{path}'\].*variable.trainable = False"):
        pipelined.fit(x, y, batch_size=8, verbose=0)
    assert int(pipelined.optimizer.iterations.numpy()) == 0
    assert helpers.max_abs_diff(before, [v.numpy() for v in model.variables]) == 0.0


def test_freezing_the_unreached_variable_trains_as_plain_keras():
    """The refusal's way out, on the execution that used to go wrong."""
    x, y = _llama_data()
    plain = _llama()
    plain.token_embedding.reverse_embeddings.trainable = False
    plain.compile(optimizer="adamw", loss="mse")
    plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    model = _llama()
    model.token_embedding.reverse_embeddings.trainable = False
    strategy = tfpipe.PipelineStrategy(num_microbatches=2, devices=["/CPU:0", "/CPU:1"],
                                       execution="stage_functions")
    with strategy.scope():
        pipelined = tfpipe.PipelinedModel.from_model(model)
        pipelined.compile(optimizer="adamw", loss="mse")
    pipelined.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert helpers.max_abs_diff(plain.get_weights(), model.get_weights()) < TOL


# -- hooks tfpipe does not run ------------------------------------------------


class TrainStep(keras.Model):
    def train_step(self, data):
        return super().train_step(data)


class TestStep(keras.Model):
    def test_step(self, data):
        return super().test_step(data)


class PredictStep(keras.Model):
    def predict_step(self, data):
        return super().predict_step(data) * 2.0


class ExtraLoss(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.1 * keras.ops.mean(keras.ops.square(y_pred))


class InheritsExtraLoss(ExtraLoss):
    """The override is one class up: still refused, naming that class."""


class OwnMetrics(keras.Model):
    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return super().compute_metrics(x, y, y_pred, sample_weight)


class Doubling(keras.Model):
    def call(self, inputs, training=None, mask=None):
        return 2.0 * super().call(inputs, training=training, mask=mask)


@keras.saving.register_keras_serializable(package="tfpipe_tests")
class Autoencoder(keras.Model):
    """VAE-style: the loss is made from the outputs inside train_step."""

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x, training=True) - x))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def _functional(cls, width=8):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(width)(keras.layers.Dense(4)(inputs))
    return cls(inputs, outputs)


def _saved_and_loaded(tmp_path):
    path = str(tmp_path / "autoencoder.keras")
    _functional(Autoencoder).save(path)
    with tfpipe.PipelineStrategy(num_microbatches=2).scope():
        tfpipe.load_model(path, compile=False)


def _cut(cls):
    def run(tmp_path):
        with tfpipe.PipelineStrategy(num_microbatches=2).scope():
            tfpipe.PipelinedModel.from_model(_functional(cls))
    return run


@pytest.mark.parametrize("make, hook, where, fix", [
    (_cut(TrainStep), "train_step", "TrainStep", "the compiled loss"),
    (_cut(TestStep), "test_step", "TestStep", "the compiled loss"),
    (_cut(PredictStep), "predict_step", "PredictStep", "post-process what predict"),
    (_cut(ExtraLoss), "compute_loss", "ExtraLoss", "an add_loss\\(\\) call in a layer"),
    (_cut(InheritsExtraLoss), "compute_loss", "ExtraLoss", "a custom loss function"),
    (_cut(OwnMetrics), "compute_metrics", "OwnMetrics", "compile\\(metrics=...\\)"),
    (_cut(Doubling), "call", "Doubling", "into the functional graph"),
    (_saved_and_loaded, "train_step", "Autoencoder", "or train the plain model"),
], ids=["train_step", "test_step", "predict_step", "compute_loss", "inherited_compute_loss",
        "compute_metrics", "call", "load_model_vae_train_step"])
def test_a_model_overriding_a_hook_tfpipe_does_not_run_is_refused(make, hook, where, fix,
                                                                   tmp_path):
    with pytest.raises(ValueError, match=rf"overrides {hook}\(\) \(in class {where}\), which a "
                                         rf"PipelinedModel does not run.*{fix}"):
        make(tmp_path)


def test_a_nested_model_overriding_call_runs_its_own_call():
    """Not inlined (its graph is not what it computes): one unit, trained exactly."""
    def make():
        keras.utils.set_random_seed(0)
        inner_in = keras.Input((4,))
        inner = Doubling(inner_in, keras.layers.Dense(4)(inner_in), name="doubling")
        inputs = keras.Input((8,))
        return keras.Model(inputs, keras.layers.Dense(2)(inner(keras.layers.Dense(4)(inputs))))
    x, y = helpers.regression_data(n=32, outputs=2)
    plain = make()
    plain.compile(optimizer="sgd", loss="mse")
    plain.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    model = make()
    with tfpipe.PipelineStrategy(num_microbatches=2, devices=["/CPU:0", "/CPU:1"]).scope():
        pipelined = tfpipe.PipelinedModel.from_model(model, balance=[2, 1])
        pipelined.compile(optimizer="sgd", loss="mse")
    assert "doubling" in [u.op.name for u in graph_lib.model_graph(model).units]
    pipelined.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert helpers.max_abs_diff(plain.get_weights(), model.get_weights()) < TOL


# -- subclassed models ----------------------------------------------------------


class PyTorchStyleNet(keras.Model):
    """Layers in __init__, a call method: the README's 'Subclassed models'."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.middle = keras.layers.Dense(16, activation="relu")
        self.head = keras.layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.head(self.middle(self.hidden(x)))


def _net():
    keras.utils.set_random_seed(0)
    net = PyTorchStyleNet()
    net.build((None, 8))
    return net


def test_a_subclassed_model_is_refused_with_both_ways_to_pipeline_it():
    with tfpipe.PipelineStrategy().scope():
        with pytest.raises(ValueError, match=r"got PyTorchStyleNet, a subclassed model.*"
                                             r"rebuild it as a functional model from its own "
                                             r"layers.*write the stages yourself"):
            tfpipe.PipelinedModel.from_model(_net())


def _as_functional(net):
    inputs = keras.Input((8,))
    outputs = net.head(net.middle(net.hidden(inputs)))
    return tfpipe.PipelinedModel.from_model(keras.Model(inputs, outputs), balance=[2, 1])


def _as_stages(net):
    return tfpipe.PipelinedModel([keras.Sequential([net.hidden, net.middle]), net.head],
                                 input_shape=(None, 8))


@pytest.mark.parametrize("recipe", [_as_functional, _as_stages], ids=["functional", "stages"])
def test_the_subclassed_model_recipes_train_as_the_plain_model(recipe):
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, 32)
    plain = _net()
    plain.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    plain.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    net = _net()
    with tfpipe.PipelineStrategy(num_microbatches=4, devices=["/CPU:0", "/CPU:1"]).scope():
        pipelined = recipe(net)
        pipelined.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    pipelined.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert helpers.max_abs_diff(plain.get_weights(), net.get_weights()) < TOL
