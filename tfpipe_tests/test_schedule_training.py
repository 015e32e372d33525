"""What the schedules and executions promise besides training like plain Keras
(test_exactness): replays, trace and op counts, placement, errors, user tables."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe import boundary
from tfpipe import schedules
from tfpipe_tests import helpers

TOL = 1e-5
SCHEDULES = helpers.SCHEDULES  # (schedule, balance of the 4-layer MLP, devices)
# That every schedule in every execution and recompute mode trains like plain
# Keras is test_exactness' pairwise table; here what else they promise.


def _pipelined(ref, name, m, execution, recompute, compile_kwargs, balance=None):
    return helpers.scheduled_copy(ref, name, m, execution, recompute, compile_kwargs, balance)


def _fit_both(ref, model, x, y, **fit_kwargs):
    h_ref = ref.fit(x, y, batch_size=16, shuffle=False, verbose=0, **fit_kwargs)
    h_pipe = model.fit(x, y, batch_size=16, shuffle=False, verbose=0, **fit_kwargs)
    return h_ref.history, h_pipe.history


def _dropout_bn_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dropout(0.5, seed=3),
        keras.layers.Dense(16),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dropout(0.3, seed=4),
        keras.layers.Dense(3),
    ])


@pytest.mark.parametrize("name", helpers.in_default_suite(["1f1b", "interleaved", "zbv"],
                                                          default=["zbv"]))
def test_loop_replays_dropout_masks_and_updates_batchnorm_once(name):
    # "never" keeps the forward's tapes: the reference for what a replay must
    # reproduce (same dropout masks, BatchNorm statistics updated once).
    data = helpers.regression_data(n=64)
    kwargs = dict(optimizer="adam", loss="mse")
    results = {}
    for execution, recompute in (("unrolled", "never"), ("loop", "always"),
                                 ("stage_functions", "always")):
        model = _pipelined(_dropout_bn_model(), name, 4, execution, recompute, kwargs,
                           balance=[2, 2, 1, 1])
        model.fit(*data, batch_size=16, epochs=2, shuffle=False, verbose=0)
        results[execution] = helpers.stage_weights(model)
    assert helpers.max_abs_diff(results["unrolled"], results["loop"]) < 1e-6
    assert helpers.max_abs_diff(results["unrolled"], results["stage_functions"]) < 1e-6


def _traced_ops(model, batch):
    """Op count of the traced train step, nested functions (loop bodies) included."""
    step = tf.function(model.train_step)
    graph = step.get_concrete_function(
        (tf.TensorSpec([batch, 8], tf.float32), tf.TensorSpec([batch, 3], tf.float32))).graph
    seen, count = set(), 0
    devices = {}

    def visit(g):
        nonlocal count
        for op in g.get_operations():
            count += 1
            if op.type == "MatMul":
                devices.setdefault(op.device, 0)
                devices[op.device] += 1
        for name, f in g._functions.items():  # pylint: disable=protected-access
            if name not in seen and hasattr(f, "graph"):
                seen.add(name)
                visit(f.graph)
    visit(graph)
    return count, devices


@pytest.mark.parametrize("connectivity, like_plain", [(False, True), (True, False)])
def test_the_probe_traces_a_while_loop_for_its_gradient_only_when_it_takes_one(
        connectivity, like_plain):
    """The boundary probe traces under a gradient tape only for the loop form's
    connectivity (the backward pass). Under a tape a while loop (a Keras LSTM)
    is traced with its gradient's functions too (the `wrappers` pattern's
    forward-only probe took 15 s under a tape, 2 s without, on a 2-core AMD
    EPYC): without connectivity the probe's graph holds the functions a plain
    trace of the stage holds."""
    stage = keras.Sequential([keras.Input((3, 2)), keras.layers.LSTM(2)])
    graphs = []

    @contextlib.contextmanager
    def record_graph(k):
        del k
        graphs.append(tf.compat.v1.get_default_graph())  # the probe's FuncGraph
        yield

    boundary.probe([stage], tf.zeros((4, 3, 2)), training=True, connectivity=connectivity,
                   around_stage=record_graph)
    plain = tf.function(lambda x: stage(x, training=True), autograph=False).get_concrete_function(
        tf.TensorSpec([None, 3, 2]))
    functions = len(graphs[0].as_graph_def().library.function)
    plain_functions = len(plain.graph.as_graph_def().library.function)
    assert plain_functions > 0  # the LSTM's while loop: a cond and a body
    assert (functions == plain_functions) == like_plain, (functions, plain_functions)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbv"])
def test_stage_functions_trace_each_stage_once_whatever_m(name):
    """Each stage's Python is traced twice per step, for any M: once for its
    forward function, once for its replaying backward (`StageBackward`); the
    step's own graph calls the stages (no layer op of theirs is in it), each
    call under its stage's device."""
    for m in (2, 8):
        ref = helpers.reference(helpers.mlp_layers(), (8,))
        model = _pipelined(ref, name, m, "stage_functions", "except_last",
                           dict(optimizer="sgd", loss="mse"))
        stages = model.pipeline.num_stages
        calls = tfpipe.testing.StageCalls()
        model.set_trace_options(observer=calls)
        step = tf.function(model.train_step, autograph=False)
        graph = step.get_concrete_function(
            (tf.TensorSpec([16, 8], tf.float32), tf.TensorSpec([16, 3], tf.float32))).graph
        assert calls.per_stage == [2] * stages
        top = graph.get_operations()
        assert not [op.name for op in top if op.type == "MatMul"]
        calls = [op for op in top if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
        stage_devices = {tf.DeviceSpec.from_string(str(d)).to_string()
                         for d in model.pipeline_devices}
        assert calls and {tf.DeviceSpec.from_string(op.device).to_string()
                          for op in calls} == stage_devices


@pytest.mark.parametrize("name, per_stage_and_microbatch", [("gpipe", 2), ("zbv", 5)])
def test_stage_function_step_grows_by_bookkeeping_only(name, per_stage_and_microbatch):
    """Top-level ops added per (stage, micro-batch) under recompute="always":
    with static micro-batch sizes, the forward's call and the backward's
    call (which replays, takes the gradients and adds them to their sums);
    under zbv, W's sums of what I computed and its ordering token. (A replay
    through the forward function's gradient, gated on the incoming gradient,
    with the sums outside made it 12.75 and 13.5 at 4 stages; with a
    data-dependency gate, 25.75 and 26.5.)"""
    counts = {}
    for m in (4, 8):
        ref = helpers.reference(helpers.mlp_layers(), (8,))
        model = _pipelined(ref, name, m, "stage_functions", "always",
                           dict(optimizer="sgd", loss="mse"))
        step = tf.function(model.train_step, autograph=False)
        with tfpipe.stage.call_scope(model.pipeline_config.traits):
            counts[m] = len(step.get_concrete_function(
                (tf.TensorSpec([16, 8], tf.float32), tf.TensorSpec([16, 3], tf.float32))
            ).graph.get_operations())
    stages = model.pipeline.num_stages
    assert (counts[8] - counts[4]) / (4 * stages) <= per_stage_and_microbatch, counts


@pytest.mark.parametrize("name", helpers.in_default_suite(list(SCHEDULES), default=["zbv"]))
def test_loop_graph_does_not_grow_with_m_and_stays_on_stage_devices(name):
    counts = {}
    for execution, recompute in (("unrolled", "except_last"), ("loop", "always")):
        for m in (2, 8):
            ref = helpers.reference(helpers.mlp_layers(), (8,))
            model = _pipelined(ref, name, m, execution, recompute,
                               dict(optimizer="sgd", loss="mse"))
            counts[execution, m], matmuls = _traced_ops(model, 16)
            used = {tf.DeviceSpec.from_string(d).device_index for d in matmuls}
            assert "" not in matmuls and used == set(range(len(model.pipeline_devices)))
    assert counts["loop", 8] == counts["loop", 2]
    assert counts["unrolled", 8] > 2 * counts["unrolled", 2]


def test_interleaved_places_stage_k_on_device_k_mod_d_and_reloads(tmp_path):
    strategy = tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"], num_microbatches=2,
                                       schedule="interleaved")
    assert strategy.num_stages == 4
    with strategy.scope():
        model = tfpipe.PipelinedModel(helpers.mlp_layers(), input_shape=(None, 8))
        model.compile(optimizer="adam", loss="mse")
    model.fit(*helpers.regression_data(n=32), batch_size=16, verbose=0)
    expected = ["/device:CPU:0", "/device:CPU:1", "/device:CPU:0", "/device:CPU:1"]
    # Stage devices are `StageDevice`s of every kind (names under a PipelineStrategy).
    assert [(type(d).__name__, str(d)) for d in model.stage_devices] == \
        [("LocalCPU", name) for name in expected]
    for stage, device in zip(model.stages, expected):
        assert tfpipe.placement.misplaced_variables(stage.weights, device) == []
    assert "schedule=interleaved" in model.pipeline_summary()
    path = str(tmp_path / "m.keras")
    model.save(path)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    for stage, device in zip(loaded.stages, expected):
        assert tfpipe.placement.misplaced_variables(stage.weights, device) == []
    x = helpers.regression_data(n=16)[0]
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               atol=1e-6)


