"""Float64 proofs: where float32 is chaotic, compare in float64.

keras.applications' ResNet50 on a few small images is ill-conditioned
(BatchNorm over a handful of values): plain Keras' own float32 step moves
8-14% of its size when its input is scaled by 1 + 1e-7, so no execution can be
shown within 1e-5 of it in float32 (`benchmarks/noise_floor.py`, BUILD.md). In
float64 (every layer's dtype policy, the inputs and the losses) plain Keras'
own noise is about 4e-12 at 64x64, and a correct pipeline agrees to 1e-10
while a real bug (a wrong statistic, a lost term) would stay at the float32
size.
Every execution is proven so: at M = 1 against plain Keras, at M = 2 against
the micro-batch oracle (BatchNorm per micro-batch, `test_applications`).
The default suite proves the same arithmetic on the repo's ResNet CNN.
"""

import keras
import numpy as np
import pytest

import tfpipe
from models import resnet_cnn
from tfpipe_tests import helpers
from tfpipe_tests.test_applications import microbatch_oracle_fit

TOL64 = 1e-10
EXECUTIONS = ("unrolled", "stage_functions", "loop")


@pytest.fixture
def float64():
    """Keras' float type and dtype policy float64 for the test, restored after."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_floatx(floatx)
    keras.config.set_dtype_policy(policy)


def _trained(make, x, y, m, execution, batch_size):
    model = make()
    with tfpipe.PipelineStrategy(num_microbatches=m, execution=execution).scope():
        pipelined = tfpipe.PipelinedModel.from_model(model)
        pipelined.compile(optimizer=keras.optimizers.SGD(0.01),
                          loss="sparse_categorical_crossentropy")
    pipelined.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    assert all(v.dtype == "float64" for v in model.weights)
    return [v.numpy() for v in model.trainable_variables]


def _reference(make, x, y, m, batch_size):
    """Plain Keras (M = 1) or the micro-batch oracle (M > 1), SGD."""
    plain = make()
    plain.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    if m == 1:
        plain.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    else:
        microbatch_oracle_fit(plain, x, y, batch_size, m)
    return [v.numpy() for v in plain.trainable_variables]


def _images(n, size, channels=3):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, size, size, channels)).astype("float64"), rng.integers(0, 5, n)


def _resnet50():
    keras.utils.set_random_seed(0)
    return keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=5)


# Every execution at M = 1 (plain Keras) and M = 2 (the oracle): 8 images of
# 64x64 in one step, 4 per micro-batch at M = 2.
@pytest.mark.slow
@pytest.mark.parametrize("execution", EXECUTIONS)
@pytest.mark.parametrize("m", [1, 2])
def test_resnet50_in_float64_is_exact_in_every_execution(float64, execution, m):
    x, y = _images(8, 64)
    expected = _reference(_resnet50, x, y, m, 8)
    trained = _trained(_resnet50, x, y, m, execution, 8)
    assert helpers.max_abs_diff(expected, trained) < TOL64


def _resnet_cnn():
    keras.utils.set_random_seed(0)
    return resnet_cnn.resnet_cnn((8, 8, 1), num_classes=5, num_blocks=4)


def test_the_pipeline_computes_in_float64_where_the_model_does(float64):
    """The repo's ResNet CNN (BatchNorm in every block) in float64 within
    1e-13 of its reference (3e-17 here), each execution once (the loop at
    M = 1, the others at M = 4; the slow table has every pair): the losses,
    seeds, shares and BatchNorm statistics are float64 throughout (seeds
    and shares in float32 leave 5e-11)."""
    # 10 rows in micro-batches of 3, 3, 2, 2: shares and divisors (1/10, 3/10)
    # that float32 rounds.
    x, y = _images(10, 8, channels=1)
    for m, executions in ((1, ["loop"]), (4, ["unrolled", "stage_functions"])):
        expected = _reference(_resnet_cnn, x, y, m, 10)
        for execution in executions:
            trained = _trained(_resnet_cnn, x, y, m, execution, 10)
            assert helpers.max_abs_diff(expected, trained) < 1e-13, (m, execution)
