"""`tfpipe.testing` and the private TF/Keras APIs that `tfpipe._internal` pins."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe_tests import helpers
from tfpipe import _internal
from tfpipe import _internal_distribute
from tfpipe import _internal_tpu
from tfpipe import microbatch
from tfpipe import partition
from tfpipe import stage_functions
from tfpipe_tests import conftest


def test_use_logical_cpus_same_count_is_a_no_op():
    tfpipe.testing.use_logical_cpus(conftest.NUM_DEVICES)
    assert len(tf.config.list_logical_devices("CPU")) == conftest.NUM_DEVICES


def test_use_logical_cpus_after_initialisation_with_other_count():
    with pytest.raises(RuntimeError, match=r"already initialised with 4 logical CPU.*"
                                           r"before any TensorFlow op"):
        tfpipe.testing.use_logical_cpus(2)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_use_logical_cpus_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="positive integer"):
        tfpipe.testing.use_logical_cpus(bad)


def test_strategy_is_a_tf_distribute_strategy_and_becomes_current():
    strategy = tfpipe.PipelineStrategy(num_microbatches=8)
    assert isinstance(strategy, tf.distribute.Strategy)
    assert strategy.num_stages == 4 and strategy.num_microbatches == 8
    assert strategy.num_replicas_in_sync == 1
    assert strategy.devices == tuple(f"/device:CPU:{k}" for k in range(4))
    with strategy.scope():
        assert tf.distribute.get_strategy() is strategy
        with tf.device(strategy.devices[2]):
            v = tf.Variable(1.0)
        assert v.device.endswith("CPU:2")  # the strategy does not override tf.device
        with strategy.extended.colocate_vars_with(v):
            slot = tf.Variable(0.0)
        assert slot.device.endswith("CPU:2")
    assert not tf.distribute.has_strategy()


def test_one_replica_step_has_no_device_less_all_reduce():
    """`PipelineExtended._call_for_each_replica`: Keras' gradient all-reduce
    over the one replica adds no op (TF's base replica context would add an
    IdentityN over every gradient, with no device)."""
    strategy = tfpipe.PipelineStrategy(devices=["/device:CPU:0", "/device:CPU:1"])
    with strategy.scope():
        model = tfpipe.PipelinedModel([keras.layers.Dense(4), keras.layers.Dense(2)],
                                      input_shape=(None, 3))
        model.compile(optimizer="sgd", loss="mse")

    @tf.function
    def step(x, y):
        return strategy.run(model.train_step, args=((x, y),))

    graph = step.get_concrete_function(tf.TensorSpec([4, 3]), tf.TensorSpec([4, 2])).graph
    ops = [op.type for op in graph.get_operations()]
    assert "MatMul" in ops and "IdentityN" not in ops
    with strategy.scope():
        value = tf.constant(2.0)
        assert strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
            "sum", value)) is value


def test_grid_strategy_mirrors_each_variable_over_its_column():
    """`PipelineGridExtended` (TF's private `MirroredExtended`): a variable made
    under a grid device is mirrored over that device's column; one made
    elsewhere over column 0; a colocated one (a slot) next to its variable's
    copies; `local_copies` lists them."""
    strategy = tfpipe.PipelineStrategy(num_replicas=2)
    assert isinstance(strategy.extended, _internal_distribute.PipelineGridExtended)

    def copies(v):
        return [c.device.split("/")[-1] for c in _internal.local_copies(v)]

    with strategy.scope():
        with tf.device("/device:CPU:3"):
            v = tf.Variable(1.0)
        unplaced = tf.Variable(2.0)
        with strategy.extended.colocate_vars_with(v):
            slot = tf.Variable(0.0)
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
        _internal.move_variable(layer.kernel, tf.device("/device:CPU:1"))
    assert copies(v) == copies(slot) == ["device:CPU:1", "device:CPU:3"]
    assert copies(unplaced) == ["device:CPU:0", "device:CPU:2"]
    assert copies(layer.kernel) == ["device:CPU:1", "device:CPU:3"]
    assert copies(tf.Variable(0.0)) == ["device:CPU:0"]


def test_seed_generators_found_in_nested_layers():
    stage = keras.Sequential([keras.layers.Dense(2), keras.layers.Dropout(0.1),
                              keras.Sequential([keras.layers.GaussianNoise(0.1)])])
    assert len(_internal.seed_generators(stage)) == 2


def test_keras_metadata_on_tensors():
    @tf.function
    def check():
        x = tf.ones((2, 3))
        probs = keras.activations.softmax(x)
        assert _internal.get_keras_logits(probs) is x
        mask = tf.constant([[True, False, True]] * 2)
        _internal.set_keras_mask(probs, mask)
        assert _internal.get_keras_mask(probs) is mask
        joined = microbatch.concat_with_metadata([probs, probs])
        cut = microbatch.slice_with_metadata(joined, 1)
        return (tf.shape(_internal.get_keras_mask(joined))[0],
                tf.shape(_internal.get_keras_logits(cut))[0])
    rows, cut_rows = check()
    assert int(rows) == 4 and int(cut_rows) == 1


def test_move_variable_keeps_the_keras_variable_and_its_value():
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    kernel, value = layer.kernel, layer.kernel.numpy()
    _internal.move_variable(kernel, tf.device("/device:CPU:3"))
    assert layer.kernel is kernel and kernel.value.device.endswith("CPU:3")
    assert (kernel.numpy() == value).all()
    _internal.move_variable(kernel, tf.device("/device:CPU:2"), named_by_path=True)
    assert kernel.value.name == kernel.path + ":0" and kernel.value.device.endswith("CPU:2")
    assert (kernel.numpy() == value).all()


@pytest.mark.parametrize("name, reported", [
    ("/device:CPU:0", True),            # device_lib lists the first CPU
    ("/job:localhost/replica:0/task:0/device:CPU:0", True),
    ("/device:GPU:0", False),           # no GPU here: None, not an error
])
def test_device_memory_limit_reads_device_lib(name, reported):
    """What `LocalGPU.memory()` reads: an int of bytes, or None."""
    limit = _internal.device_memory_limit(name)
    assert (isinstance(limit, int) and limit > 0) if reported else limit is None


def test_tpu_strategy_internals_and_optimizer_placement():
    """The TPUStrategy's cores and SPMD flag; the optimizer wrapped to work in
    each variable's device scope (its update, all-reduce and weight decay);
    the functions a traced graph defines."""
    strategy = tfpipe.testing.tpu_strategy("v3-8", cores_per_replica=2, num_replicas=2)
    assert [[d.split("/")[-1] for d in row] for row in _internal_tpu.tpu_core_devices(strategy)] \
        == [["device:TPU:0", "device:TPU:1"], ["device:TPU:4", "device:TPU:5"]]
    assert not _internal_tpu.tpu_uses_spmd(strategy)
    assert _internal_tpu.tpu_uses_spmd(tfpipe.testing.tpu_strategy("v3-8", 2,
                                                               spmd_xla_partitioning=True))
    devices = [tfpipe.devices.StageDevice("/device:CPU:1"),
               tfpipe.devices.StageDevice("/device:CPU:2")]
    a, b = keras.Variable(np.ones(2, "float32")), keras.Variable(np.ones(3, "float32"))
    where = {id(a.value): devices[0], id(b.value): devices[1]}
    optimizer = keras.optimizers.AdamW(learning_rate=0.1, weight_decay=0.5)
    _internal.place_optimizer_updates(optimizer, lambda v: where.get(id(v)))
    optimizer.build([a, b])

    @tf.function
    def step():
        optimizer.apply_gradients([(tf.ones(2), a), (tf.ones(3), b)])
    graph = step.get_concrete_function().graph
    # Every write but the step counter's (Keras' own, outside its name scope).
    writes = [op.device.split("/")[-1] for op in graph.get_operations()
              if op.type.startswith("Assign") and op.name.startswith(optimizer.name + "/")]
    assert sorted(writes) == ["device:CPU:1"] * 4 + ["device:CPU:2"] * 4, writes
    decays = [op for op in graph.get_operations() if op.type == "AssignSubVariableOp"]
    assert decays and all(op.device for op in decays)
    f = tf.function(lambda x: tf.cond(x > 0, lambda: x, lambda: -x))
    cond = [op for op in f.get_concrete_function(tf.TensorSpec(())).graph.get_operations()
            if op.type in ("If", "StatelessIf")]
    bodies = _internal.called_graphs(cond[0])
    assert len(bodies) == 2 and all(hasattr(g, "get_operations") for g in bodies)


def test_layer_internals_used_for_graphs_losses_and_batch_norm():
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(2, activity_regularizer="l2")
    out = dense(inputs)
    op, node, index = _internal.producing_node(out)
    assert op is dense and index == 0 and node.outputs[0] is out
    dense(tf.ones((2, 3)))
    assert len(_internal.call_losses(dense)) == 1  # the activity regulariser
    wrapper = keras.Sequential([dense])
    wrapper(tf.ones((2, 3)))
    assert [(layer, len(losses)) for layer, losses in _internal.call_losses_by_layer(wrapper)] \
        == [(dense, 1)]
    bn = keras.layers.BatchNormalization()
    bn.build((None, 4))
    assert _internal.batch_norm_reduction_axes(bn) == [0]
    seen = []
    with _internal.intercept_moments(bn, lambda *args: seen.append(args)):
        bn(tf.ones((2, 4)), training=True)
    bn(tf.ones((2, 4)), training=True)
    assert len(seen) == 1  # intercepted only inside the context


def test_unordered_timestamps_are_not_chained_by_tf_function():
    # tf.function chains stateful ops without resource inputs (tf.timestamp)
    # in creation order: why the pipeline timeline needs unordered stamps.
    def stamps(make):
        graph = tf.function(lambda: (make(), make())).get_concrete_function().graph
        return [op for op in graph.get_operations() if op.type == "Timestamp"]

    first, second = stamps(tf.timestamp)
    assert first in second.control_inputs
    first, second = stamps(_internal.unordered_timestamp)
    assert first not in second.control_inputs
    values = tf.function(lambda: (_internal.unordered_timestamp(),
                                  _internal.unordered_timestamp()))()
    assert all(float(v) > 1e9 for v in values)  # both ran: seconds since 1970


def test_compiled_loss_terms():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(loss=keras.losses.MeanAbsoluteError(reduction="sum"), loss_weights=0.5)
    model._compile_loss.build(tf.ones((1, 1)), tf.ones((1, 1)))  # pylint: disable=protected-access
    [(path, loss, weight, name)] = _internal.compiled_loss_terms(model._compile_loss)  # pylint: disable=protected-access
    assert path == () and loss.reduction == "sum" and weight == 0.5
    assert _internal.user_loss(model._compile_loss) is not None  # pylint: disable=protected-access


def test_balance_by_params_evens_out_parameters():
    layers = [keras.layers.Dense(n) for n in (64, 8, 8, 8, 64)]
    shape = (None, 16)
    for layer in layers:
        layer.build(shape)
        shape = (None, layer.units)
    # costs: 1089, 521, 73, 73, 577 -> best max is 1089 with [1, 3, 1] or [1, 2, 2]
    balance = partition.balance_by_params(layers, 3)
    assert sum(balance) == 5 and min(balance) >= 1 and balance[0] == 1
    assert partition.balance_by_params(layers, 5) == [1, 1, 1, 1, 1]


def test_from_model_balances_by_params_by_default():
    ref = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(8)])
    with tfpipe.PipelineStrategy().scope():
        model = tfpipe.PipelinedModel.from_model(helpers.twin(ref))
    assert model.balance == [2, 2, 2, 2]


def test_in_xla_context():
    # The private TF API tfpipe.xla uses.
    seen = []

    def probe(x):
        seen.append(_internal.in_xla_context())
        return x + 1.0

    tf.function(probe, jit_compile=True)(tf.constant(1.0))
    tf.function(probe)(tf.constant(1.0))
    assert seen == [True, False]
    assert _internal.in_xla_context() is False


@pytest.mark.parametrize("unique, expected", [(True, True), (False, False)])
def test_unique_rows_are_seen_through_a_function_gradient(unique, expected):
    """`function_body` (private `Graph._get_function`) lets
    `gathers_unique_rows` follow a gradient's indices out of TF's backward
    function and into the forward call whose `tf.unique` made them, as under
    execution="stage_functions"; a plain gather is not deduplicated."""
    from tfpipe import gradients  # pylint: disable=import-outside-toplevel

    @tf.function(autograph=False, experimental_attributes={"_noinline": True})
    def stage(x, table):
        ids = tf.constant([0, 2, 0])
        rows = tf.unique(ids)[0] if unique else ids
        return tf.gather(table, rows) * x

    found = {}

    @tf.function(autograph=False)
    def step(x):
        table = tf.ones((3, 2))
        with tf.GradientTape() as tape:
            tape.watch(table)
            y = stage(x, table)
        grad = tape.gradient(y, table)
        assert isinstance(grad, tf.IndexedSlices)
        assert _internal.function_body(grad.indices.op) is not None
        found["unique"] = gradients.gathers_unique_rows(grad)
        return grad.values

    step.get_concrete_function(tf.TensorSpec([None, 2], tf.float32))
    assert found["unique"] is expected


@pytest.mark.parametrize("scope, function_optimizer, iterations", [
    ("stage_functions", "OFF", "ONE"),
    ("unrolled", "DEFAULT", "ONE"),
    (None, "DEFAULT", "DEFAULT_NUM_ITERS"),  # outside tfpipe's call scope: TF's own
])
def test_grappler_options_reach_the_call_ops_traced_in_them(scope, function_optimizer,
                                                             iterations):
    """`grappler_options` (the eager context's private `function_call_options`),
    as a step's call scope sets it, is the grappler config that the call ops
    traced in it carry, which is the config their bodies run under, and gives
    the thread its own options back afterwards."""
    from tensorflow.core.protobuf import config_pb2  # pylint: disable=import-outside-toplevel
    from tensorflow.core.protobuf import rewriter_config_pb2  # pylint: disable=import-outside-toplevel
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
    from tfpipe import config as config_lib  # pylint: disable=import-outside-toplevel
    from tfpipe import stage  # pylint: disable=import-outside-toplevel

    inner = tf.function(lambda x: x * 2.0, autograph=False,
                        experimental_attributes={"_noinline": True})
    outer = tf.function(lambda x: inner(x) + inner(x), autograph=False)
    before = context.context().function_call_options
    with (stage.call_scope(config_lib.execution(scope)) if scope
          else contextlib.nullcontext()):
        graph = outer.get_concrete_function(tf.TensorSpec([], tf.float32)).graph
        assert float(outer(tf.constant(1.0))) == 4.0
    assert context.context().function_call_options is before
    calls = [op for op in graph.get_operations() if op.type.endswith("PartitionedCall")]
    assert len(calls) == 2
    rewriter = rewriter_config_pb2.RewriterConfig
    for op in calls:
        rewrite = config_pb2.ConfigProto.FromString(
            op.get_attr("config_proto")).graph_options.rewrite_options
        assert rewriter.Toggle.Name(rewrite.function_optimization) == function_optimizer
        assert rewriter.NumIterationsType.Name(rewrite.meta_optimizer_iterations) == iterations


@pytest.mark.parametrize("args_of, flat", [
    # (a stage function's arguments from x, y; whether calls skip TF's binding)
    (lambda x, y: (x, [y, None], {"b": y, "a": x}, 1.0, None), True),
    (lambda x, y: ([x, x * 2.0], y, [None, y], 0.5, [y]), True),
    (lambda x, y: (tf.sparse.from_dense(x), y, None, 1.0, None), False),
])
def test_called_function_calls_its_concrete_function_on_tf_ordered_tensors(args_of, flat):
    """`concrete_inputs` (TF's private argument binding) gives the tensors a
    call passes in `tf.nest.flatten` order, so `CalledFunction` calls
    `call_concrete` (private `_call_flat`) on them and gets what TF's own call
    gives; an argument it cannot key (a SparseTensor) goes through TF's call."""

    def body(a, b, c, scale, d):
        total = sum(tf.reduce_sum(tf.sparse.to_dense(t) if isinstance(t, tf.SparseTensor) else t)
                    for t in tf.nest.flatten((a, b, c, d), expand_composites=False)
                    if t is not None)
        return {"total": total * scale, "pair": [total, None]}

    called = stage_functions.CalledFunction(body)
    results = {}

    @tf.function(autograph=False)
    def step(x, y):
        args = args_of(x, y)
        results["mine"] = called(*args)
        results["again"] = called(*args)
        results["tf"] = called.function(*args)
        return results["mine"]["total"], results["again"]["total"], results["tf"]["total"]

    mine, again, theirs = step(tf.ones((2, 3)), tf.fill((2, 3), 2.0))
    assert float(mine) == float(again) == float(theirs) > 0
    assert results["mine"]["pair"][1] is None
    assert [entry[1] for entry in called.concrete.values()] == ([True] if flat else [])


def test_keras_model_state_the_keras_face_reads():
    """The private Keras model state `PipelinedModel` reads or sets through
    `_internal`: the compiled loss, the loss tracker, the resolved
    jit_compile, the strategy fit runs under, a layer's call-context
    arguments and a trackable's checkpoint children."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2),
                              keras.layers.Dropout(0.5)])
    assert _internal.compiled_loss(model) is None
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    assert _internal.compiled_loss(model) is not None
    assert _internal.loss_tracker(model).name == "loss"
    assert _internal.jit_compile(model) is False
    arguments = _internal.compile_arguments(model)  # what keras.Model.compile was handed
    assert arguments["loss"] == "mse" and arguments["optimizer"] is model.optimizer
    assert "training" in _internal.call_context_args(model.layers[1])
    strategy = tfpipe.PipelineStrategy(devices=["/CPU:0"])
    adam = keras.optimizers.Adam()  # made outside any scope: captures the default strategy
    with strategy.scope(), pytest.raises(RuntimeError, match="Mixing different"):
        adam.build(model.trainable_variables)
    _internal.adopt_optimizers([adam], strategy)
    with strategy.scope():
        adam.build(model.trainable_variables)
    strategy = tfpipe.PipelineStrategy(devices=["/CPU:0"])
    _internal.set_distribute_strategy(model, strategy)
    assert model.distribute_strategy is strategy
    children = _internal.checkpoint_children(model)
    assert children and all(hasattr(c, "_trackable_children") for c in children.values())
    # The TPU system metadata a tracing-only TPUStrategy is made from.
    topology = tf.tpu.experimental.Topology(
        mesh_shape=[1, 1, 1, 2], device_coordinates=np.array([[(0, 0, 0, 0), (0, 0, 0, 1)]],
                                                              np.int32))
    meta = _internal_tpu.tpu_metadata(topology, ["/job:localhost/replica:0/task:0/device:TPU:0",
                                             "/job:localhost/replica:0/task:0/device:CPU:0"])
    assert (meta.num_cores, meta.num_hosts, meta.devices[0].device_type) == (2, 1, "TPU")
    # EmptyDataLikeKeras wraps the hook Keras' TF trainer peeks at the first batch in.
    assert callable(getattr(type(model), "_maybe_symbolic_build", None))
    assert _internal.EmptyDataLikeKeras._maybe_symbolic_build.__name__ == "_maybe_symbolic_build"