@pytest.mark.parametrize("make, num_stages, message", [
    (lambda: tfpipe.PipelineStrategy(num_microbatches=6, schedule="interleaved"), 8,
     "multiple of its 4 devices; got num_microbatches=6. Use num_microbatches=8"),
    (lambda: tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"], num_microbatches=2,
                                     schedule=schedules.Interleaved(2)), 3,
     "num_stages must be a multiple of 2; got num_stages=3"),
    (lambda: tfpipe.PipelineStrategy(schedule="interleaved"), 10,
     "10 stages but the strategy has only 8 stage slots on 4 devices"),
    (lambda: tfpipe.PipelineStrategy(execution="loop", recompute="never"), 2,
     "needs recompute='always'"),
    (lambda: tfpipe.PipelineStrategy(execution="scan"), 2, "Unknown execution 'scan'"),
    (lambda: tfpipe.PipelineStrategy(schedule=schedules.Table([["F0.0", "B0.0"]]),
                                     devices=["/CPU:0"], num_microbatches=2), 1,
     "set num_microbatches=1"),
])
def test_schedule_configuration_errors_name_the_fix(make, num_stages, message):
    with pytest.raises(ValueError, match=message):
        strategy = make()
        with strategy.scope():
            tfpipe.PipelinedModel([keras.layers.Dense(4) for _ in range(num_stages)])


