"""PipelinedModel behaves as a Keras model: fit options (class weights, a
validation split and frequency, an initial epoch), callbacks (early stopping, a
learning-rate plateau, checkpoints, a CSV log, backup and restore), the
one-batch calls, gradient clipping and schedules, saving."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe import placement
from tfpipe_tests import helpers


def _model(m=2, **compile_kwargs):
    compile_kwargs = compile_kwargs or dict(optimizer="adam", loss="mse", metrics=["mae"])
    ref = helpers.reference(helpers.mlp_layers(), (8,))
    return ref, helpers.pipelined_copy(ref, m, balance=[1, 1, 1, 1], **compile_kwargs)


class _Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.events = []

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(("epoch", epoch, sorted(logs)))

    def on_train_batch_end(self, batch, logs=None):
        self.events.append(("batch", batch))


def test_fit_with_validation_callbacks_and_dataset():
    x, y = helpers.regression_data(n=96)
    ref, model = _model(m=4)
    ref.compile(optimizer="adam", loss="mse", metrics=["mae"])
    train = tf.data.Dataset.from_tensor_slices((x[:64], y[:64])).batch(16)
    val = tf.data.Dataset.from_tensor_slices((x[64:], y[64:])).batch(16)
    recorder = _Recorder()
    history = model.fit(train, validation_data=val, epochs=2, verbose=0, callbacks=[recorder])
    ref_history = ref.fit(train, validation_data=val, epochs=2, verbose=0)
    assert [e for e in recorder.events if e[0] == "epoch"] == [
        ("epoch", 0, ["loss", "mae", "val_loss", "val_mae"]),
        ("epoch", 1, ["loss", "mae", "val_loss", "val_mae"]),
    ]
    assert len([e for e in recorder.events if e[0] == "batch"]) == 8
    for key in ("loss", "val_loss", "val_mae"):
        np.testing.assert_allclose(history.history[key], ref_history.history[key], rtol=1e-5)


def test_steps_per_execution_trains_identically():
    x, y = helpers.regression_data(n=64)
    ref, model = _model(m=2, optimizer="adam", loss="mse", steps_per_execution=2)
    ref.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    assert helpers.max_abs_diff(ref.get_weights(), helpers.stage_weights(model)) < 1e-5


def test_progress_bar_prints_metrics(capsys):
    x, y = helpers.regression_data(n=32)
    _, model = _model()
    model.fit(x, y, batch_size=16, epochs=1, verbose=1)
    out = capsys.readouterr().out
    assert "2/2" in out and "loss:" in out and "mae:" in out


def test_keras_save_and_load_round_trip(tmp_path):
    x, y = helpers.regression_data(n=32)
    _, model = _model(m=4)
    model.fit(x, y, batch_size=16, verbose=0)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    strategy = tfpipe.PipelineStrategy(num_microbatches=4)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    assert isinstance(loaded, tfpipe.PipelinedModel)
    assert loaded.num_microbatches == 4 and len(loaded.stages) == 4
    np.testing.assert_allclose(loaded.predict(x, batch_size=16, verbose=0),
                               model.predict(x, batch_size=16, verbose=0), atol=1e-6)
    for stage, device in zip(loaded.stages, loaded.stage_devices):
        assert not placement.misplaced_variables(stage.weights, device)
    # The optimizer state came back too: training continues identically.
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert helpers.max_abs_diff(helpers.stage_weights(model), helpers.stage_weights(loaded)) < 1e-6


def test_save_weights_and_load_weights(tmp_path):
    x, _ = helpers.regression_data(n=16)
    _, trained = _model()
    path = os.path.join(tmp_path, "pipe.weights.h5")
    trained.save_weights(path)
    _, fresh = _model()
    for stage in fresh.stages:
        stage.set_weights([np.zeros_like(w) for w in stage.get_weights()])
    fresh.load_weights(path)
    np.testing.assert_allclose(fresh.predict(x, batch_size=16, verbose=0),
                               trained.predict(x, batch_size=16, verbose=0), atol=1e-7)


def test_summary_shows_stages_and_devices():
    _, model = _model(m=8)
    lines = []
    model.summary(print_fn=lambda line, **kwargs: lines.append(line))
    text = "\n".join(lines)
    assert "4 stage(s) on 4 device(s) x 8 micro-batch(es), schedule=gpipe" in text
    assert "schedule's ideal bubble (F=1, B=2)=27.3%" in text  # (K - 1) / (M + K - 1) = 3 / 11
    assert "peak live activations per device=[8, 8, 8, 8]" in text
    assert "(None, 16)" in text and "(None, 3)" in text  # batch stays unspecified
    for k in range(4):
        assert f"stage_{k}" in text and f"CPU:{k}" in text


def test_jit_compile_auto_is_turned_off():
    _, model = _model()
    assert model.jit_compile is False


def test_predict_keeps_order_with_ragged_batches():
    x = np.arange(37 * 2, dtype="float32").reshape(37, 2)
    strategy = tfpipe.PipelineStrategy(num_microbatches=4)
    with strategy.scope():
        model = tfpipe.PipelinedModel(
            [keras.layers.Identity(), keras.layers.Lambda(lambda t: t * 2.0)],
            input_shape=(None, 2))
    np.testing.assert_array_equal(model.predict(x, batch_size=8, verbose=0), x * 2.0)


def _classifier():
    """A softmax classifier from outside tfpipe's own tests, 2 layers."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu", name="encoder")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax", name="head")(h))


