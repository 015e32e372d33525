"""A `PipelinedModel`'s Keras entry points: what each checks before Keras runs.

`KerasCalls` is a mixin of `tfpipe.model.PipelinedModel` (the Keras face):
`fit`, `evaluate`, `predict` and the `*_on_batch` calls check their inputs
(`tfpipe.inputs`), build the model from the data's shapes and keep the first
batch for the checks that need values; the step functions Keras makes run
and trace in the execution's call scope (`tfpipe.engine.in_call_scope`).
"""

from tfpipe import _internal
from tfpipe import engine
from tfpipe import inputs as inputs_lib


class KerasCalls:
    """Keras' entry points of a `PipelinedModel` (see the module docstring)."""

    def check_batch_size(self, x, batch_size, what):
        """Refuses batches of `x` that `tfpipe.inputs.check_batch` refuses."""
        static_for = self._pipeline_strategy.static_batch_reason
        if static_for is None and (self.pipeline_config.traits.in_loop
                                   and _internal.jit_compile(self) is True):
            static_for = "execution='loop' under jit_compile=True"
        inputs_lib.check_batch(x, batch_size, what, self.num_microbatches,
                               self._pipeline_strategy.num_replicas, static_for)

    def _check_call(self, x, y, batch_size, what):
        """Every Keras entry point's checks, then the build from the data's shapes."""
        strategy = self._pipeline_strategy
        inputs_lib.check_replicated_inputs(x, what, strategy.num_replicas)
        inputs_lib.check_scope(what, strategy)
        if self._source is None:
            inputs_lib.check_dict_for_one_input(x, what,
                                                getattr(self, "_built_input_shape", None))
        if what != "predict":
            inputs_lib.check_labels(x, y, what, _internal.compiled_loss(self) is not None)
        inputs_lib.check_batched(x, what, getattr(self, "_built_input_shape", None))
        self.check_batch_size(x, batch_size, what)
        spec = None if self.built else inputs_lib.input_spec(x)
        if spec is not None:
            shapes, dtype = spec
            if dtype is not None:
                self._input_dtype = dtype
            self.build(shapes)

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        self._check_call(x, y, batch_size, "fit")
        x, self._first_batch = inputs_lib.first_batch(x, y, kwargs.get("sample_weight"),
                                                      batch_size)
        validation = inputs_lib.validation_inputs(kwargs.get("validation_data"))
        if validation is not None:
            self.check_batch_size(validation, kwargs.get("validation_batch_size") or batch_size,
                                  "fit validation")
        return super().fit(x, y, batch_size, *args, **kwargs)

    def evaluate(self, x=None, y=None, batch_size=None, *args, **kwargs):
        self._check_call(x, y, batch_size, "evaluate")
        x, self._first_batch = inputs_lib.first_batch(x, y, kwargs.get("sample_weight"),
                                                      batch_size)
        return super().evaluate(x, y, batch_size, *args, **kwargs)

    def train_on_batch(self, x, y=None, sample_weight=None, *args, **kwargs):
        self._first_batch = lambda: (x, y, sample_weight)
        return super().train_on_batch(x, y, sample_weight, *args, **kwargs)

    def test_on_batch(self, x, y=None, sample_weight=None, *args, **kwargs):
        self._first_batch = lambda: (x, y, sample_weight)
        return super().test_on_batch(x, y, sample_weight, *args, **kwargs)

    def predict(self, x, batch_size=None, *args, **kwargs):
        inputs_lib.check_not_empty_for_predict(x)
        self._check_call(x, None, batch_size, "predict")
        return super().predict(x, batch_size, *args, **kwargs)

    # Each step function Keras makes runs (and traces) in the execution's call scope.
    def make_train_function(self, force=False):
        if self.pipeline_config.recompute_pending and self._first_batch:
            self._choose_recompute()
        super().make_train_function(force)
        self.train_function = engine.in_call_scope(self.train_function, self.pipeline_config)
        return self.train_function

    def make_test_function(self, force=False):
        super().make_test_function(force)
        self.test_function = engine.in_call_scope(self.test_function, self.pipeline_config)
        return self.test_function

    def make_predict_function(self, force=False):
        super().make_predict_function(force)
        self.predict_function = engine.in_call_scope(self.predict_function,
                                                     self.pipeline_config)
        return self.predict_function
