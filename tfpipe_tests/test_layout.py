"""A pipelined model is not tied to its device layout (`tfpipe.layout`).

Written at K stages -- as a `.keras` file, with `save_weights`, or with
`tf.train.Checkpoint` -- it loads at K' stages with the same weights and the
same optimizer state (so the next step is the same step), every variable and
slot on its new stage's device. `to_keras` gives back the plain Keras model,
which loads without tfpipe.
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe_tests import helpers

X = np.random.RandomState(0).rand(16, 6).astype("float32")
Y = np.random.RandomState(1).randint(0, 3, 16)


def _functional():
    """A softmax classifier with Keras' default loss, a nested block and a tied use."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), name="features")
    block = keras.Sequential([keras.layers.Dense(8, activation="relu", name="inner_a"),
                              keras.layers.Dense(8, activation="tanh", name="inner_b")],
                             name="block")
    shared = keras.layers.Dense(8, activation="relu", name="shared")
    h = shared(keras.layers.Dense(8, name="entry")(inputs))
    h = shared(block(h))
    h = keras.layers.Dropout(0.0)(h)
    outputs = keras.layers.Dense(3, activation="softmax", name="head")(h)
    return keras.Model(inputs, outputs, name="classifier")


def _strategy(k):
    return tfpipe.PipelineStrategy(devices=[f"/CPU:{i}" for i in range(k)], num_microbatches=2)


def _pipelined(k, model=None):
    with _strategy(k).scope():
        pipelined = tfpipe.PipelinedModel.from_model(model or _functional())
        pipelined.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"])
    return pipelined


def _fit(model):
    return model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0).history


def _optimizer_state(model):
    return [np.asarray(v) for v in model.optimizer.variables]


def _assert_placed(model):
    """Every variable and Adam slot on the device of the first stage using it."""
    homes = {id(v): model.stage_devices[users[0]] for v, users in
             zip(model.pipeline.variables, model.pipeline.stage_of_variables())}
    for var in model.trainable_variables:
        home = homes[id(var)]
        slots = [s for s in model.optimizer.variables if s.path.startswith(
            f"{model.optimizer.name}/{var.path.replace('/', '_')}_")]
        assert slots, var.path
        for v in [var] + slots:
            assert tf.DeviceSpec.from_string(v.value.device).device_index == \
                tf.DeviceSpec.from_string(str(home)).device_index, (v.path, v.value.device, home)


def _through_keras_file(trained, k, tmp_path):
    path = os.path.join(tmp_path, "pipelined.keras")
    trained.save(path)
    with _strategy(k).scope():
        return tfpipe.load_model(path)


def _through_weights_file(trained, k, tmp_path):
    path = os.path.join(tmp_path, "pipelined.weights.h5")
    trained.save_weights(path)
    fresh = _pipelined(k)
    fresh.load_weights(path)
    return fresh


def _through_checkpoint(trained, k, tmp_path):
    prefix = tf.train.Checkpoint(model=trained, optimizer=trained.optimizer).write(
        os.path.join(tmp_path, "ckpt"))
    fresh = _pipelined(k)
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).read(prefix).assert_consumed()
    return fresh


ROUTES = {"keras_file": _through_keras_file, "weights_file": _through_weights_file,
          "tf_checkpoint": _through_checkpoint}


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("saved_k, loaded_k", [
    (4, 2), pytest.param(2, 3, marks=pytest.mark.slow), pytest.param(3, 1, marks=pytest.mark.slow)])
