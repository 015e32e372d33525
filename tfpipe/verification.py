"""`tfpipe.verify`: one pipelined step against plain Keras, on the user's batch.

Before a long run, the question is whether tfpipe trains *this* model as its
own `fit` would. `verify` answers it on the model and data in hand: two copies
of the model from the same weights take one optimizer step on the same batch,
plain Keras on the host CPU and the pipeline under the given settings, and
every variable is compared. Where float32 disagrees, both take the step again
in float64 (every layer's dtype policy, the inputs and the losses): a correct
pipeline then agrees to float64's precision, a real difference does not move.
On a model so ill-conditioned that float64 itself is noisy, "precision" is
plain Keras' own float64 noise: how far its step moves when its initial
weights are scaled by 1 + 1e-15, measured alongside.

    >>> report = tfpipe.verify(model, x, y, num_microbatches=4)   # doctest: +SKIP
    >>> print(report)            # the verdict, then the variables furthest apart
    >>> report.verdict           # "exact", "float32 noise (float64 agrees)" or "differs"
"""

import contextlib
import dataclasses

import keras
import numpy as np
import tensorflow as tf

from tfpipe import _internal
from tfpipe import model as model_lib
from tfpipe import placement
from tfpipe import strategy as strategy_lib

EXACT, NOISE, DIFFERS = "exact", "float32 noise (float64 agrees)", "differs"


@dataclasses.dataclass
class VariableDifference:
    """One variable: its path, the layer holding it, the largest absolute
    difference after the step in float32 and (when repeated) in float64."""
    path: str
    layer: str
    float32: float
    float64: float = None


@dataclasses.dataclass
class Verification:
    """What `verify` found. `variables` is sorted by the float32 difference,
    largest first; `verdict` is `EXACT`, `NOISE` or `DIFFERS`;
    `float64_noise`: plain Keras' own float64 noise (None: not repeated)."""
    verdict: str
    variables: list
    tolerance: float
    float64_tolerance: float
    settings: dict
    float64_noise: float = None

    @property
    def worst(self):
        """The `VariableDifference` furthest apart (in float64 when repeated)."""
        key = (lambda v: v.float64) if self.variables[0].float64 is not None \
            else (lambda v: v.float32)
        return max(self.variables, key=key)

    def __str__(self):
        worst = self.worst
        lines = [f"tfpipe.verify ({self.settings}): {self.verdict}. The largest difference "
                 f"after one step is {worst.float32:.3g} in float32"
                 + ("" if worst.float64 is None else f", {worst.float64:.3g} in float64")
                 + f", at {worst.path!r} of {worst.layer} (tolerance {self.tolerance:g} in "
                   f"float32, {self.float64_tolerance:g} in float64"
                 + ("" if self.float64_noise is None else
                    f"; plain Keras' own float64 noise {self.float64_noise:.3g}") + ").",
                 f"{'variable':<48}{'layer':<36}{'float32':>12}{'float64':>12}"]
        for v in self.variables[:10]:
            f64 = "" if v.float64 is None else f"{v.float64:.3g}"
            lines.append(f"{v.path:<48}{v.layer:<36}{v.float32:>12.3g}{f64:>12}")
        return "\n".join(lines)


def verify(model, x, y=None, sample_weight=None, *, optimizer=None, loss=None, metrics=None,
           tolerance=1e-5, float64_tolerance=1e-9, **strategy_kwargs):
    """One pipelined optimizer step against plain Keras on (x, y) as one batch.

    Args:
      model: a Keras model as `PipelinedModel.from_model` takes it (it is not
        changed: both sides train copies, made by `keras.models.clone_model`
        with its weights).
      x, y, sample_weight: one batch, as `fit` takes arrays.
      optimizer, loss, metrics: as `compile`; None takes the model's own
        compile configuration (it must be compiled, or `loss` given; the
        optimizer then defaults to SGD, whose update is the gradient itself).
      tolerance: the largest absolute weight difference called exact in
        float32; float64_tolerance: the same in float64.
      **strategy_kwargs: the `tfpipe.PipelineStrategy` settings
        (`num_microbatches`, `schedule`, `recompute`, `execution`, `devices`,
        ...); `balance` is passed to `from_model`.

    Returns a `Verification`: "exact" (float32 within `tolerance`), "float32
    noise (float64 agrees)" (float64 within `float64_tolerance`, or within
    10x plain Keras' own float64 noise), or "differs", with every variable's
    difference and its layer.
    """
    if loss is None and not getattr(model, "compiled", False):
        raise ValueError(
            f"verify: {model.name!r} is not compiled and no loss was given. Pass loss= (and "
            f"optimizer=, metrics= if wanted), or compile the model first.")
    compiled = {} if loss is not None else keras.saving.deserialize_keras_object(
        model.get_compile_config())
    settings = {"optimizer": optimizer or compiled.get("optimizer") or "sgd",
                "loss": loss or compiled.get("loss"),
                "metrics": metrics or compiled.get("metrics")}
    balance = strategy_kwargs.pop("balance", None)
    # Compile arguments as configs: each copy gets its own optimizer.
    settings = {k: keras.saving.serialize_keras_object(v) if v is not None else None
                for k, v in settings.items()}
    data = (x, y, sample_weight)
    differences, _ = _compare(model, data, settings, strategy_kwargs, balance, "float32")
    label = {k: v for k, v in strategy_kwargs.items() if k != "devices"}
    if max(d.float32 for d in differences) <= tolerance:
        return Verification(EXACT, differences, tolerance, float64_tolerance, label)
    in_float64, noise = _compare(model, data, settings, strategy_kwargs, balance, "float64")
    for d, d64 in zip(differences, in_float64):
        d.float64 = d64.float32
    agrees = max(d.float64 for d in differences) <= max(float64_tolerance, 10 * noise)
    return Verification(NOISE if agrees else DIFFERS, differences, tolerance, float64_tolerance,
                        label, noise)


