"""Loading a saved model at another layout: `load_model`.

A `.keras` file saved from a cut `PipelinedModel` (any number of stages) or
from a plain Keras model loads as a `PipelinedModel` cut for the
`PipelineStrategy` in scope (`tfpipe.saving` says what files are keyed by).
"""

import contextlib
import os

import keras
import tensorflow as tf

from tfpipe import config as config_lib
from tfpipe import model as model_lib
from tfpipe import saving
from tfpipe import strategy as strategy_lib
from tfpipe.saving import to_keras  # noqa: F401  (tfpipe.layout.to_keras, as before)


def load_model(path, balance=None, custom_objects=None, compile=True, **settings):  # pylint: disable=redefined-builtin
    """Loads a `.keras` file as a built `PipelinedModel` cut for the
    `PipelineStrategy` in scope. `balance` as in `from_model` (None: the saved
    one when the strategy places as many stages, else "params"); `settings`
    override the saved pipeline settings."""
    if not isinstance(path, (str, os.PathLike)) or not str(path).endswith(".keras"):
        raise ValueError(f"path must be a .keras file, got {path!r}. For checkpoints use "
                         f"tf.train.Checkpoint(model=model).restore(...) on a model you "
                         f"built at the new layout.")
    unknown = sorted(set(settings) - set(config_lib.FIELDS))
    if unknown:
        raise ValueError(f"load_model got unknown setting(s) {unknown}; it takes "
                         f"{', '.join(config_lib.FIELDS)} "
                         f"(devices come from the PipelineStrategy in scope).")
    if tf.distribute.has_strategy() and strategy_lib.current_pipeline_host() is None:
        raise ValueError(
            f"load_model must run under a tfpipe.PipelineStrategy or a "
            f"tf.distribute.TPUStrategy scope (or none), not "
            f"{type(tf.distribute.get_strategy()).__name__}.")
    in_scope = strategy_lib.current_pipeline_host()
    strategy = in_scope or strategy_lib.PipelineStrategy()
    request = saving.LoadRequest(str(path), balance, settings)
    with saving.loading(request), (strategy.scope() if in_scope is None
                                   else contextlib.nullcontext()):
        loaded = keras.models.load_model(path, custom_objects=custom_objects,
                                         compile=compile)
        if not isinstance(loaded, model_lib.PipelinedModel):
            # A plain Keras model (e.g. saved from to_keras): cut it here.
            loaded = _cut_plain(loaded, balance, settings,
                                compiled=compile and loaded.optimizer is not None)
    return loaded


def _cut_plain(plain, balance, settings, compiled):
    pipelined = model_lib.PipelinedModel.from_model(plain, balance=balance, **settings)
    if compiled:
        saving.compile_like(pipelined, plain)
    return pipelined
