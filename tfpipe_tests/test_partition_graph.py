"""from_model cuts functional DAGs: skips, several inputs/outputs, raw ops, balance."""

import os

import keras
import numpy as np
import pytest

import tfpipe
from tfpipe_tests import helpers
from tfpipe import graph as graph_lib
from tfpipe import costs
from tfpipe import cutting
from tfpipe import partition
from tfpipe import placement

TOL = 1e-5
MODES = ["always", "except_last", "never"]


def _dag(seed=0):
    """Two inputs, two outputs, a skip over three cuts and raw ops (+, *)."""
    keras.utils.set_random_seed(seed)
    a = keras.Input((6,), name="a")
    b = keras.Input((4,), name="b")
    h1 = keras.layers.Dense(8, activation="tanh", name="d1")(a)
    h2 = keras.layers.Dense(8, activation="relu", name="d2")(h1)
    h3 = keras.layers.Dense(8, name="d3")(h2) + h1           # raw op: Add
    h4 = keras.layers.Dense(8, activation="tanh", name="d4")(h3) * 0.5
    joined = keras.layers.Concatenate(name="cat")([h4, keras.layers.Dense(8, name="db")(b)])
    out = keras.layers.Dense(3, name="head")(joined)
    aux = keras.layers.Dense(2, name="aux")(h2)              # an output made early
    return keras.Model({"a": a, "b": b}, [out, aux], name="dag")


