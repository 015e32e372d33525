"""`compile(run_eagerly=True)`, the first thing people reach for when debugging,
trains exactly as plain Keras in every execution (a split backward runs as one
B there: eagerly there is no graph to hold its weight half in)."""

import numpy as np
import pytest

import tfpipe
from tfpipe_tests import helpers


@pytest.mark.parametrize("schedule, execution, recompute", [
    ("gpipe", "unrolled", "except_last"),
    ("zbh1", "unrolled", "never"),
    ("1f1b", "stage_functions", "always"),
    ("zbh1", "loop", "always"),
])
def test_run_eagerly_trains_like_plain_keras(schedule, execution, recompute):
    x, y = helpers.regression_data(n=32)
    ref = helpers.reference(helpers.mlp_layers(), (8,))
    strategy = tfpipe.PipelineStrategy(num_microbatches=4, schedule=schedule,
                                       execution=execution, recompute=recompute)
    with strategy.scope():
        model = tfpipe.PipelinedModel.from_model(helpers.twin(ref))
        model.compile(optimizer="adam", loss="mse", run_eagerly=True)
    ref.compile(optimizer="adam", loss="mse")
    want = ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    got = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    assert model.run_eagerly and model.execution == execution
    assert helpers.max_abs_diff(ref.get_weights(), helpers.stage_weights(model)) < 1e-5
    np.testing.assert_allclose(got, want, rtol=1e-5)
