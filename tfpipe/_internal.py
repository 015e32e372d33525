"""The one place where tfpipe touches private TensorFlow and Keras APIs.

Seed generators, the metadata Keras keeps on
tensors, the compiled loss's terms, a variable's storage, BatchNorm's moments:
everything private is used here and nowhere else, and
`tfpipe_tests/test_testing_and_internal.py` pins it, so a TensorFlow or Keras
upgrade breaks this file and its test, not the engine. The custom
`StrategyExtended`s are the same boundary's, in `_internal_distribute`; a
TPUStrategy's private parts and the optimizer wrapper that places its
updates per core, in `_internal_tpu`.
"""
# pylint: disable=protected-access

import contextlib

import keras
import tensorflow as tf
from keras.src.backend.common import masking as keras_masking
from tensorflow.python.client import device_lib
from tensorflow.python.eager import context
from tensorflow.python.eager.polymorphic_function import function_type_utils
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util


def local_copies(variable):
    """The per-replica storage of a (Keras or TF) variable: one tensor-like
    per replica for a mirrored variable, else the variable itself."""
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return tuple(getattr(value, "values", (value,)))


def adopt_optimizers(optimizers, strategy):
    """Makes Keras TF optimizers create their slots through `strategy`
    (Keras captures the strategy in scope when an optimizer is created)."""
    for optimizer in optimizers:
        if hasattr(optimizer, "_distribution_strategy"):
            optimizer._distribution_strategy = strategy


def place_optimizer_updates(optimizer, device_of):
    """Makes a Keras TF optimizer do each variable's work in its device's
    scope: `device_of(variable)` is a hashable object with a `scope()` (a
    `tfpipe.devices.StageDevice`), or None for no scope, where `variable` is
    the TF variable Keras works on (`keras.Variable.value`, or a replica's
    copy). The work: the gradients' all-reduce over replicas (one per device,
    not one for all), the weight decay and `update_step` (slots included); not
    a LossScaleOptimizer's inner optimizer (wrap it too). Wraps this
    instance's methods once; a second call replaces `device_of`.

    Why here, not in a strategy's `update`: Keras runs these in no device
    scope, and a TPUStrategy's `update` inside its replica adds none, so each
    would land on the replica's first core and read every stage's variables
    there."""
    wrapped = getattr(optimizer, "_tfpipe_device_of", None) is not None
    optimizer._tfpipe_device_of = device_of
    if wrapped:
        return
    update_step = optimizer.update_step
    reduce_gradients = optimizer._all_reduce_sum_gradients
    weight_decay = optimizer._apply_weight_decay

    def device(variable):
        value = variable.value if isinstance(variable, keras.Variable) else variable
        return optimizer._tfpipe_device_of(value)

    def scope(variable):
        found = device(variable)
        return contextlib.nullcontext() if found is None else found.scope()

    def by_device(variables):
        """Positions of `variables` grouped by device, in first-seen order."""
        out = {}
        for i, variable in enumerate(variables):
            out.setdefault(device(variable), []).append(i)
        return list(out.values())

    def placed_update_step(gradient, variable, learning_rate):
        with scope(variable):
            return update_step(gradient, variable, learning_rate)

    def placed_reduce(grads_and_vars):
        pairs = list(grads_and_vars)
        out = [None] * len(pairs)
        for positions in by_device([v for _, v in pairs]):
            with scope(pairs[positions[0]][1]):
                reduced = reduce_gradients([pairs[i] for i in positions])
            for i, pair in zip(positions, reduced):
                out[i] = pair
        return out

    def placed_weight_decay(variables):
        variables = list(variables)
        for positions in by_device(variables):
            with scope(variables[positions[0]]):
                weight_decay([variables[i] for i in positions])

    optimizer.update_step = placed_update_step
    optimizer._all_reduce_sum_gradients = placed_reduce
    optimizer._apply_weight_decay = placed_weight_decay


