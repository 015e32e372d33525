"""What a saved pipeline is keyed by, and the plain Keras model behind one.

A cut model's checkpoints and files are keyed by its source model, never by
the stage layout, so what is written at K stages loads at K' stages;
hand-made stages load only at their own layout. `to_keras` returns the plain
Keras model; `LoadRequest` carries what `tfpipe.layout.load_model` asks.
"""

import contextlib
import contextvars
import os
import tempfile

import keras
import tensorflow as tf

from tfpipe import _internal
from tfpipe import config as config_lib
from tfpipe import devices as devices_lib
from tfpipe import inputs as inputs_lib

# Set by `load_model` for the `PipelinedModel.from_config` it triggers.
_LOAD_REQUEST = contextvars.ContextVar("tfpipe_load_request", default=None)


class LoadRequest:
    """What `load_model` asks of the pipeline it loads: a balance, settings."""

    def __init__(self, path, balance, settings):
        self.path, self.balance, self.settings = path, balance, dict(settings)


def current_load_request():
    """The `LoadRequest` of the `load_model` call in progress, or None."""
    return _LOAD_REQUEST.get()


@contextlib.contextmanager
def loading(request):
    """Makes `request` the current `LoadRequest` inside the block."""
    token = _LOAD_REQUEST.set(request)
    try:
        yield request
    finally:
        _LOAD_REQUEST.reset(token)


def saved_balance(saved_balance, strategy, schedule, where="this file"):
    """The balance a saved, cut model is rebuilt with under `strategy`: in
    `load_model` the requested one, else the saved one if the strategy places
    as many stages, else "params"; outside it the saved one if it fits."""
    request = current_load_request()
    saved_balance = list(saved_balance)
    slots = strategy.max_stages(schedule)
    if request is not None:
        if request.balance is not None:
            return request.balance
        return saved_balance if len(saved_balance) == slots else "params"
    if len(saved_balance) > slots:
        raise ValueError(
            f"{where} holds a pipeline of {len(saved_balance)} stages (balance="
            f"{saved_balance}), but the PipelineStrategy in scope places at most {slots} "
            f"with schedule={schedule.name!r}. Load it with tfpipe.load_model(path) to cut "
            f"it again for these devices (balance=None cuts by parameter count), or save "
            f"a plain Keras model with tfpipe.to_keras(model) for single-device use.")
    return saved_balance


def load_settings(config, given):
    """The settings a saved config loads with (popped from `config`): the saved
    ones, then those the strategy was `given`, then `load_model`'s overrides."""
    if "pipeline" not in config:
        raise ValueError(
            f"This PipelinedModel config has no 'pipeline' settings (keys: {sorted(config)}); "
            f"PipelinedModel.get_config writes them. Load a file this tfpipe saved, or cut the "
            f"plain Keras model again with tfpipe.PipelinedModel.from_model.")
    saved = config_lib.PipelineConfig.from_json(config.pop("pipeline")).settings()
    settings = config_lib.merge(saved, given).settings()
    request = current_load_request()
    if request is not None:  # tfpipe.load_model's overrides come last
        settings.update({k: v for k, v in request.settings.items() if v is not None})
    return settings


def serialize_stages(stages, name):
    """Hand-made stages' configs; refuses a layer shared by two stages."""
    owners = {}
    for k, stage in enumerate(stages):
        for layer in _internal.flatten_layers(stage):
            if id(layer) in owners and owners[id(layer)] != k:
                raise ValueError(
                    f"Cannot save {name!r}: layer {layer.name!r} is shared by "
                    f"stages {owners[id(layer)]} and {k}, and stages saved one by one "
                    f"would no longer share it. Build the pipeline with "
                    f"PipelinedModel.from_model(model), which saves the model once.")
            owners[id(layer)] = k
    return [keras.saving.serialize_keras_object(s) for s in stages]


def deserialize_stages(stage_configs, devices, custom_objects=None):
    """Hand-made stages from their configs, each made on its device."""
    stages = []
    for k, stage_config in enumerate(stage_configs):
        with devices_lib.scope(devices[k]) if k < len(devices) else contextlib.nullcontext():
            stages.append(keras.saving.deserialize_keras_object(
                stage_config, custom_objects=custom_objects))
    return stages


def to_keras(model, device=None, include_optimizer=True):
    """A new plain `keras.Model` (a copy of the source model, or hand-made
    stages chained) with `model`'s weights, on `device`; `include_optimizer`
    compiles it as `model` is, optimizer state copied."""
    if getattr(model, "pipeline_config", None) is None or not model.built:
        raise ValueError(f"to_keras needs a built tfpipe.PipelinedModel, got "
                         f"{type(model).__name__}; call model.build(input_shape) or fit "
                         f"first.")
    if tf.distribute.has_strategy():
        raise ValueError(
            "to_keras must be called outside any distribution strategy scope (here: "
            f"{type(tf.distribute.get_strategy()).__name__}): a plain model created in "
            "it would keep running under that strategy.")
    source = model.source_model if model.source_model is not None else _chain(model)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        # Keras' own serialisation keeps assets (lookup tables, adapted layers).
        source.save(path, include_optimizer=False)
        with tf.device(device) if device else contextlib.nullcontext():
            plain = keras.models.load_model(path, compile=False)
    foreign = sorted({type(layer).__module__ + "." + type(layer).__name__
                      for layer in _internal.flatten_layers(plain)
                      if type(layer).__module__.split(".")[0] == "tfpipe"})
    if foreign:
        raise ValueError(f"to_keras: the model contains tfpipe layers {foreign}, which "
                         f"plain Keras cannot load.")
    if include_optimizer and getattr(model, "compiled", False) and model.optimizer:
        with tf.device(device) if device else contextlib.nullcontext():
            compile_like(plain, model)
    return plain


def _chain(model):
    """Hand-made stages as one functional model: inputs -> stage 0 -> ... -> K-1."""
    build = model.get_build_config()
    inputs = h = inputs_lib.map_shapes(
        lambda s: keras.Input(batch_shape=tuple(s), dtype=build["input_dtype"]),
        build["input_shape"])
    for stage in model.stages:
        h = stage(h)
    name = model.name[len("pipelined_"):] if model.name.startswith("pipelined_") else model.name
    return keras.Model(inputs, h, name=name)


def compile_like(target, source):
    """Compiles `target` as `source` is, carrying the optimizer state over."""
    config = keras.saving.deserialize_keras_object(source.get_compile_config())
    config.pop("jit_compile", None)
    config["optimizer"] = source.optimizer.__class__.from_config(source.optimizer.get_config())
    target.compile(**config)
    if not target.optimizer.built:
        target.optimizer.build(target.trainable_variables)
    _copy_optimizer_state(source.optimizer, target.optimizer)


def _copy_optimizer_state(source, target):
    """Copies `source`'s variables (iterations, learning rate, slots) into `target`."""
    if not source.built:
        return
    if not target.built:
        raise RuntimeError("tfpipe bug: the target optimizer is not built.")
    theirs, ours = list(source.variables), list(target.variables)
    shapes = [tuple(v.shape) for v in theirs], [tuple(v.shape) for v in ours]
    if shapes[0] != shapes[1]:
        raise ValueError(
            f"Cannot carry the optimizer state over: the source optimizer holds "
            f"{len(theirs)} variables shaped {shapes[0][:4]}..., the new one "
            f"{len(ours)} shaped {shapes[1][:4]}.... Pass include_optimizer=False.")
    for mine, value in zip(ours, theirs):
        mine.assign(value.value if hasattr(value, "value") else value)
