"""models/: the Transformer LM and the ResNet CNN, built offline and pipelined."""

import keras
import numpy as np
import pytest

import tfpipe
from models import resnet_cnn
from models import transformer_lm
from tfpipe import placement
from tfpipe_tests import helpers

TINY_LM = dict(num_layers=4, width=16, num_heads=2, vocab_size=32, seq_len=8, mlp_ratio=2)


def _assert_on_stage_devices(model):
    """Every stage's variables, and the Adam slots of its weights, on its device."""
    slots = {s.path: s for s in model.optimizer.variables}
    for stage, device in zip(model.stages, model.stage_devices):
        assert stage.weights
        assert placement.misplaced_variables(stage.weights, device) == []
        for var in stage.trainable_variables:
            name = var.path.replace("/", "_")
            mine = [s for p, s in slots.items()
                    if p.endswith(name + "_momentum") or p.endswith(name + "_velocity")]
            assert len(mine) == 2, var.path
            assert placement.misplaced_variables(mine, device) == []


def _sparse_ce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize("num_stages", [1, 2, 4, 8])
def test_stage_balances_spread_blocks_evenly(num_stages):
    layers = transformer_lm.lm_layers(**{**TINY_LM, "num_layers": 8})
    lm = transformer_lm.stage_balance(layers, num_stages)
    assert sum(lm) == len(layers) and len(lm) == num_stages
    blocks = [n for n in lm]
    blocks[0] -= 1   # the embedding
    blocks[-1] -= 2  # final norm and logits head
    assert blocks == [8 // num_stages] * num_stages

    cnn = resnet_cnn.resnet_cnn((8, 8, 1), num_blocks=8)
    balance = resnet_cnn.stage_balance(cnn, num_stages)
    assert sum(balance) == len(cnn.layers) and len(balance) == num_stages
    blocks = list(balance)
    blocks[0] -= resnet_cnn.STEM_LAYERS
    blocks[-1] -= resnet_cnn.HEAD_LAYERS
    assert blocks == [8 // num_stages] * num_stages


def test_stage_balance_uneven_and_too_many_stages():
    assert transformer_lm.blocks_per_stage(6, 4) == [2, 2, 1, 1]
    assert transformer_lm.stage_balance(transformer_lm.lm_layers(num_layers=4), 4) == [2, 1, 1, 3]
    assert resnet_cnn.stage_balance(resnet_cnn.resnet_cnn(num_blocks=4), 2) == [5, 4]
    with pytest.raises(ValueError, match="num_layers >= 8"):
        transformer_lm.transformer_stages(8, num_layers=4)
    with pytest.raises(ValueError, match="num_blocks=8"):
        resnet_cnn.stage_balance(resnet_cnn.resnet_cnn(num_blocks=4), 8)


def test_transformer_is_causal():
    keras.utils.set_random_seed(0)
    model = transformer_lm.transformer_lm(**TINY_LM)
    tokens = np.random.default_rng(0).integers(0, 32, size=(2, 8)).astype("int32")
    changed = tokens.copy()
    changed[:, 5:] = (changed[:, 5:] + 1) % 32
    a, b = model.predict(tokens, verbose=0), model.predict(changed, verbose=0)
    assert a.shape == (2, 8, 32)
    np.testing.assert_allclose(a[:, :5], b[:, :5], atol=1e-6)  # positions before 5: unaffected
    assert np.abs(a[:, 5:] - b[:, 5:]).max() > 1e-4


@pytest.mark.parametrize("which", ["transformer", "resnet"])
def test_reference_models_save_and_load(tmp_path, which):
    keras.utils.set_random_seed(0)
    if which == "transformer":
        model = transformer_lm.transformer_lm(**TINY_LM)
        x = np.arange(16, dtype="int32").reshape(2, 8) % 32
    else:
        model = resnet_cnn.resnet_cnn((8, 8, 1), num_blocks=2)
        x = np.random.default_rng(0).random((2, 8, 8, 1)).astype("float32")
    path = tmp_path / f"{which}.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               atol=1e-6)


def test_transformer_stages_train_on_4_devices():
    # Explicit stages: embedding + block | block | block | block + norm + logits.
    # Given the weights of the plain Sequential made of the same layers, they
    # compute the same function; then one pipelined Adam step on 4 devices.
    keras.utils.set_random_seed(0)
    plain = transformer_lm.transformer_lm(**TINY_LM)
    strategy = tfpipe.PipelineStrategy(num_microbatches=2)
    with strategy.scope():
        model = tfpipe.PipelinedModel(
            transformer_lm.transformer_stages(4, **TINY_LM),
            input_shape=(None, TINY_LM["seq_len"]), input_dtype="int32")
        model.compile(optimizer="adam", loss=_sparse_ce())
    stage_layers = [layer for stage in model.stages for layer in stage.layers]
    assert [l.name for l in stage_layers] == [l.name for l in plain.layers]
    for source, target in zip(plain.layers, stage_layers):
        target.set_weights(source.get_weights())
    tokens = np.random.default_rng(0).integers(0, 32, size=(8, 9)).astype("int32")
    x, y = tokens[:, :-1], tokens[:, 1:]
    np.testing.assert_allclose(model(x), plain(x), atol=1e-5)

    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert [len(s.layers) for s in model.stages] == [2, 1, 1, 3]
    assert len(set(model.stage_devices)) == 4
    _assert_on_stage_devices(model)


def test_resnet_from_model_trains_on_4_devices():
    keras.utils.set_random_seed(0)
    plain = resnet_cnn.resnet_cnn((8, 8, 1), num_classes=5, num_blocks=4)
    strategy = tfpipe.PipelineStrategy(num_microbatches=2)
    with strategy.scope():
        model = tfpipe.PipelinedModel.from_model(
            plain, balance=resnet_cnn.stage_balance(plain, 4))
        model.compile(optimizer="adam", loss=_sparse_ce())
    x, y = helpers.image_data(n=16, classes=5)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    # Each residual block is one layer, so no skip connection crosses a stage.
    assert [len(s.layers) for s in model.stages] == [4, 1, 1, 3]
    _assert_on_stage_devices(model)