def seed_generators(layer):
    """All `keras.random.SeedGenerator`s used by `layer` and its sub-layers."""
    found = []
    for sub in layer._flatten_layers(include_self=True, recursive=True):
        for gen in getattr(sub, "_seed_generators", ()):
            if all(gen is not g for g in found):
                found.append(gen)
    return found


def in_keras_symbolic_build():
    """True inside Keras' symbolic (stateless) build, where variable creation
    is deferred and would later land on the default device."""
    from keras.src.backend.common import stateless_scope  # pylint: disable=import-outside-toplevel
    return stateless_scope.in_stateless_scope()


def in_xla_context():
    """True while tracing code that XLA will compile as one program: a
    `tf.function(jit_compile=True)` (Keras' `compile(jit_compile=True)`) or a
    TPU computation, or anything nested in one."""
    return control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


def in_keras_symbolic_scope():
    """True inside Keras' `compute_output_spec` (its symbolic build of a model
    traces it on placeholders that are dense even for ragged inputs)."""
    from keras.src.backend.common import symbolic_scope  # pylint: disable=import-outside-toplevel
    return symbolic_scope.in_symbolic_scope()


def chain_ops(ops_in_order, after=None):
    """Adds control edges so `ops_in_order` run one after another (after
    `after`), emulating one accelerator stream per device on CPU; ops made
    while tracing one action are in topological order, so this adds no cycle.
    Returns the last op (or `after`)."""
    previous = after
    for op in ops_in_order:
        if previous is not None and previous not in op.control_inputs:
            op._add_control_input(previous)
        previous = op
    return previous


def unordered_timestamp():
    """`tf.timestamp()` (float64 seconds) that tf.function does not chain.

    tf.function runs stateful ops without a resource input, `Timestamp`
    among them, in creation order: a stamp per action would serialise the
    devices. Marked independent (`run_independently` of the graph's
    `experimental_acd_manager`), it is ordered only by its caller's control
    edges, and still runs before the function returns.
    """
    stamp = tf.timestamp()
    manager = getattr(tf.compat.v1.get_default_graph(), "experimental_acd_manager", None)
    if manager is not None and not tf.executing_eagerly():
        manager.run_independently(stamp.op)
    return stamp


_CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")
_FUNCTION_ATTRS = ("f", "body", "cond", "then_branch", "else_branch")


def called_graphs(op):
    """The `FuncGraph`s `op` runs: a call's function, a While's cond and
    body, an If's or a Case's branches; each looked up in the library of the
    op's graph or an enclosing one (a function traced inside another is
    registered there). Functions not traced from Python are left out."""
    names = [op.get_attr(a).name for a in _FUNCTION_ATTRS if a in op.node_def.attr]
    if "branches" in op.node_def.attr:
        names += [f.name for f in op.get_attr("branches")]
    found = []
    for name in names:
        graph = op.graph
        while graph is not None:
            function = graph._get_function(name)
            if function is not None:
                if getattr(function, "graph", None) is not None:
                    found.append(function.graph)
                break
            graph = getattr(graph, "outer_graph", None)
    return found


def function_body(call_op):
    """The `FuncGraph` a function call op runs (None if it is not a call op,
    or its function is not a traced one: see `called_graphs`)."""
    if call_op.type not in _CALL_OPS:
        return None
    return next(iter(called_graphs(call_op)), None)


def concrete_inputs(concrete, args):
    """The tensors a call of `concrete` (a `ConcreteFunction`) on `args`
    passes to its op, by TF's own binding of the arguments."""
    bound = function_type_utils.canonicalize_function_inputs(args, {}, concrete.function_type)
    return concrete.function_type.unpack_inputs(bound)


def call_concrete(concrete, tensors):
    """Calls `concrete` on `tensors` as `concrete_inputs` gives them, without
    binding the arguments again (TF redoes that on every call); returns its
    structured outputs."""
    return concrete._call_flat(tensors, captured_inputs=concrete.captured_inputs)