def _dag_data(n=32, seed=1):
    rng = np.random.default_rng(seed)
    x = {"a": rng.normal(size=(n, 6)).astype("float32"),
         "b": rng.normal(size=(n, 4)).astype("float32")}
    y = [rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")]
    return x, y


def _weights_by_name(layers):
    return {(layer.name, w.name): w.numpy() for layer in layers for w in layer.weights}


def _pipelined_layers(pipelined):
    return [layer for stage in pipelined.stages for layer in stage.layers]


def assert_same_weights(ref, pipelined, atol=TOL):
    want = _weights_by_name(ref.layers)
    got = _weights_by_name(_pipelined_layers(pipelined))
    assert set(want) <= set(got)
    worst = max(float(np.max(np.abs(want[k] - got[k]))) for k in want)
    assert worst < atol, worst


def test_units_follow_model_operations_including_raw_ops():
    model = _dag()
    graph = graph_lib.model_graph(model)
    expected = [op.name for op in model.operations if not isinstance(op, keras.layers.InputLayer)]
    assert [u.op.name for u in graph.units] == expected
    # x + y and x * 0.5 are units too (raw ops: Keras numbers their names
    # process-wide, so check their types, not their names).
    kinds = {type(u.op).__name__ for u in graph.units}
    assert {"Add", "Multiply"} <= kinds and not all(
        isinstance(u.op, keras.layers.Layer) for u in graph.units)


def test_skip_tensors_cross_every_cut_they_span():
    graph = graph_lib.model_graph(_dag())
    names = [u.op.name for u in graph.units]
    assert names[:3] == ["d1", "d2", "d3"] and names[6:] == ["db", "cat", "head", "aux"]
    add, multiply = names[3], names[5]  # raw ops: Keras numbers their names
    # Stages: d1 d2 | d3 add | d4 multiply db | cat head aux. Input "b" waits
    # for "db" in stage 2; d2's output waits for "aux" in stage 3.
    assert cutting.boundaries(graph, [2, 2, 3, 3]) == [
        ["b", "d1", "d2"], ["b", "d2", add], ["d2", multiply, "db"]]
    pieces = cutting.cut(graph, [2, 2, 3, 3])
    assert pieces[0].inputs == graph.inputs and pieces[-1].outputs == graph.outputs


@pytest.mark.parametrize("mode", helpers.in_default_suite(MODES, default=["always"]))
def test_dag_with_two_inputs_and_outputs_trains_like_keras(mode):
    ref = _dag()
    x, y = _dag_data()
    strategy = tfpipe.PipelineStrategy(num_microbatches=2, recompute=mode)
    with strategy.scope():
        pipelined = tfpipe.PipelinedModel.from_model(helpers.twin(ref), balance=[2, 2, 3, 3])
        pipelined.compile(optimizer="adam", loss=["mse", "mse"])
    assert pipelined.balance == [2, 2, 3, 3] and pipelined.balance_method == "explicit"
    for stage, device in zip(pipelined.stages, pipelined.stage_devices):
        assert not placement.misplaced_variables(stage.weights, device)
    for got, want in zip(pipelined.predict(x, batch_size=8, verbose=0),
                         ref.predict(x, batch_size=8, verbose=0)):
        np.testing.assert_allclose(got, want, atol=TOL)
    ref.compile(optimizer="adam", loss=["mse", "mse"])
    h_ref = ref.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    h_pipe = pipelined.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    assert_same_weights(ref, pipelined)
    np.testing.assert_allclose(h_pipe["loss"], h_ref["loss"], rtol=1e-5)


def test_original_model_is_unchanged_and_weights_are_copies():
    ref = _dag()
    before = _weights_by_name(ref.layers)
    with tfpipe.PipelineStrategy(num_microbatches=2).scope():
        pipelined = tfpipe.PipelinedModel.from_model(helpers.twin(ref), balance=[2, 2, 3, 3])
        pipelined.compile(optimizer="sgd", loss=["mse", "mse"])
    x, y = _dag_data(n=8)
    pipelined.fit(x, y, batch_size=8, verbose=0)
    after = _weights_by_name(ref.layers)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert not set(map(id, ref.layers)) & set(map(id, _pipelined_layers(pipelined)))


def test_nested_model_is_inlined_and_called_with_outer_training():
    keras.utils.set_random_seed(3)
    inner_in = keras.Input((5,))
    h = keras.layers.Dense(6, activation="relu", name="inner_d")(inner_in)
    h = keras.layers.Dropout(0.5, seed=11, name="inner_drop")(h)
    inner = keras.Model(inner_in, keras.layers.Dense(5, name="inner_out")(h) + inner_in,
                        name="block")
    x_in = keras.Input((5,))
    # training=False here is overridden by the outer call, as in Keras.
    out = keras.layers.Dense(2, name="out")(inner(keras.layers.Dense(5, name="pre")(x_in),
                                                 training=False))
    ref = keras.Model(x_in, out)
    graph = graph_lib.model_graph(ref)
    names = [u.op.name for u in graph.units]
    assert names[:4] + names[5:] == ["pre", "inner_d", "inner_drop", "inner_out", "out"]
    assert names[4].startswith("add")  # the raw op inside "block"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 5)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    with tfpipe.PipelineStrategy(num_microbatches=1, recompute="always").scope():
        pipelined = tfpipe.PipelinedModel.from_model(helpers.twin(ref), balance=[2, 1, 2, 1])
        pipelined.compile(optimizer="sgd", loss="mse")
    ref.compile(optimizer="sgd", loss="mse")
    ref.fit(x, y, batch_size=16, verbose=0)
    ref_weights = _weights_by_name(ref.layers[1:2] + ref.layers[-1:] + inner.layers[1:])
    pipelined.fit(x, y, batch_size=16, verbose=0)
    got = _weights_by_name(_pipelined_layers(pipelined))
    # Dropout was active (training=True reached it): weights moved identically.
    assert max(float(np.max(np.abs(ref_weights[k] - got[k]))) for k in ref_weights) < TOL


def test_a_layer_called_twice_is_one_object_in_every_stage_that_calls_it():
    dense = keras.layers.Dense(4, name="tied")
    x = keras.Input((4,))
    model = keras.Model(x, keras.layers.Dense(2)(dense(dense(x))))
    graph = tfpipe.graph.model_graph(model)
    assert [u.op.name for u in graph.units] == ["tied", "tied", model.layers[-1].name]
    with tfpipe.PipelineStrategy().scope():
        pipelined = tfpipe.PipelinedModel.from_model(model, balance=[1, 1, 1])
    assert pipelined.stages[0].layers[0] is dense and pipelined.stages[1].layers[0] is dense
    # Stored once, on the first stage's device; both stages use it.
    assert [v.path for v in pipelined.pipeline.variables].count("tied/kernel") == 1
    assert pipelined.pipeline.stage_of_variables()[0] == [0, 1]
    assert tfpipe.placement.device_of(dense.kernel).endswith(str(pipelined.stage_devices[0])[-5:])


def test_wrong_input_structure_names_the_stage():
    ref = _dag()
    with tfpipe.PipelineStrategy(num_microbatches=1).scope():
        pipelined = tfpipe.PipelinedModel.from_model(helpers.twin(ref), balance=[2, 2, 3, 3])
    with pytest.raises(ValueError, match=r"stage_0 was called with inputs structured as"):
        pipelined.stages[0]([np.ones((2, 6), "float32")])


def test_balance_by_params_counts_units_of_a_functional_model():
    ref = _dag()
    with tfpipe.PipelineStrategy().scope():
        pipelined = tfpipe.PipelinedModel.from_model(helpers.twin(ref))
    unit_costs = partition.param_costs(ref)
    assert pipelined.balance == partition.split_by_costs(unit_costs, 4)
    assert pipelined.balance_method == "params" and sum(pipelined.balance) == 10
    text = pipelined.pipeline_summary()
    assert f"Balance: {pipelined.balance} units per stage (from_model, by params)" in text


def test_balance_sum_error_names_operations():
    with tfpipe.PipelineStrategy().scope():
        with pytest.raises(ValueError, match=r"sums to 4 but the model has 10 operations"):
            tfpipe.PipelinedModel.from_model(_dag(), balance=[1, 1, 1, 1])
        with pytest.raises(ValueError, match=r"Unknown balance 'speed'"):
            tfpipe.PipelinedModel.from_model(_dag(), balance="speed")


def test_split_by_costs_is_the_min_max_optimum():
    assert partition.split_by_costs([4, 1, 1, 1, 1, 4], 3) == [1, 4, 1]
    assert partition.split_by_costs([1, 1, 1, 1], 4) == [1, 1, 1, 1]
    assert partition.split_by_costs([5, 1, 1, 5], 2) == [2, 2]
    with pytest.raises(ValueError, match="Cannot cut 2 layers into 3"):
        partition.split_by_costs([1, 1], 3)


def _chain_with_heavy_layer():
    keras.utils.set_random_seed(0)
    x = keras.Input((64,))
    h = keras.layers.Dense(64, name="small1")(x)
    h = keras.layers.Dense(64, name="small2")(h)
    h = keras.layers.Dense(2048, name="wide")(h)        # 8x the activations, 32x the params
    h = keras.layers.BatchNormalization(name="bn")(h)
    return keras.Model(x, keras.layers.Dense(64, name="small3")(h))


def test_balance_by_memory_isolates_the_large_units():
    model = _chain_with_heavy_layer()
    sample = np.ones((32, 64), "float32")
    unit_costs = partition.memory_costs(model, sample)
    # Dense(64): 32*64*4 activation bytes + (64*64+64)*4 parameter bytes.
    assert unit_costs[0] == 32 * 64 * 4 + (64 * 64 + 64) * 4
    assert unit_costs[3] == 32 * 2048 * 4 + 4 * 2048 * 4  # BN: gamma, beta, mean, variance
    assert partition.balance_by_memory(model, sample, 3) == [2, 1, 2]


def test_balance_by_time_leaves_the_model_unchanged():
    model = _chain_with_heavy_layer()
    before = [w.numpy() for w in model.weights]
    sample = np.random.default_rng(0).normal(size=(256, 64)).astype("float32")
    unit_costs = partition.time_costs(model, sample, repeats=2)
    assert len(unit_costs) == 5 and all(c > 0 for c in unit_costs)
    assert unit_costs[2] > unit_costs[0]  # the 64x2048 matmul is slower than a 64x64 one
    balance = partition.balance_by_time(model, sample, 2, repeats=2)
    assert sum(balance) == 5 and len(balance) == 2
    # BatchNorm ran in training mode, but its moving statistics were put back.
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(before, model.weights))


