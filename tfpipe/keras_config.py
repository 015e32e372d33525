"""A `PipelinedModel`'s Keras configs: how Keras saves one and rebuilds it.

`KerasConfig` is a mixin of `tfpipe.model.PipelinedModel` (the Keras face):
`get_config` writes the pipeline's settings and either the model `from_model`
cut (re-cut on load, at any layout) or the hand-made stages; `from_config`
rebuilds it under the `PipelineStrategy` in scope (`tfpipe.saving` holds the
rules: which settings a load keeps, the saved balance at a new layout); the
build and compile configs re-resolve what depends on the devices (XLA).
"""

import contextlib

import keras
import tensorflow as tf

from tfpipe import config as config_lib
from tfpipe import placement
from tfpipe import saving
from tfpipe import strategy as strategy_lib


class KerasConfig:
    """Keras' config methods of a `PipelinedModel` (see the module docstring)."""

    def get_config(self):
        config = {"name": self.name, "pipeline": self._pipeline_config.to_json(),
                  "input_dtype": self._input_dtype}
        if self._source is not None:
            config["source_model"] = keras.saving.serialize_keras_object(self._source.model)
            config["balance"] = list(self._source.balance)
            config["balance_method"] = self._source.method
            return config
        config["stages"] = saving.serialize_stages(self.stages, self.name)
        return config

    def get_build_config(self):
        if not self.built:
            return None
        return {"input_shape": self._built_input_shape, "input_dtype": self._input_dtype}

    def build_from_config(self, config):
        if config and not self.built:
            self._input_dtype = config.get("input_dtype", self._input_dtype)
            self.build(config["input_shape"])

    def get_compile_config(self):
        config = super().get_compile_config()
        if config and hasattr(self, "_jit_request"):
            # What the user asked: a layout loaded later resolves it again.
            config["jit_compile"] = self._jit_request
        return config

    def compile_from_config(self, config):
        # Keras skips this for models overriding compile(); ours only adds checks.
        config = keras.saving.deserialize_keras_object(config)
        if config.get("jit_compile") is True:
            host = self._pipeline_strategy
            chosen = self.pipeline_config.choose_execution(
                host.prefers_stage_functions(True, self.pipeline_devices))
            try:  # XLA was accepted for the saved layout; this one may not take it
                host.xla_modes(True, self.pipeline_devices, chosen.traits.stage_functions)
            except ValueError:
                config["jit_compile"] = False
        self.compile(**config)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds a saved pipeline under the current `PipelineStrategy`."""
        config = dict(config)
        strategy = strategy_lib.current_pipeline_host() or strategy_lib.PipelineStrategy()
        settings = saving.load_settings(config, strategy.given_settings)
        # The schedule the settings run (tfpipe's choice where none is set).
        schedule = config_lib.PipelineConfig.make(**settings).schedule
        request = saving.current_load_request()
        name, input_dtype = config.pop("name", None), config.pop("input_dtype", "float32")
        with strategy.scope() if strategy_lib.current_pipeline_host() is None \
                else contextlib.nullcontext():
            if "source_model" in config:
                # On the host first: the whole model may not fit on one accelerator.
                with tf.device(placement.host_device()):
                    source = keras.saving.deserialize_keras_object(
                        config["source_model"], custom_objects=custom_objects)
                named = {} if name is None else {"name": name}
                balance = saving.saved_balance(
                    config["balance"], strategy, schedule,
                    where=f"The saved model {name!r}")
                pipelined = cls.from_model(source, balance=balance, **named, **settings)
                if balance == config["balance"]:
                    pipelined._source.method = config.get("balance_method", "explicit")
                return pipelined
            if request is not None and (request.balance is not None or len(
                    config["stages"]) != strategy.max_stages(schedule)):
                raise ValueError(
                    f"{request.path} holds {len(config['stages'])} hand-made stages, which "
                    f"cannot be cut again. Load it under a strategy with as many stage "
                    f"slots, or build the pipeline with PipelinedModel.from_model(model) "
                    f"(re-cuttable) and save that.")
            stage_configs = config.pop("stages")
            try:
                devices = strategy.pipeline_devices(len(stage_configs), schedule)[1]
            except ValueError:
                devices = ()  # __init__ below raises the same error, with context
            stages = saving.deserialize_stages(stage_configs, devices, custom_objects)
            return cls(stages=stages, name=name, input_dtype=input_dtype, **settings)