@contextlib.contextmanager
def grappler_options(function_optimizer=True):
    """Runs the block's `tf.function` calls, and the traces they start, with
    grappler's optimizers run once instead of twice and, unless
    `function_optimizer`, its function optimizer off; in this thread only
    (through the eager context's `function_call_options`, not the
    process-wide options).

    One pass: on the transformer benchmark first calls took 12-24% less,
    steps unchanged (BUILD.md, "After the stream fix and one grappler pass").
    The function optimizer specialises a non-inlined function to each call
    op and optimises each copy again: a stage function called by 2M actions
    was optimised up to 2M times.
    """
    ctx = context.context()
    saved = ctx.function_call_options
    config = tf.compat.v1.ConfigProto()
    config.ParseFromString(saved.config_proto_serialized)
    rewrite = config.graph_options.rewrite_options
    rewrite.meta_optimizer_iterations = rewrite.ONE
    if not function_optimizer:
        rewrite.function_optimization = rewrite.OFF
    ctx.function_call_options = context.FunctionCallOptions(
        executor_type=saved.executor_type, config_proto=config)
    try:
        yield
    finally:
        ctx.function_call_options = saved


def get_keras_mask(tensor):
    """The Keras mask riding on `tensor` (`_keras_mask`), or None."""
    return keras_masking.get_keras_mask(tensor)


def set_keras_mask(tensor, mask):
    """Attaches `mask` to `tensor` as Keras does (layers and losses read it)."""
    keras_masking.set_keras_mask(tensor, mask)


def get_keras_logits(tensor):
    """The logits a softmax/sigmoid output was computed from, or None (Keras'
    crossentropy reads them, so its gradient flows through the logits)."""
    return getattr(tensor, "_keras_logits", None)


def set_keras_logits(tensor, logits):
    try:
        tensor._keras_logits = logits
    except AttributeError:  # eager tensors take no attributes (nor does Keras)
        pass


def move_variable(variable, scope, named_by_path=False):
    """Re-creates a built Keras variable's storage inside `scope` (a context
    manager: `tf.device(name)`, a TPU logical core's), same value; the
    `keras.Variable` object (and every layer sharing it) stays, only its
    backing `tf.Variable` is new. `named_by_path`: the TF variable is named
    by the Keras path (`dense_1/kernel`, not `kernel`), so that a traced
    graph or a profile names each variable's handle apart."""
    parent = variable.path.rpartition("/")[0]
    names = (tf.name_scope(parent + "/") if named_by_path and parent
             else contextlib.nullcontext())
    with scope, names:
        variable._initialize(variable.value.read_value())


def producing_node(tensor):
    """(operation, node, node index) of the call that made a KerasTensor, or
    (None, None, None) for a tensor with no Keras history."""
    history = getattr(tensor, "_keras_history", None)
    if history is None or history.operation is None:
        return None, None, None
    op = history.operation
    return op, op._inbound_nodes[history.node_index], history.node_index


def keep_input_types(layer):
    """Stops Keras' `Layer.__call__` from converting `layer`'s inputs (it would
    turn a RaggedTensor dense), as Keras' functional models do; `layer.call`
    then converts what needs converting."""
    layer._convert_input_args = False
    layer._allow_non_tensor_positional_args = True


def flatten_layers(layer):
    """`layer` and all its sub-layers, recursively, each once."""
    return layer._flatten_layers(include_self=True, recursive=True)


def call_losses(layer):
    """Losses `layer` and its sub-layers added during their last call
    (`add_loss`, activity regularisers); weight regularisers excluded."""
    return [loss for _, losses in call_losses_by_layer(layer) for loss in losses]


def call_losses_by_layer(layer):
    """(sub-layer, the losses it added itself) for `layer` and each of its
    sub-layers that added any during their last call."""
    found = [(sub, list(sub._get_own_losses())) for sub in flatten_layers(layer)]
    return [(sub, losses) for sub, losses in found if losses]


