"""models/unet.py: skips across every cut; trains in a 4-stage pipeline, exactly."""

import keras
import numpy as np
import pytest

import tfpipe
from tfpipe_tests import helpers
from models import unet as unet_lib
from tfpipe import cutting
from tfpipe import graph as graph_lib
from tfpipe import placement


@pytest.mark.parametrize("batch_norm, expected", [
    (False, {1: [24], 2: [12, 12], 4: [6, 6, 6, 6], 8: [3, 3, 3, 3, 3, 3, 2, 4]}),
    (True, {1: [52], 2: [26, 26], 4: [13, 13, 13, 13], 8: [7, 6, 6, 7, 6, 7, 5, 8]}),
])
def test_stage_balance_puts_a_skip_across_every_cut(batch_norm, expected):
    model = unet_lib.unet(batch_norm=batch_norm)
    graph = graph_lib.model_graph(model)
    for k, balance in expected.items():
        assert unet_lib.stage_balance(model, k) == balance
        for crossing in cutting.boundaries(graph, balance):
            # The main path and at least one encoder skip tensor.
            assert len(crossing) >= 2 and any(n.startswith("enc") for n in crossing), crossing
    with pytest.raises(ValueError, match="only 18 cut positions"):
        unet_lib.stage_balance(unet_lib.unet(), 21)


def _segmentation_data(n=32, size=32, seed=0):
    """Images of smooth noise; the label is where the smoothed image is positive."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, size, size, 1)).astype("float32")
    padded = np.pad(x[..., 0], ((0, 0), (2, 2), (2, 2)), mode="wrap")
    smooth = sum(padded[:, i:i + size, j:j + size] for i in range(5) for j in range(5))
    return x, (smooth > 0).astype("int32")


def _compile(model):
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


@pytest.mark.slow  # ~14 s; launch.train --model=unet runs in the default suite
def test_trains_in_four_stages_exactly_like_keras():
    keras.utils.set_random_seed(0)
    ref = unet_lib.unet()
    x, y = _segmentation_data()
    strategy = tfpipe.PipelineStrategy(num_microbatches=2, recompute="except_last")
    with strategy.scope():
        pipelined = tfpipe.PipelinedModel.from_model(helpers.twin(ref), balance=unet_lib.stage_balance(ref, 4))
        _compile(pipelined)
    for stage, device in zip(pipelined.stages, pipelined.stage_devices):
        assert stage.weights and not placement.misplaced_variables(stage.weights, device)
    _compile(ref)
    h_ref = ref.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    h_pipe = pipelined.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    got = {(l.name, w.name): w.numpy() for s in pipelined.stages for l in s.layers
           for w in l.weights}
    worst = max(float(np.max(np.abs(got[(l.name, w.name)] - w.numpy())))
                for l in ref.layers for w in l.weights)
    assert worst < 1e-5, worst  # one epoch, 4 Adam steps, M=2
    np.testing.assert_allclose(h_pipe["loss"], h_ref["loss"], rtol=1e-5)
    more = pipelined.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0).history
    losses = h_pipe["loss"] + more["loss"]
    assert losses[-1] < 0.8 * losses[0], losses
