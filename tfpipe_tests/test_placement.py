"""Every stage's variables and optimizer slots live on that stage's device."""

import collections
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe import placement
from tfpipe_tests import helpers


def _spec(device):
    spec = tf.DeviceSpec.from_string(str(device))
    return spec.device_type, spec.device_index


def _slots_by_device(model):
    """{variable path: device of each optimizer slot made for it}."""
    optimizer = model.optimizer
    out = {}
    for var in model.trainable_variables:
        slots = [s for s in optimizer.variables
                 if s.path.endswith(var.path.replace("/", "_") + "_momentum")
                 or s.path.endswith(var.path.replace("/", "_") + "_velocity")]
        out[var.path] = [placement.device_of(s) for s in slots]
    return out


@pytest.mark.parametrize("build", ["from_model", "stages_with_input_shape", "lazy_fit",
                                   "prebuilt_stages"])
def test_variables_and_slots_on_stage_devices(build):
    x, y = helpers.regression_data(n=32)
    strategy = tfpipe.PipelineStrategy(num_microbatches=2)
    with strategy.scope():
        if build == "from_model":
            model = tfpipe.PipelinedModel.from_model(
                helpers.reference(helpers.mlp_layers(), (8,)), balance=[1, 1, 1, 1])
        elif build == "stages_with_input_shape":
            model = tfpipe.PipelinedModel(helpers.mlp_layers(), input_shape=(None, 8))
        elif build == "prebuilt_stages":
            # Built by the user on the default device first: their variables move.
            layers = helpers.mlp_layers()
            keras.Sequential([keras.Input((8,))] + layers)
            kernels = [l.kernel for l in layers]
            model = tfpipe.PipelinedModel(layers, input_shape=(None, 8))
            assert [l.kernel for l in layers] == kernels  # the same Keras variables
        else:
            model = tfpipe.PipelinedModel(helpers.mlp_layers())
        model.compile(optimizer="adam", loss="mse")
    # Outside the scope, as users do: the first fit builds anything still lazy.
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert len(strategy.devices) == 4
    slots = _slots_by_device(model)
    for stage, device in zip(model.stages, model.stage_devices):
        assert stage.weights
        for var in stage.weights:
            assert _spec(placement.device_of(var)) == _spec(device), var.path
        for var in stage.trainable_variables:
            assert len(slots[var.path]) == 2, var.path  # Adam: momentum + velocity
            for slot_device in slots[var.path]:
                assert _spec(slot_device) == _spec(device), var.path
    assert [_spec(d)[1] for d in model.stage_devices] == [0, 1, 2, 3]


def test_optimizer_made_outside_scope_still_places_slots():
    strategy = tfpipe.PipelineStrategy(num_microbatches=2)
    optimizer = keras.optimizers.Adam()  # created before entering the scope
    with strategy.scope():
        model = tfpipe.PipelinedModel(helpers.mlp_layers(), input_shape=(None, 8))
        model.compile(optimizer=optimizer, loss="mse")
    x, y = helpers.regression_data(n=16)
    model.fit(x, y, batch_size=16, verbose=0)
    for var, devices in _slots_by_device(model).items():
        stage_index = next(i for i, s in enumerate(model.stages)
                           if any(v.path == var for v in s.trainable_variables))
        assert {_spec(d) for d in devices} == {_spec(model.stage_devices[stage_index])}


def test_explicit_devices_in_any_order():
    strategy = tfpipe.PipelineStrategy(
        devices=["/job:localhost/replica:0/task:0/device:CPU:3", "cpu:1"], num_microbatches=2)
    assert strategy.devices == ("/device:CPU:3", "/device:CPU:1")
    with strategy.scope():
        model = tfpipe.PipelinedModel([keras.layers.Dense(4), keras.layers.Dense(2)],
                                      input_shape=(None, 3))
    assert _spec(placement.device_of(model.stages[0].kernel)) == ("CPU", 3)
    assert _spec(placement.device_of(model.stages[1].kernel)) == ("CPU", 1)