def test_user_table_schedule_trains_exactly():
    # A hand-written schedule for M=2 on 2 devices: both forwards of stage 0,
    # then stage 1 alternates; stage 0 drains last.
    table = schedules.Table([["F0.0", "F0.1", "B0.1", "B0.0"],
                             ["F1.0", "B1.0", "F1.1", "B1.1"]], name="mine")
    x, y = helpers.regression_data(n=32)
    ref = helpers.reference(helpers.mlp_layers(), (8,))
    strategy = tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"], num_microbatches=2,
                                       schedule=table)
    with strategy.scope():
        model = tfpipe.PipelinedModel.from_model(helpers.twin(ref), balance=[2, 2])
        model.compile(optimizer="adam", loss="mse")
    ref.compile(optimizer="adam", loss="mse")
    _fit_both(ref, model, x, y)
    assert helpers.max_abs_diff(ref.get_weights(), helpers.stage_weights(model)) < TOL
    assert "schedule=mine" in model.pipeline_summary()


def test_serialized_device_ops_train_exactly_and_are_chained():
    # Benchmarks chain every op of a device (one accelerator stream per
    # device); the numbers must not change.
    x, y = helpers.regression_data(n=32)
    ref = helpers.reference(helpers.mlp_layers(), (8,))
    model = _pipelined(ref, "1f1b", 4, "unrolled", "except_last",
                       dict(optimizer="adam", loss="mse"))
    model.set_trace_options(serialize_ops=True)
    ref.compile(optimizer="adam", loss="mse")
    _fit_both(ref, model, x, y)
    assert helpers.max_abs_diff(ref.get_weights(), helpers.stage_weights(model)) < TOL
    graph = tf.function(model.train_step).get_concrete_function(
        (tf.TensorSpec([16, 8], tf.float32), tf.TensorSpec([16, 3], tf.float32))).graph
    on_device_1 = [op for op in graph.get_operations() if op.device.endswith("CPU:1")]
    # The pipeline's ops on the device wait for the op traced before them (the
    # optimizer's updates, traced after the pipeline, are not chained).
    waiting = [op for op in on_device_1 if op.control_inputs]
    assert len(waiting) > 60
    # Constants run no kernel on a stream and stay unchained (grappler test below).
    assert not [op for op in waiting if op.type == "Const"]
    model.set_trace_options(serialize_ops=False)
    plain = tf.function(model.train_step).get_concrete_function(
        (tf.TensorSpec([16, 8], tf.float32), tf.TensorSpec([16, 3], tf.float32))).graph
    assert sum(1 for op in plain.get_operations()
               if op.device.endswith("CPU:1") and op.control_inputs) < len(waiting) / 4