@pytest.mark.parametrize("method", ["time", "memory"])
def test_from_model_measures_on_a_default_random_sample(method):
    with tfpipe.PipelineStrategy().scope():
        pipelined = tfpipe.PipelinedModel.from_model(_chain_with_heavy_layer(), balance=method)
    assert pipelined.balance_method == method and sum(pipelined.balance) == 5
    assert f"by {method}" in pipelined.pipeline_summary()


def test_sample_batch_needs_known_shapes():
    x = keras.Input((None, 3))
    model = keras.Model(x, keras.layers.Dense(2)(x))
    assert costs.sample_batch(_dag())["a"].shape == (8, 6)
    with pytest.raises(ValueError, match=r"not fully known\. Pass sample="):
        costs.sample_batch(model)


def test_graph_stages_save_and_load(tmp_path):
    ref = _dag()
    x, y = _dag_data(n=16)
    with tfpipe.PipelineStrategy(num_microbatches=2).scope():
        pipelined = tfpipe.PipelinedModel.from_model(helpers.twin(ref), balance=[2, 2, 3, 3])
        pipelined.compile(optimizer="adam", loss=["mse", "mse"])
    pipelined.fit(x, y, batch_size=8, verbose=0)
    path = os.path.join(tmp_path, "dag.keras")
    pipelined.save(path)
    with tfpipe.PipelineStrategy(num_microbatches=2).scope():
        loaded = keras.models.load_model(path)
    assert [type(s).__name__ for s in loaded.stages] == ["GraphStage"] * 4
    for stage, device in zip(loaded.stages, loaded.stage_devices):
        assert stage.weights == [] or not placement.misplaced_variables(stage.weights, device)
    for got, want in zip(loaded.predict(x, batch_size=8, verbose=0),
                         pipelined.predict(x, batch_size=8, verbose=0)):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_measured_balance_matches_dict_inputs_by_key():
    z = keras.Input((3,), name="z")
    a = keras.Input((5,), name="a")  # inserted after "z": not in sorted order
    out = keras.layers.Dense(2, name="dz")(z) + keras.layers.Dense(2, name="da")(a)
    model = keras.Model({"z": z, "a": a}, out)
    sample = {"a": np.ones((4, 5), "float32"), "z": np.ones((4, 3), "float32")}
    unit_costs = partition.memory_costs(model, sample)
    assert unit_costs[:2] == [4 * 2 * 4 + (3 * 2 + 2) * 4, 4 * 2 * 4 + (5 * 2 + 2) * 4]
    assert partition.balance_by_memory(model, costs.sample_batch(model), 3) == [1, 1, 1]