def _history(history):
    return {k: np.round(v, 5).tolist() for k, v in history.history.items()}


def _weighted_validated(model, x, y, _):
    return _history(model.fit(x, y, batch_size=8, epochs=3, initial_epoch=1, shuffle=False,
                              verbose=0, validation_split=0.25, validation_freq=2,
                              class_weight={0: 1.0, 1: 2.0, 2: 0.5}))


def _callbacks(model, x, y, folder):
    stops = [keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=10.0),
             keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0, min_delta=10.0),
             keras.callbacks.ModelCheckpoint(os.path.join(folder, "w.weights.h5"),
                                             save_weights_only=True),
             keras.callbacks.CSVLogger(os.path.join(folder, "log.csv"))]
    history = model.fit(x, y, batch_size=8, epochs=5, shuffle=False, verbose=0, callbacks=stops)
    with open(os.path.join(folder, "log.csv"), encoding="utf-8") as f:
        return _history(history), sorted(os.listdir(folder)), f.read().splitlines()[0]


def _on_batch(model, x, y, _):
    model.train_on_batch(x[8:16], y[8:16])
    trained = model.train_on_batch(x[:8], y[:8], return_dict=True)
    tested = model.test_on_batch(x[8:16], y[8:16], return_dict=True)
    return ({k: round(float(v), 5) for k, v in {**trained, **tested}.items()},
            np.round(model.predict_on_batch(x[:8]), 5).tolist())


def _backup_and_restore(model, x, y, folder):
    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt
    backup = os.path.join(folder, "backup")
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()])
    return _history(model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
                              callbacks=[keras.callbacks.BackupAndRestore(backup)]))


# (what the user does, the optimizer's options): Keras' fit options, callbacks and
# one-batch calls, each with a gradient transform Keras applies to the summed
# gradient, so that a per-micro-batch one would show.
@pytest.mark.parametrize("use, options", [
    (_weighted_validated, {"global_clipnorm": 0.01}),
    (_callbacks, {"clipvalue": 0.001}),
    (_on_batch, {"learning_rate": keras.optimizers.schedules.ExponentialDecay(0.01, 1, 0.5)}),
    (_backup_and_restore, {"clipnorm": 0.001}),
], ids=["class_weight-validation_split-initial_epoch", "callbacks", "on_batch-lr_schedule",
        "backup_and_restore"])
def test_keras_fit_options_and_callbacks_as_plain_keras(use, options, tmp_path):
    """Weights within 1e-5 and the same history, files and returns as plain Keras."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 6)).astype("float32"), rng.integers(0, 3, 48)
    results = []
    for pipelined in (False, True):
        model = _classifier()
        trained = model
        if pipelined:
            with tfpipe.PipelineStrategy(num_microbatches=2, devices=["/CPU:0", "/CPU:1"]).scope():
                trained = tfpipe.PipelinedModel.from_model(model, balance=[1, 1])
        trained.compile(optimizer=keras.optimizers.Adam(**{"learning_rate": 0.01, **options}),
                        loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        folder = tmp_path / ("pipelined" if pipelined else "plain")
        folder.mkdir()
        results.append((model.get_weights(), use(trained, x, y, str(folder))))
    (plain_weights, plain_said), (weights, said) = results
    assert helpers.max_abs_diff(plain_weights, weights) < 1e-5
    assert said == plain_said