_SERIALIZED_TRANSFORMER_STEP = """
import tensorflow as tf, tfpipe, keras
tfpipe.testing.use_logical_cpus(2)
from models import transformer_lm
strategy = tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"], num_microbatches=4,
                                   schedule={schedule!r}, recompute="never",
                                   execution="unrolled")
with strategy.scope():
    model = tfpipe.PipelinedModel.from_model(transformer_lm.transformer_lm(
        num_layers=2, width=16, num_heads=2, seq_len=8))
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.set_trace_options(serialize_ops=True)
tokens = tf.zeros((8, 8), tf.int32)
model.fit(tokens, tokens, batch_size=8, epochs=1, verbose=0)
print("trained")
"""


@pytest.mark.parametrize("schedule", ["gpipe", "zbh1"])
def test_a_serialized_step_is_one_grappler_can_optimise(schedule):
    # Chaining a Const made grappler's constant folding build a cycle; TF then
    # logged the failure and ran the whole step unoptimised (the benchmarks'
    # unrolled transformer rows up to 12% slower). Its log is the only sign.
    done = helpers.run_child(["-c", _SERIALIZED_TRANSFORMER_STEP.format(schedule=schedule)],
                             300, env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr[-3000:]
    assert "couldn't be sorted in topological order" not in done.stderr
    assert "function optimization failure" not in done.stderr


def test_next_action_waits_for_the_weight_gradients_of_a_backward():
    # If a device's next action waited only for a backward's input gradient, TF
    # could run that backward's weight-gradient matmuls late and keep every
    # micro-batch's tensors alive (recompute then saves no memory).
    strategy = tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"], num_microbatches=2,
                                       schedule="gpipe", recompute="always")
    with strategy.scope():
        model = tfpipe.PipelinedModel([keras.layers.Dense(4), keras.layers.Dense(3)],
                                      input_shape=(None, 8))
        model.compile(optimizer="sgd", loss="mse")
    graph = tf.function(model.train_step).get_concrete_function(
        (tf.TensorSpec([4, 8], tf.float32), tf.TensorSpec([4, 3], tf.float32))).graph
    # dW = x^T dy is the MatMul with transpose_a; dx = dy W^T has transpose_b.
    awaited = [dep for op in graph.get_operations() for dep in op.control_inputs
               if dep.type == "MatMul" and dep.get_attr("transpose_a")]
    assert awaited, "no op waits for a weight-gradient MatMul"


@pytest.mark.parametrize("name, held_back", [("zbh1", True), ("1f1b", False)])
def test_split_backward_holds_weight_gradients_until_w(name, held_back):
    # Unrolled ZB: I(k, m) builds the stage's whole backward in one
    # tape.gradient, and the ops only the weight gradients need (dW = x^T dy)
    # wait for the device's token at W(k, m)'s place. W re-runs nothing.
    strategy = tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"], num_microbatches=2,
                                       schedule=name, recompute="never")
    with strategy.scope():
        model = tfpipe.PipelinedModel([keras.layers.Dense(4), keras.layers.Dense(3)],
                                      input_shape=(None, 8))
        model.compile(optimizer="sgd", loss="mse")
    calls = tfpipe.testing.StageCalls()
    model.set_trace_options(observer=calls)
    graph = tf.function(model.train_step).get_concrete_function(
        (tf.TensorSpec([4, 8], tf.float32), tf.TensorSpec([4, 3], tf.float32))).graph
    weight_matmuls = [op for op in graph.get_operations()
                      if op.type == "MatMul" and op.get_attr("transpose_a")]
    assert len(weight_matmuls) == 4  # 2 stages x 2 micro-batches
    released = [op for op in weight_matmuls if op.control_inputs]
    assert len(released) == (4 if held_back else 0)
    assert calls.per_stage == [2, 2]  # one forward per micro-batch, no replay