def test_training_ops_run_on_stage_devices():
    """The traced step puts each stage's forward, backward and update on its device."""
    strategy = tfpipe.PipelineStrategy(num_microbatches=2, recompute="always")
    with strategy.scope():
        model = tfpipe.PipelinedModel(
            [keras.layers.Dense(4, name="first"), keras.layers.Dense(2, name="second")],
            input_shape=(None, 3))
        model.compile(optimizer="adam", loss="mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    model.fit(x, y, batch_size=8, verbose=0)
    step = tf.function(model.train_step)
    graph = step.get_concrete_function(
        (tf.TensorSpec([8, 3], tf.float32), tf.TensorSpec([8, 2], tf.float32))).graph
    matmuls = {}

    def visit(g):
        for op in g.get_operations():
            if op.type in ("MatMul", "BatchMatMulV2"):
                matmuls.setdefault(_spec(op.device) if op.device else None, []).append(op.name)
        for f in g._functions.values():  # nested functions (gradients, conds)
            if hasattr(f, "graph"):
                visit(f.graph)
    visit(graph)
    assert None not in matmuls, matmuls.get(None)
    assert set(matmuls) == {("CPU", 0), ("CPU", 1)}


def _graph_ops(graph):
    """Every op of `graph` and of the function bodies it holds."""
    for op in graph.get_operations():
        yield op
    for f in graph._functions.values():  # nested functions (gradients, conds)
        if hasattr(f, "graph"):
            yield from _graph_ops(f.graph)


# (devices, replicas): one pipeline off the default device; a grid of two
# pipelines, whose copies of a stage's variables each replica updates in place.
@pytest.mark.parametrize("devices, replicas", [
    (["/CPU:1", "/CPU:2"], 1),
    (["/CPU:0", "/CPU:1", "/CPU:2", "/CPU:3"], 2),
])
def test_optimizer_updates_run_where_their_variable_lives(devices, replicas):
    """AdamW's slot updates (AssignAdd) and its decay and step (AssignSub)
    run on each stage device, two variables' worth each, in every replica."""
    strategy = tfpipe.PipelineStrategy(devices=devices, num_replicas=replicas,
                                       num_microbatches=2)
    with strategy.scope():
        model = tfpipe.PipelinedModel([keras.layers.Dense(4), keras.layers.Dense(2)],
                                      input_shape=(None, 3))
        model.compile(optimizer=keras.optimizers.AdamW(weight_decay=0.1), loss="mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    model.fit(x, y, batch_size=8, verbose=0)
    graph = tf.function(model.train_step).get_concrete_function(
        (tf.TensorSpec([8, 3]), tf.TensorSpec([8, 2]))).graph
    writes = collections.Counter((op.type, _spec(op.device) if op.device else None)
                                 for op in _graph_ops(graph)
                                 if op.type in ("AssignAddVariableOp", "AssignSubVariableOp"))
    # Per stage and replica: 2 variables x (momentum, velocity); x (decay, step).
    assert writes == {(kind, _spec(d)): 4 for d in devices
                      for kind in ("AssignAddVariableOp", "AssignSubVariableOp")}


_PLACER_CHILD = r"""
import sys
import tfpipe
tfpipe.testing.use_logical_cpus(4)
import numpy as np, keras, tensorflow as tf
tf.debugging.set_log_device_placement(True)  # before any function is placed
strategy = tfpipe.PipelineStrategy(devices=["/CPU:2", "/CPU:3"], num_microbatches=2,
                                   execution=sys.argv[1], recompute="always")
with strategy.scope():
    model = tfpipe.PipelinedModel([keras.layers.Dense(4), keras.layers.Dense(2)],
                                  input_shape=(None, 3))
    model.compile(optimizer="adam", loss="mse")
model.fit(np.ones((8, 3), "float32"), np.ones((8, 2), "float32"), batch_size=8, verbose=0)
"""


@pytest.mark.parametrize("execution", ["unrolled", "stage_functions"])
def test_placer_runs_every_matmul_on_a_stage_device(execution):
    """Where TF's placer really runs the stages' matmuls (its own log, in a
    child process), forward and backward: on the two stage devices, never on
    the default CPU:0, also when they sit in function bodies (stage_functions),
    which carry no device of their own for the backward."""
    done = helpers.run_child(["-c", _PLACER_CHILD, execution], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    placed = re.findall(r"^\S+: \(MatMul\): (\S+)$", done.stdout, re.M)
    devices = collections.Counter(tf.DeviceSpec.from_string(d).device_index for d in placed)
    assert set(devices) == {2, 3}, devices


def test_hand_written_stages_sharing_a_layer_train_like_keras():
    # One Dense layer in the first and the last stage: stored once, on the
    # first stage's device, with the gradients of both uses.
    keras.utils.set_random_seed(0)
    shared = keras.layers.Dense(8, activation="tanh", name="shared")
    middle = keras.layers.Dense(8, name="middle")
    head = keras.layers.Dense(3, name="head")
    inputs = keras.Input((8,))
    plain = keras.Model(inputs, head(shared(middle(shared(inputs)))))
    twin = helpers.twin(plain)
    with tfpipe.PipelineStrategy(num_microbatches=4).scope():
        model = tfpipe.PipelinedModel(
            [keras.Sequential([twin.get_layer("shared")]),
             keras.Sequential([twin.get_layer("middle")]),
             keras.Sequential([twin.get_layer("shared"), twin.get_layer("head")])],
            input_shape=(None, 8))
        model.compile(optimizer="adam", loss="mse")
    plain.compile(optimizer="adam", loss="mse")
    assert _spec(placement.device_of(twin.get_layer("shared").kernel)) == ("CPU", 0)
    x, y = helpers.regression_data(n=40)
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert helpers.max_abs_diff(plain.get_weights(), twin.get_weights()) < 2e-5