def reset_compiled_functions(model):
    """Drops a Keras model's cached train/test/predict functions (they hold
    the variables' old storage after `move_variable`)."""
    for sub in flatten_layers(model):
        if isinstance(sub, keras.Model):
            sub.train_function = sub.test_function = sub.predict_function = None


@contextlib.contextmanager
def intercept_moments(layer, record):
    """While active, `layer` (a BatchNormalization) reports every (mean,
    variance) it normalises with: `record(inputs, mask, mean, variance)`
    (Keras' own training branch still runs)."""
    original = type(layer)._moments

    def moments(inputs, mask):
        mean, variance = original(layer, inputs, mask)
        record(inputs, mask, mean, variance)
        return mean, variance

    layer._moments = moments
    try:
        yield
    finally:
        del layer._moments


def batch_norm_reduction_axes(layer):
    return list(layer._reduction_axes)


def compiled_loss_terms(compile_loss):
    """The built `CompileLoss`'s terms: (path, loss, weight, name) each, where
    `loss` is a `keras.losses.Loss` and `path` indexes y_true and y_pred."""
    return [(t.path, t.loss, t.loss_weights, t.name) for t in compile_loss._flat_losses]


def compiled_loss_structures(compile_loss):
    """The (y_true, y_pred) structures the `CompileLoss` was built for."""
    return compile_loss._y_true_build_structure, compile_loss._y_pred_build_structure


def user_loss(compile_loss):
    """The `loss` argument given to `compile`."""
    return compile_loss._user_loss


def set_distribute_strategy(model, strategy):
    """Makes Keras' fit/evaluate/predict of `model` run under `strategy`
    (Keras reads the model's `_distribute_strategy`)."""
    model._distribute_strategy = strategy


def compile_arguments(model):
    """The arguments a compiled Keras model's `compile` finally handed to
    `keras.Model.compile` (a subclass's defaults, such as a keras-hub Task's
    "auto" optimizer, loss and metrics, resolved), as objects."""
    return dict(model._compile_config.config)


def compiled_loss(model):
    """The `CompileLoss` Keras built from `compile(loss=...)`, or None."""
    return getattr(model, "_compile_loss", None)


def loss_tracker(model):
    """The `Mean` metric Keras reports as `loss`."""
    return model._loss_tracker


def jit_compile(model):
    """The `jit_compile` setting Keras resolved at `compile` (None before)."""
    return getattr(model, "_jit_compile", None)


def call_context_args(layer):
    """The call arguments a Keras layer takes from its call context
    (`training`, ...): a functional model passes those down."""
    return getattr(layer, "_call_context_args", ())


class CheckpointAs:
    """Mixin for a Keras model: `tf.train.Checkpoint` saves
    `self.checkpoint_children()` (a dict of trackables) as its children
    (Keras 3 would list none)."""

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        if save_type != "checkpoint":
            return super()._trackable_children(save_type, **kwargs)
        return self.checkpoint_children()


def checkpoint_children(trackable):
    """What `tf.train.Checkpoint` saves as `trackable`'s children."""
    return trackable._trackable_children("checkpoint")


class EmptyDataLikeKeras:
    """Mixin for a Keras model under a distribution strategy: Keras' TF
    trainer then peeks at the first batch to build symbolically
    (`_maybe_symbolic_build`), which raises a bare StopIteration on empty
    data; without a strategy Keras runs no step and returns. Do the same."""

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        try:
            return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)
        except StopIteration:
            return None


def device_memory_limit(name):
    """The bytes TF's allocator may use on local device `name` (a GPU's
    memory less what TF reserves, or a logical device's `memory_limit`), as
    `device_lib` reports it; None where it lists no such device."""
    kind_and_index = lambda n: (tf.DeviceSpec.from_string(n).device_type,  # noqa: E731
                                tf.DeviceSpec.from_string(n).device_index)
    return next((int(d.memory_limit) for d in device_lib.list_local_devices()
                 if kind_and_index(d.name) == kind_and_index(name)), None)