@pytest.mark.parametrize("rows, arithmetic", [(16, False), (None, True)])
def test_static_micro_batches_are_cut_at_constant_rows(rows, arithmetic):
    """A batch whose size is known when tracing and a multiple of M is cut
    at Python-int rows: no per-micro-batch size arithmetic in the step (it
    was a third of the step's ops per micro-batch); an unknown size computes
    each micro-batch's rows once, whatever the actions that read them."""
    ref = helpers.reference(helpers.mlp_layers(), (8,))
    model = _pipelined(ref, "1f1b", 4, "stage_functions", "always",
                       dict(optimizer="sgd", loss="mse"))
    step = tf.function(model.train_step, autograph=False)
    graph = step.get_concrete_function(
        (tf.TensorSpec([rows, 8], tf.float32), tf.TensorSpec([rows, 3], tf.float32))).graph
    kinds = [op.type for op in graph.get_operations()]
    assert (kinds.count("Minimum") > 0) is arithmetic
    # With an unknown size: each micro-batch's first row once (M=4), not once
    # per action that reads the micro-batch.
    assert kinds.count("Minimum") == (4 if arithmetic else 0)


@pytest.mark.parametrize("execution, scoped", [("stage_functions", True),
                                               ("unrolled", False), ("loop", False)])
def test_keras_step_functions_run_in_the_execution_call_scope(execution, scoped):
    """fit, evaluate and predict call their step through
    `stage.call_scope` under stage functions (grappler's function optimizer
    off), once, however often Keras asks for the function."""
    ref = helpers.reference(helpers.mlp_layers(), (8,))
    model = _pipelined(ref, "gpipe", 2, execution, "always", dict(optimizer="sgd", loss="mse"))
    x, y = np.ones((8, 8), "float32"), np.ones((8, 3), "float32")
    model.fit(x, y, batch_size=8, verbose=0)
    model.evaluate(x, y, batch_size=8, verbose=0)
    model.predict(x, batch_size=8, verbose=0)
    for function in (model.train_function, model.test_function, model.predict_function):
        assert getattr(function, "tfpipe_call_scope", False) is scoped
    assert model.make_train_function() is model.train_function
    assert getattr(model.make_train_function(force=True), "tfpipe_call_scope", False) is scoped


@pytest.mark.parametrize("execution, split_ops", [("stage_functions", True), ("unrolled", False)])
def test_stage_functions_cut_the_batch_with_one_split_per_tensor(execution, split_ops):
    # The model asks its Batch for it (the step no longer sets it on the
    # caller's batch): one Split per tensor instead of a slice per micro-batch,
    # only where stages are not inlined (inlined, it broke grappler's layout
    # optimiser on a transformer's step).
    strategy = tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"], num_microbatches=4,
                                       execution=execution, recompute="never")
    with strategy.scope():
        model = tfpipe.PipelinedModel([keras.layers.Dense(4), keras.layers.Dense(3)],
                                      input_shape=(None, 8))
        model.compile(optimizer="sgd", loss="mse")
    assert model.split_batch((tf.zeros([16, 8]), tf.zeros([16, 3]))).cut_at_once is split_ops
    with tfpipe.stage.call_scope(model.pipeline_config.traits):
        graph = tf.function(model.train_step).get_concrete_function(
            (tf.TensorSpec([16, 8], tf.float32), tf.TensorSpec([16, 3], tf.float32))).graph
    splits = [op for op in graph.get_operations() if op.type in ("Split", "SplitV")]
    assert bool(splits) is split_ops, [op.name for op in splits]