def test_written_at_k_stages_loads_at_k_prime_and_trains_on(tmp_path, route, saved_k, loaded_k):
    trained = _pipelined(saved_k)
    _fit(trained)
    loaded = ROUTES[route](trained, loaded_k, tmp_path)
    assert len(loaded.stages) == loaded_k
    helpers.assert_same_predictions(loaded.predict(X, verbose=0), trained.predict(X, verbose=0))
    for ours, theirs in zip(_optimizer_state(loaded), _optimizer_state(trained), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    _assert_placed(loaded)
    # The next step is the same step at either layout.
    np.testing.assert_allclose(_fit(loaded)["loss"], _fit(trained)["loss"], rtol=1e-6)
    for ours, theirs in zip(loaded.get_weights(), trained.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)


def test_checkpoint_keys_are_the_plain_models_keys(tmp_path):
    """tf.train.Checkpoint(model=pipelined) is keyed as the plain Keras model:
    the two restore into each other (BatchNorm statistics included)."""
    def with_bn():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                 keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    plain = with_bn()
    plain.layers[1].moving_mean.assign(np.arange(8, dtype="float32"))
    plain_prefix = tf.train.Checkpoint(model=plain).write(os.path.join(tmp_path, "plain"))
    with _strategy(2).scope():
        pipelined = tfpipe.PipelinedModel.from_model(with_bn(), balance=[2, 1])
    pipelined_prefix = tf.train.Checkpoint(model=pipelined).write(os.path.join(tmp_path, "pipe"))
    keys = [sorted(k for k, _ in tf.train.list_variables(p)) for p in (plain_prefix,
                                                                      pipelined_prefix)]
    assert keys[0] == keys[1] and any("moving_mean" in k for k in keys[0])
    tf.train.Checkpoint(model=pipelined).read(plain_prefix).assert_consumed()
    np.testing.assert_array_equal(pipelined.source_model.layers[1].moving_mean.numpy(),
                                  np.arange(8))


def test_to_keras_is_plain_keras_with_the_weights_and_optimizer_state(tmp_path):
    trained = _pipelined(4)
    _fit(trained)
    plain = trained.to_keras(device="/CPU:0")
    assert isinstance(plain, keras.Model) and not isinstance(plain, tfpipe.PipelinedModel)
    assert [layer.name for layer in plain.layers] == \
        [layer.name for layer in trained.source_model.layers]
    assert {tf.DeviceSpec.from_string(v.value.device).device_index
            for v in plain.variables + plain.optimizer.variables} == {0}
    assert not {id(v) for v in plain.variables} & {id(v) for v in trained.variables}
    helpers.assert_same_predictions(plain.predict(X, verbose=0), trained.predict(X, verbose=0))
    np.testing.assert_allclose(_fit(plain)["loss"], _fit(trained)["loss"], rtol=1e-6)
    for ours, theirs in zip(plain.get_weights(), trained.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)
    # Saved by plain Keras, loaded by plain Keras in a process that never imports tfpipe.
    path = os.path.join(tmp_path, "plain.keras")
    plain.save(path)
    np.save(os.path.join(tmp_path, "x.npy"), X)
    code = ("import sys, numpy as np, keras; m = keras.models.load_model(sys.argv[1]); "
            "np.save(sys.argv[3], m.predict(np.load(sys.argv[2]), verbose=0)); "
            "assert 'tfpipe' not in sys.modules")
    subprocess.run([sys.executable, "-c", code, path, os.path.join(tmp_path, "x.npy"),
                    os.path.join(tmp_path, "y.npy")], check=True, timeout=120,
                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, cwd=tmp_path)
    np.testing.assert_allclose(np.load(os.path.join(tmp_path, "y.npy")),
                               plain.predict(X, verbose=0), atol=1e-7)


def test_to_keras_of_hand_made_stages_chains_them():
    with _strategy(2).scope():
        pipelined = tfpipe.PipelinedModel(
            [keras.layers.Dense(5, activation="relu"), keras.layers.Dense(3)],
            input_shape=(None, 6), name="pipelined_chain")
    plain = pipelined.to_keras(include_optimizer=False)
    assert plain.name == "chain" and len(plain.layers) == 3  # input, stage 0, stage 1
    helpers.assert_same_predictions(plain.predict(X, verbose=0),
                                    pipelined.predict(X, verbose=0))


def test_a_plain_keras_file_loads_cut_for_the_strategy(tmp_path):
    plain = _functional()
    plain.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    plain.fit(X, Y, batch_size=16, verbose=0)
    path = os.path.join(tmp_path, "plain.keras")
    plain.save(path)
    with _strategy(2).scope():
        loaded = tfpipe.load_model(path, balance=[3, 4], num_microbatches=4)
    assert loaded.balance == [3, 4] and loaded.num_microbatches == 4
    helpers.assert_same_predictions(loaded.predict(X, verbose=0), plain.predict(X, verbose=0))
    for ours, theirs in zip(_optimizer_state(loaded), _optimizer_state(plain), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    _assert_placed(loaded)


def _saved_at_4(tmp_path):
    path = os.path.join(tmp_path, "four.keras")
    _pipelined(4).save(path)
    return path


def _hand_made_at_2(tmp_path):
    path = os.path.join(tmp_path, "hand.keras")
    with _strategy(2).scope():
        tfpipe.PipelinedModel([keras.layers.Dense(4), keras.layers.Dense(3)],
                              input_shape=(None, 6), name="hand").save(path)
    return path


def _plain_load_in_2(path):
    with _strategy(2).scope():
        keras.models.load_model(path)


def _load_in_1(path):
    with _strategy(1).scope():
        tfpipe.load_model(path)


def _to_keras_in_scope(tmp_path):
    model = _pipelined(2)
    with _strategy(2).scope():
        model.to_keras()


def _config_without_settings(tmp_path):
    config = _pipelined(2).get_config()
    del config["pipeline"]
    with _strategy(2).scope():
        tfpipe.PipelinedModel.from_config(config)


ERRORS = [
    ("config_without_settings", _config_without_settings,
     "This PipelinedModel config has no 'pipeline' settings"),
    ("plain_keras_load_at_fewer_devices", lambda p: _plain_load_in_2(_saved_at_4(p)),
     "holds a pipeline of 4 stages (balance=[2, 1, 1, 3]), but the PipelineStrategy in "
     "scope places at most 2 with schedule='zbh1'. Load it with tfpipe.load_model(path)"),
    ("hand_made_stages_re_cut", lambda p: _load_in_1(_hand_made_at_2(p)),
     "holds 2 hand-made stages, which cannot be cut again."),
    ("unknown_setting", lambda p: tfpipe.load_model(_saved_at_4(p), devices=["/CPU:0"]),
     "load_model got unknown setting(s) ['devices']"),
    ("not_a_keras_file", lambda p: tfpipe.load_model(os.path.join(p, "ckpt-3")),
     "path must be a .keras file, got"),
    ("to_keras_in_a_strategy_scope", _to_keras_in_scope,
     "to_keras must be called outside any distribution strategy scope"),
]


@pytest.mark.parametrize("action, message", [pytest.param(a, m, id=i) for i, a, m in ERRORS])
def test_layout_errors_name_the_fix(tmp_path, action, message):
    with pytest.raises(ValueError) as err:
        action(tmp_path)
    assert message in str(err.value)
