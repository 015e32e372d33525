"""tfpipe: GPipe-style pipeline-parallel training for TensorFlow 2 / Keras 3.

The public surface is what `__all__` names, imported when first used (PEP
562) so that `import tfpipe.config` does not start TensorFlow. Calls go down:
`model` -> `engine` -> `unrolled` / `loop` -> `runtime` -> `stage` ->
`boundary`, `loss`, `batchnorm`, `recompute`, `gradients`, `microbatch` ->
`schedules`, `simulation`, `actions`, `config` (pure Python) and `_internal`
(every private TF/Keras API).
"""

import importlib

__version__ = "0.1.0"

# public name -> (module, attribute or None for the module itself)
_PUBLIC = {
    "PipelineStrategy": ("tfpipe.strategy", "PipelineStrategy"),
    "PipelinedModel": ("tfpipe.model", "PipelinedModel"),
    "PipelineConfig": ("tfpipe.config", "PipelineConfig"),
    "plan": ("tfpipe.planner", "plan"),
    "Plan": ("tfpipe.planner", "Plan"),
    "load_model": ("tfpipe.layout", "load_model"),
    "to_keras": ("tfpipe.saving", "to_keras"),
    "StepWatchdog": ("tfpipe.watchdog", "StepWatchdog"),
    "verify": ("tfpipe.verification", "verify"),
    "Verification": ("tfpipe.verification", "Verification"),
}
_PUBLIC_MODULES = ("config", "schedules", "timeline", "watchdog", "cluster", "testing", "tpu")

__all__ = sorted(_PUBLIC) + list(_PUBLIC_MODULES) + ["__version__"]


_NO_TENSORFLOW = ("tfpipe needs TensorFlow, which is not installed. Install the extra for "
                  "this machine: pip install 'tfpipe[cpu]' (CPU), 'tfpipe[and-cuda]' "
                  "(NVIDIA GPU) or 'tfpipe[tpu]' (Cloud TPU VM).")


def _import(module):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name == "tensorflow":
            raise ModuleNotFoundError(_NO_TENSORFLOW, name="tensorflow") from err
        raise


def __getattr__(name):
    if name in _PUBLIC:
        module, attribute = _PUBLIC[name]
        value = getattr(_import(module), attribute)
    elif not name.startswith("__"):
        try:  # a module of the package (public, or the implementation's)
            value = _import(f"tfpipe.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"tfpipe.{name}":
                raise
            raise AttributeError(f"module 'tfpipe' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'tfpipe' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
