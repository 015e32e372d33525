"""Loading a saved model at another layout: `load_model`.

A `.keras` file saved from a pipelined model (cut by `from_model`, at any
number of stages) or from a plain Keras model loads as a `PipelinedModel`
cut for the `PipelineStrategy` in scope; `tfpipe.saving` says what the
saved files are keyed by, and `to_keras` turns a pipeline back into plain
Keras.

>>> with tfpipe.PipelineStrategy(devices=["/CPU:0", "/CPU:1"]).scope():
...     model = tfpipe.load_model("run_at_4_stages.keras")  # doctest: +SKIP
"""

import contextlib
import os

import keras
import tensorflow as tf

from tfpipe import model as model_lib
from tfpipe import saving
from tfpipe import strategy as strategy_lib
from tfpipe.saving import to_keras  # noqa: F401  (tfpipe.layout.to_keras, as before)

def load_model(path, balance=None, custom_objects=None, compile=True, **settings):  # pylint: disable=redefined-builtin
    """Loads a `.keras` file as a `PipelinedModel` cut for the current strategy.

    Args:
      path: a `.keras` file saved from a `PipelinedModel` cut by `from_model`
        (any number of stages), or from a plain Keras model.
      balance: units per stage, `"params"`, `"time"` or `"memory"` (see
        `PipelinedModel.from_model`); None keeps the saved balance when the
        strategy places as many stages, else cuts by parameter count over
        the strategy's stages.
      custom_objects: passed to `keras.models.load_model`.
      compile: restore the saved compile arguments and optimizer state.
      **settings: pipeline settings that override the saved ones
        (`num_microbatches`, `schedule`, `recompute`, `execution`,
        `batch_norm`).

    Uses the `PipelineStrategy` in scope, else a default one over all
    devices. Returns a built `PipelinedModel` whose weights (and optimizer
    slots, when compiled) are those saved.
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path).endswith(".keras"):
        raise ValueError(f"path must be a .keras file, got {path!r}. For checkpoints use "
                         f"tf.train.Checkpoint(model=model).restore(...) on a model you "
                         f"built at the new layout.")
    unknown = sorted(set(settings) - {"num_microbatches", "schedule", "recompute",
                                      "execution", "batch_norm"})
    if unknown:
        raise ValueError(f"load_model got unknown setting(s) {unknown}; it takes "
                         f"num_microbatches, schedule, recompute, execution, batch_norm "
                         f"(devices come from the PipelineStrategy in scope).")
    if tf.distribute.has_strategy() and strategy_lib.current_pipeline_strategy() is None:
        raise ValueError(
            f"load_model must run under a tfpipe.PipelineStrategy scope (or none), not "
            f"{type(tf.distribute.get_strategy()).__name__}.")
    in_scope = strategy_lib.current_pipeline_strategy()
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