def _compare(model, data, settings, strategy_kwargs, balance, dtype):
    """([VariableDifference] after one step of each copy in `dtype`, plain
    Keras' own noise: the largest change of its step when its initial weights
    are scaled by 1 + 1e-15, in float64; 0.0 in float32, where it is not
    measured)."""
    with _floatx(dtype):
        x, y, sample_weight = (tf.nest.map_structure(lambda a: _cast(a, dtype), part)
                               if part is not None else None for part in data)
        host = placement.available_devices("CPU")[0]
        steps = []
        for scale in (1.0, 1.0 + 1e-15) if dtype == "float64" else (1.0,):
            with tf.device(host):
                reference = _copy(model, dtype, scale)
                reference.compile(**_fresh(settings))
                reference.fit(x, y, sample_weight=sample_weight, batch_size=_rows(x), epochs=1,
                              shuffle=False, verbose=0)
                steps.append([np.asarray(v.numpy(), np.float64) for v in reference.weights])
        expected = steps[0]
        noise = max((float(np.max(np.abs(a - b), initial=0.0)) for a, b in zip(*steps)),
                    default=0.0) if len(steps) > 1 else 0.0
        source = _copy(model, dtype)
        with strategy_lib.PipelineStrategy(**strategy_kwargs).scope():
            pipelined = model_lib.PipelinedModel.from_model(source, balance=balance)
            pipelined.compile(**_fresh(settings))
        pipelined.fit(x, y, sample_weight=sample_weight, batch_size=_rows(x), epochs=1,
                      shuffle=False, verbose=0)
        layers = _owners(source)
        found = [VariableDifference(v.path, layers.get(id(v), "?"),
                                    float(np.max(np.abs(np.asarray(v.numpy(), np.float64)
                                                        - np.asarray(e, np.float64)),
                                                 initial=0.0)))
                 for v, e in zip(source.weights, expected)]
    return sorted(found, key=lambda d: -d.float32), noise


def _fresh(settings):
    return {k: None if v is None else keras.saving.deserialize_keras_object(v)
            for k, v in settings.items()}


def _rows(x):
    return int(np.shape(tf.nest.flatten(x)[0])[0])


def _cast(a, dtype):
    a = np.asarray(a)
    return a.astype(dtype) if a.dtype.kind == "f" else a


@contextlib.contextmanager
def _floatx(dtype):
    """Keras' float type and default dtype policy set to `dtype` (losses and
    new layers compute in it), restored after."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    try:
        yield
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


def _as_dtype(config, dtype):
    """A layer config with every float32 dtype (policy or name) made `dtype`."""
    if isinstance(config, dict):
        out = {}
        for key, value in config.items():
            if key == "dtype" and value in ("float32", None) or (
                    key == "dtype" and isinstance(value, dict)
                    and value.get("config", {}).get("name") == "float32"):
                out[key] = dtype
            else:
                out[key] = _as_dtype(value, dtype)
        return out
    if isinstance(config, list):
        return [_as_dtype(v, dtype) for v in config]
    return config


def _copy(model, dtype, scale=1.0):
    """A copy of `model` with its weights (floats times `scale`), its layers
    computing in `dtype`."""
    def clone(layer):
        return type(layer).from_config(_as_dtype(layer.get_config(), dtype))
    copy = keras.models.clone_model(model, clone_function=clone, recursive=True)
    copy.set_weights([np.asarray(w).astype(dtype) * np.asarray(scale, dtype)
                      if np.asarray(w).dtype.kind == "f" else w for w in model.get_weights()])
    return copy


def _owners(model):
    """{id(variable): "Class 'name'"} of the innermost layer holding each."""
    found = {}
    for layer in _internal.flatten_layers(model):
        if layer is model:
            continue
        for v in layer.weights:
            found[id(v)] = f"{type(layer).__name__} {layer.name!r}"
    return found
