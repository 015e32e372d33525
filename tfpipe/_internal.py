"""The one place where tfpipe touches private TensorFlow and Keras APIs.

A custom `tf.distribute.Strategy` needs a `StrategyExtended` implementation and
TensorFlow only ships private ones; re-materialisation needs a layer's seed
generators, which Keras keeps in a private attribute. Everything private is used
here and nowhere else, and `tfpipe_tests/test_internal.py` pins it, so a
TensorFlow or Keras upgrade breaks this file and its test, not the engine.
"""

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.framework import ops


class PipelineExtended(distribute_lib._DefaultDistributionExtended):  # pylint: disable=protected-access
    """Single-replica `StrategyExtended` that never overrides device scopes.

    Unlike `OneDeviceStrategy` it creates each variable where the enclosing
    `tf.device` says (the stage's device), colocates optimizer slots with their
    variable, and runs each optimizer update on the variable's device.
    """

    def __init__(self, container_strategy, devices):
        super().__init__(container_strategy)
        self._pipeline_devices = tuple(devices)

    def _scope(self, strategy):
        # The default strategy's scope does not make itself current; the base
        # class's does (and routes variable creation through _create_variable).
        return distribute_lib.StrategyExtendedV1._scope(self, strategy)

    def _create_variable(self, next_creator, **kwargs):
        colocate_with = kwargs.pop("colocate_with", None)
        if colocate_with is not None:
            with ops.device(colocate_with.device):
                return next_creator(**kwargs)
        return next_creator(**kwargs)

    def colocate_vars_with(self, colocate_with_variable):
        # ops.colocate_with is lost when Keras lifts slot creation out of a
        # tf.function with init_scope; an explicit device survives.
        return ops.device(colocate_with_variable.device)

    def _update(self, var, fn, args, kwargs, group):
        with ops.device(var.device):
            return super()._update(var, fn, args, kwargs, group)

    def variable_created_in_scope(self, v):
        return getattr(v, "_distribute_strategy", None) is self._container_strategy()

    @property
    def worker_devices(self):
        return self._pipeline_devices

    @property
    def parameter_devices(self):
        return self._pipeline_devices

    def non_slot_devices(self, var_list):
        return self._pipeline_devices[0]


def adopt_optimizer(optimizer, strategy):
    """Makes a Keras TF optimizer place slots and updates through `strategy`.

    Keras captures `tf.distribute.get_strategy()` when an optimizer is created;
    one created outside `strategy.scope()` would otherwise keep the default
    strategy and run every stage's update math on the default device.
    """
    if hasattr(optimizer, "_distribution_strategy"):
        optimizer._distribution_strategy = strategy  # pylint: disable=protected-access
    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    if inner is not None:
        adopt_optimizer(inner, strategy)


def seed_generators(layer):
    """All `keras.random.SeedGenerator`s used by `layer` and its sub-layers."""
    found = []
    for sub in layer._flatten_layers(include_self=True, recursive=True):  # pylint: disable=protected-access
        for gen in getattr(sub, "_seed_generators", ()):
            if all(gen is not g for g in found):
                found.append(gen)
    return found


def compiled_loss_reductions(model):
    """The `reduction` of every loss given to `model.compile`, as strings.

    Returns an empty list when no loss was compiled.
    """
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is None:
        return []
    import keras  # local: keep import order simple for the tests

    reductions = []
    for loss in tf.nest.flatten(getattr(compile_loss, "_user_loss", None)):
        if loss is None:
            continue
        if isinstance(loss, str) or not isinstance(loss, keras.losses.Loss):
            reductions.append("sum_over_batch_size")  # Keras wraps functions so
        else:
            reductions.append(str(loss.reduction))
    return reductions


def in_keras_symbolic_build():
    """True inside Keras' symbolic (stateless) build, where variable creation
    is deferred and would later land on the default device."""
    from keras.src.backend.common import stateless_scope  # pylint: disable=import-outside-toplevel

    return stateless_scope.in_stateless_scope()


def chain_ops(ops_in_order, after=None):
    """Adds control edges so `ops_in_order` run one after another (after `after`).

    Used to emulate one accelerator stream per device on CPU (benchmarks):
    graph ops created while tracing one action are in a valid topological
    order, so chaining them adds no cycle. Returns the last op (or `after`).
    """
    previous = after
    for op in ops_in_order:
        if previous is not None and previous not in op.control_inputs:
            op._add_control_input(previous)  # pylint: disable=protected-access
        previous = op
    return previous
