"""`PipelinedModel`: the Keras face of the pipeline.

`fit`, `evaluate` and `predict` work as for any Keras model; each step scatters
the batch into M micro-batches, runs the schedule on the stage devices (see
`tfpipe.engine`), and — in training — applies one optimizer update with the
gradients summed over micro-batches.

Exactness. With Keras' default loss reduction (`sum_over_batch_size`) the
step loss is `sum_m (r_m / N) * loss_m`, r_m real rows in micro-batch m of N:
exactly the full-batch loss. A partial last batch is padded to a multiple of
M and the padded rows are sliced off before the loss, so this holds for any
loss shape (per-token losses included). With
`reduction="sum"` it is `sum_m loss_m`. Weight regularisers and other
`layer.losses` are counted once per step. Metrics are updated once per
step on the gathered outputs of the real rows, so every metric (AUC and
unweighted metrics included) sees exactly what full-batch training shows it.
"""

import contextlib
import math

import keras
import numpy as np
import tensorflow as tf

from tfpipe import _internal
from tfpipe import engine
from tfpipe import loop
from tfpipe import microbatch
from tfpipe import partition
from tfpipe import placement
from tfpipe import recompute as recompute_lib
from tfpipe import schedules
from tfpipe import strategy as strategy_lib

_SUPPORTED_REDUCTIONS = {"sum_over_batch_size": False, "mean": False, "sum": True}


def _is_shape(value):
    return isinstance(value, (tuple, list, tf.TensorShape)) and all(
        d is None or isinstance(d, int) for d in value
    )


def _map_shapes(fn, shapes):
    if _is_shape(shapes):
        return fn(tuple(shapes))
    if isinstance(shapes, dict):
        return {k: _map_shapes(fn, v) for k, v in shapes.items()}
    if isinstance(shapes, (list, tuple)):
        return type(shapes)(_map_shapes(fn, v) for v in shapes)
    raise ValueError(f"input_shape must be a shape tuple or a nest of them, got {shapes!r}.")


def _keras_batch_size(batch_size, x):
    """The batch size Keras will use for `x`: batch_size, or 32 for arrays."""
    if batch_size is not None:
        return batch_size
    if x is None or isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)):
        return None
    if callable(getattr(x, "__next__", None)):
        return None  # a generator: batches come ready-made
    return 32


def _dataset_batch_size(x):
    if isinstance(x, tf.data.Dataset):
        for spec in tf.nest.flatten(x.element_spec):
            shape = getattr(spec, "shape", None)
            if shape is not None and shape.rank:
                return shape[0]
    return None


@keras.saving.register_keras_serializable(package="tfpipe")
class PipelinedModel(keras.Model):
    """A Keras model whose `stages` run as a pipeline on the strategy's devices.

    Args:
      stages: list of K Keras layers or models; stage k takes the output of
        stage k - 1. Pass them unbuilt: tfpipe builds each under its device.
      num_microbatches: M; default the strategy's.
      recompute: `"always"`, `"except_last"` or `"never"`; default the
        strategy's.
      input_shape: optional shape (batch dimension included, may be None) or
        nest of shapes; builds the model (places all variables) right away.
      input_dtype: dtype of the dummy batch used to build stages (default
        float32).
      execution: `"unrolled"` or `"loop"`; default the strategy's.
      **kwargs: passed to `keras.Model` (e.g. `name`).

    Create it under `tfpipe.PipelineStrategy(...).scope()`; outside any scope
    it makes a default `PipelineStrategy()` over all logical devices.

    >>> strategy = tfpipe.PipelineStrategy(num_microbatches=4)   # doctest: +SKIP
    >>> with strategy.scope():                                    # doctest: +SKIP
    ...     model = tfpipe.PipelinedModel(
    ...         [keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)],
    ...         input_shape=(None, 64))
    ...     model.compile(optimizer="adam", loss="mse")
    >>> model.fit(x, y, batch_size=32)                            # doctest: +SKIP
    """

    def __init__(self, stages, num_microbatches=None, recompute=None,
                 input_shape=None, input_dtype="float32", execution=None, **kwargs):
        strategy = strategy_lib.current_pipeline_strategy()
        if strategy is None and tf.distribute.has_strategy():
            raise ValueError(
                f"PipelinedModel must be created under a tfpipe.PipelineStrategy "
                f"scope, not {type(tf.distribute.get_strategy()).__name__}: other "
                f"strategies override the per-stage device placement."
            )
        strategy = strategy or strategy_lib.PipelineStrategy()
        super().__init__(**kwargs)
        self._distribute_strategy = strategy
        stages = self._validate_stages(stages, strategy)
        self.stages = stages
        # The D devices the schedule runs on; stage k lives on stage_devices[k].
        self.pipeline_devices, self.stage_devices = strategy.pipeline_devices(len(stages))
        self._num_microbatches_arg = num_microbatches
        self._recompute_arg = recompute
        self._execution_arg = execution
        self.num_microbatches = strategy_lib.validate_num_microbatches(
            strategy.num_microbatches if num_microbatches is None else num_microbatches
        )
        self.execution = strategy.execution if execution is None else execution
        self.recompute = recompute_lib.resolve(
            strategy._recompute_arg if recompute is None else recompute,  # pylint: disable=protected-access
            self.execution,
        )
        self.schedule = strategy.schedule
        # Validates the schedule for this (M, D) now, not at the first step.
        schedules.validate(self.schedule, self.num_microbatches, len(self.pipeline_devices))
        self._input_dtype = keras.backend.standardize_dtype(input_dtype)
        self._loss_is_sum = False
        pipeline_class = loop.LoopPipeline if self.execution == "loop" else engine.Pipeline
        self.pipeline = pipeline_class(
            self.stages, self.pipeline_devices, self.schedule, self.recompute
        )
        if input_shape is not None:
            self.build(input_shape)

    @staticmethod
    def _validate_stages(stages, strategy):
        if isinstance(stages, keras.layers.Layer) or not isinstance(stages, (list, tuple)):
            raise ValueError(
                f"stages must be a list of Keras layers (one per stage), got "
                f"{type(stages).__name__}. To cut one model use PipelinedModel.from_model."
            )
        stages = list(stages)
        if not stages:
            raise ValueError("stages is empty; a pipeline needs at least one stage.")
        for k, stage in enumerate(stages):
            if stage is None or (isinstance(stage, (list, tuple)) and not stage):
                raise ValueError(f"Stage {k} is empty; every stage needs at least one layer.")
            if not isinstance(stage, keras.layers.Layer):
                raise ValueError(
                    f"Stage {k} must be a Keras layer or model, got {type(stage).__name__}."
                )
            if isinstance(stage, keras.Sequential) and not stage.layers:
                raise ValueError(
                    f"Stage {k} ({stage.name!r}) is an empty Sequential; every stage "
                    f"needs at least one layer."
                )
        strategy.pipeline_devices(len(stages))  # raises if they do not fit
        return stages

    # -- construction ----------------------------------------------------

    @classmethod
    def from_model(cls, model, balance=None, batch_norm="deferred", sample=None, **kwargs):
        """Cuts a Sequential or functional model (any DAG) into pipeline stages.

        The model is read as units in topological order (`tfpipe.graph`): a
        Sequential's layers, or a functional model's layers and raw ops
        (`model.operations` without inputs; nested models inlined). Stage k
        takes the next `balance[k]` units; tensors needed by later stages
        (skip connections) are passed through the stages in between. Stage 0
        takes the model's inputs, the last stage returns its outputs.

        Args:
          model: a `keras.Sequential` or functional `keras.Model`. Its layers
            are cloned, built on the stage devices, and given the model's
            current weights; `model` itself is left unchanged. A layer called
            at several nodes (shared) raises ValueError.
          balance: unit counts per stage, e.g. `[3, 2, 2, 1]`; None or
            `"params"` balances parameter counts, `"time"` measured forward +
            backward time, `"memory"` measured activation + parameter bytes
            (see `tfpipe.partition`), over the strategy's `num_stages`.
          batch_norm: `"deferred"` (default) turns each
            `keras.layers.BatchNormalization` into
            `tfpipe.batchnorm.DeferredBatchNormalization`: micro-batches are
            normalised with their own statistics either way, but the moving
            mean and variance are updated once per step with the statistics of
            the whole mini-batch, as unpipelined training does, instead of M
            times with micro-batch statistics (`"plain"`). Deferred is the
            default because it keeps the moving statistics, and so
            evaluation and inference, closest to unpipelined training; for
            M = 1 both are plain Keras.
          sample: a batch of inputs for `balance="time"` or `"memory"`;
            default a random batch of 8 rows shaped like the model's inputs.
          **kwargs: passed to `PipelinedModel`.

        The result has `.balance` (the counts) and `.balance_method`
        (`"params"`, `"time"`, `"memory"` or `"explicit"`); `summary()` shows
        them.
        """
        from tfpipe import batchnorm  # pylint: disable=import-outside-toplevel
        from tfpipe import graph as graph_lib  # pylint: disable=import-outside-toplevel

        batchnorm.validate_mode(batch_norm)
        graph = graph_lib.model_graph(model)
        strategy = strategy_lib.current_pipeline_strategy() or strategy_lib.PipelineStrategy()
        balance, method = partition.choose_balance(graph, balance, strategy.num_stages, sample)
        stages, pairs = graph_lib.make_stages(
            graph, balance, lambda op: batchnorm.clone(op, batch_norm))
        if "input_shape" not in kwargs and graph.input_shape is not None:
            kwargs["input_shape"] = graph.input_shape
            kwargs.setdefault("input_dtype", graph.input_dtype)
        kwargs.setdefault("name", f"pipelined_{model.name}")
        with strategy.scope() if strategy_lib.current_pipeline_strategy() is None else contextlib.nullcontext():
            pipelined = cls(stages, **kwargs)
        if not pipelined.built:
            raise ValueError(
                f"from_model could not infer the input shape of {model.name!r}; "
                f"pass input_shape=(None, ...)."
            )
        graph_lib.copy_weights(pairs)
        batchnorm.set_num_microbatches(pipelined.stages, pipelined.num_microbatches)
        pipelined.balance = balance
        pipelined.balance_method = method
        return pipelined

    def build(self, input_shape):
        if _internal.in_keras_symbolic_build():
            raise ValueError(
                f"{self.name}: Keras tried to build the pipeline symbolically, which "
                f"would put every stage's variables on the default device. Build it "
                f"first: pass input_shape=(None, ...) to PipelinedModel, call "
                f"model.build(input_shape), or call fit/evaluate/predict with arrays "
                f"or a tf.data.Dataset (tfpipe builds from their shapes)."
            )
        self._built_input_shape = _map_shapes(list, input_shape)
        # Runs eagerly even when Keras builds symbolically inside a FuncGraph:
        # variables created there would land on the default device.
        with tf.init_scope(), self._scope():
            # Symbolic inputs keep the batch dimension None in every stage's
            # recorded shapes; the layers still build (create variables) eagerly,
            # under the device scope, before Keras' stateless symbolic call.
            h = _map_shapes(lambda s: keras.KerasTensor(s, dtype=self._input_dtype),
                            input_shape)
            for k, (stage, device) in enumerate(zip(self.stages, self.stage_devices)):
                if stage.built and stage.weights:
                    bad = placement.misplaced_variables(stage.weights, device)
                    if bad:
                        raise ValueError(
                            f"Stage {k} ({stage.name!r}) was built before PipelinedModel "
                            f"could place it on {device}: {bad[:3]}. Pass unbuilt layers, "
                            f"or use PipelinedModel.from_model(model), which copies weights."
                        )
                with tf.device(device):
                    h = stage(h, training=False)
                bad = placement.misplaced_variables(stage.weights, device)
                if bad:
                    raise RuntimeError(f"tfpipe placement bug: stage {k} variables {bad[:3]}.")
        self._build_optimizer()

    def _scope(self):
        if tf.distribute.get_strategy() is self._distribute_strategy:
            return contextlib.nullcontext()
        return self._distribute_strategy.scope()

    def _build_optimizer(self):
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or optimizer.built or not self.built:
            return
        # Eagerly, so that each slot is created next to its variable; Keras
        # would otherwise build it inside the first traced step, on CPU:0.
        with tf.init_scope(), self._scope():
            optimizer.build(self.trainable_variables)

    def call(self, inputs, training=None):
        """Runs the stages one after another on the whole batch (no pipelining)."""
        h = inputs
        for stage, device in zip(self.stages, self.stage_devices):
            with tf.device(device):
                h = stage(h, training=training)
        return h

    # -- Keras API -------------------------------------------------------

    def compile(self, *args, jit_compile="auto", **kwargs):
        """As `keras.Model.compile`; XLA is never applied to the whole step.

        A multi-device step must not be one XLA cluster (Keras' `"auto"` turns
        XLA on for GPU machines), so `jit_compile` is forced to False.
        """
        if jit_compile is True:
            raise ValueError(
                "PipelinedModel.compile(jit_compile=True) would compile the whole "
                "multi-device pipeline step as one XLA cluster on one device. Use "
                "jit_compile=False (or leave the default)."
            )
        with self._scope():
            super().compile(*args, jit_compile=False, **kwargs)
        reductions = _internal.compiled_loss_reductions(self)
        unsupported = [r for r in reductions if r not in _SUPPORTED_REDUCTIONS]
        kinds = {_SUPPORTED_REDUCTIONS[r] for r in reductions if r in _SUPPORTED_REDUCTIONS}
        if unsupported or len(kinds) > 1:
            raise ValueError(
                f"PipelinedModel adds per-micro-batch losses, which equals the "
                f"full-batch loss only when every compiled loss uses "
                f"reduction='sum_over_batch_size' (the Keras default) or every one "
                f"uses reduction='sum'; got {reductions}. Use one of those reductions."
            )
        self._loss_is_sum = kinds == {True}
        if self.optimizer is not None:
            _internal.adopt_optimizer(self.optimizer, self._distribute_strategy)
        self._build_optimizer()

    def _check_batch(self, batch_size, x, what):
        m = self.num_microbatches
        for size in (_keras_batch_size(batch_size, x), _dataset_batch_size(x)):
            if size is not None and size % m:
                fix = m * math.ceil(size / m)
                raise ValueError(
                    f"{what}: batch size {size} is not divisible by "
                    f"num_microbatches={m}. Use a batch size that is a multiple of "
                    f"{m} (e.g. {fix}) or a num_microbatches that divides {size}. "
                    f"(Only an epoch's smaller last batch may be ragged: tfpipe pads "
                    f"it and gives the padding zero weight.)"
                )

    def _build_from_data(self, x):
        """Builds eagerly from the shapes and dtypes of `x` (arrays or dataset)."""
        if self.built or x is None:
            return
        if isinstance(x, tf.data.Dataset):
            spec = x.element_spec
            features = spec[0] if isinstance(spec, tuple) else spec
            leaves = tf.nest.flatten(features)
            shapes = tf.nest.map_structure(lambda s: tuple(s.shape), features)
        elif isinstance(x, keras.utils.PyDataset) or callable(getattr(x, "__next__", None)):
            return  # batches only known when iterated; build() explains the fix
        else:
            leaves = tf.nest.flatten(x)
            shapes = tf.nest.map_structure(lambda a: (None,) + tuple(np.shape(a))[1:], x)
        if leaves:
            self._input_dtype = keras.backend.standardize_dtype(leaves[0].dtype)
        self.build(shapes)

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        self._check_batch(batch_size, x, "fit")
        self._build_from_data(x)
        validation_data = kwargs.get("validation_data")
        if validation_data is not None:
            vx = validation_data if isinstance(validation_data, tf.data.Dataset) else validation_data[0]
            self._check_batch(kwargs.get("validation_batch_size") or batch_size, vx, "fit validation")
        return super().fit(x, y, batch_size, *args, **kwargs)

    def evaluate(self, x=None, y=None, batch_size=None, *args, **kwargs):
        self._check_batch(batch_size, x, "evaluate")
        self._build_from_data(x)
        return super().evaluate(x, y, batch_size, *args, **kwargs)

    def predict(self, x, batch_size=None, *args, **kwargs):
        self._check_batch(batch_size, x, "predict")
        self._build_from_data(x)
        return super().predict(x, batch_size, *args, **kwargs)

    def compute_microbatch_loss(self, x, y, y_pred, sample_weight):
        """Data loss of one micro-batch; override instead of `compute_loss`.

        Default: the loss given to `compile`, with its own reduction. Stage
        losses (`layer.losses`, e.g. regularisers) are added by the engine.
        """
        del x
        if self._compile_loss is None:
            return tf.zeros(())
        return self._compile_loss(y, y_pred, sample_weight)

    def _scatter(self, data, stacked=None):
        """A `_Step`; micro-batches stacked (loop form) or a list (unrolled)."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        scatter = microbatch.Scatter(x, self.num_microbatches)
        stacked = self.execution == "loop" if stacked is None else stacked
        cut = scatter.stack if stacked else scatter.split
        return _Step(x, y, sample_weight, scatter, cut(x), cut(y), cut(sample_weight))

    def _merge(self, scatter, y_preds):
        """The real rows of the last stage's outputs (list of M, or stacked)."""
        with tf.device(self.stage_devices[-1]):
            if self.execution == "loop":
                return scatter.unstack(y_preds)
            return scatter.merge(y_preds)

    def _update_metrics(self, step, y_preds, loss):
        # Once, on the gathered real rows: identical to a full-batch update for
        # every metric (AUC and unweighted metrics included, which per-micro-
        # batch updates with zero-weight padding would get wrong).
        self._loss_tracker.update_state(loss, sample_weight=step.scatter.real_size)
        y_pred = self._merge(step.scatter, y_preds)
        return self.compute_metrics(step.x, step.y, y_pred, sample_weight=step.sample_weight)

    def _loss_fn(self, step):
        """`loss_fn(m, y_pred_m)`: micro-batch m's share of the full-batch data loss.

        With reduction "sum_over_batch_size" the compiled loss is a mean, so
        micro-batch m, with r_m real rows of N, is weighted r_m / N; with
        "sum" it is weighted 1. Padded rows (a ragged batch) are sliced off
        before the loss, so they count nowhere, whatever the loss's shape.
        """
        scatter = step.scatter

        def loss_fn(m, y_pred):
            x, y, sw = step.micro(m)
            if not scatter.needs_padding:
                loss = self.compute_microbatch_loss(x, y, y_pred, sw)
                weight = 1.0 if self._loss_is_sum else 1.0 / self.num_microbatches
                return weight * tf.cast(loss, tf.float32)
            rows = scatter.real_rows(m)
            # At least one row, so an all-padding micro-batch gives a finite
            # loss; its weight is 0.
            keep = tf.maximum(rows, 1)
            cut = lambda s: None if s is None else tf.nest.map_structure(  # noqa: E731
                lambda t: t[:keep], s)
            loss = tf.cast(self.compute_microbatch_loss(cut(x), cut(y), cut(y_pred), cut(sw)),
                           tf.float32)
            if self._loss_is_sum:
                return tf.where(rows > 0, loss, 0.0)
            return tf.cast(rows, tf.float32) / scatter.real_size * loss

        return loss_fn

    def train_step(self, data):
        step = self._scatter(data)
        scale = self.optimizer.scale_loss if self.optimizer is not None else None
        if self.execution == "loop":
            y_preds, loss, grads = self.pipeline.train(
                step.xs, self.num_microbatches, self._loss_fn(step), 1.0, scale)
        else:
            y_preds, loss, grads = self.pipeline.train(
                step.xs, self._loss_fn(step), 1.0, scale)
        pairs = [
            (g, v)
            for stage, stage_grads in zip(self.stages, grads)
            for g, v in zip(stage_grads, stage.trainable_variables)
        ]
        if pairs:
            self.optimizer.apply_gradients(pairs)
        return self._update_metrics(step, y_preds, loss)

    def test_step(self, data):
        step = self._scatter(data)
        loss_fn = self._loss_fn(step)
        if self.execution == "loop":
            y_preds, extra = self.pipeline.forward(step.xs, self.num_microbatches)
            terms = [extra]
            pick = lambda m: tf.nest.map_structure(lambda t: t[m], y_preds)  # noqa: E731
        else:
            y_preds, extras = self.pipeline.forward(step.xs, training=False)
            terms = [e / self.num_microbatches for e in extras if e is not None]
            pick = lambda m: y_preds[m]  # noqa: E731
        with tf.device(self.stage_devices[-1]):
            for m in range(self.num_microbatches):
                terms.append(loss_fn(m, pick(m)))
        return self._update_metrics(step, y_preds, tf.add_n(terms))

    def predict_step(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        scatter = microbatch.Scatter(x, self.num_microbatches)
        if self.execution == "loop":
            y_preds, _ = self.pipeline.forward(scatter.stack(x), self.num_microbatches)
        else:
            y_preds, _ = self.pipeline.forward(scatter.split(x), training=False)
        return self._merge(scatter, y_preds)

    # -- description and serialisation ----------------------------------

    def pipeline_summary(self):
        """A text table of stages: device, layer count, parameter count."""
        k = len(self.stages)
        sim = schedules.simulate(self.schedule, self.num_microbatches,
                                 len(self.pipeline_devices))
        lines = [
            f"Pipeline: {k} stage(s) on {len(self.pipeline_devices)} device(s) x "
            f"{self.num_microbatches} micro-batch(es), schedule={self.schedule.name}, "
            f"recompute={self.recompute}, simulated bubble={sim.bubble_fraction:.1%}, "
            f"peak live activations per device={sim.peak_activations}",
            f"{'stage':<7}{'name':<24}{'device':<46}{'layers':>7}{'params':>12}",
        ]
        for i, (stage, device) in enumerate(zip(self.stages, self.stage_devices)):
            n_layers = len(stage.layers) if hasattr(stage, "layers") else 1
            params = stage.count_params() if stage.built else 0
            lines.append(f"{i:<7}{stage.name:<24}{device:<46}{n_layers:>7}{params:>12,}")
        lines.extend(self._balance_lines())
        return "\n".join(lines)

    def _balance_lines(self):
        """How `from_model` balanced the stages (nothing for hand-made stages)."""
        balance = getattr(self, "balance", None)
        if balance is None:
            return []
        method = getattr(self, "balance_method", "explicit")
        how = "as given to from_model" if method == "explicit" else f"from_model, by {method}"
        return [f"Balance: {list(balance)} units per stage ({how})"]

    def summary(self, *args, print_fn=None, **kwargs):
        """Keras' summary, then the stage table (`pipeline_summary`)."""
        super().summary(*args, print_fn=print_fn, **kwargs)
        (print_fn or print)(self.pipeline_summary())

    def get_config(self):
        return {
            "name": self.name,
            "stages": [keras.saving.serialize_keras_object(s) for s in self.stages],
            "num_microbatches": self._num_microbatches_arg,
            "recompute": self._recompute_arg,
            "execution": self._execution_arg,
            "input_dtype": self._input_dtype,
        }

    def get_build_config(self):
        if not self.built:
            return None
        return {"input_shape": self._built_input_shape, "input_dtype": self._input_dtype}

    def build_from_config(self, config):
        if config and not self.built:
            self._input_dtype = config.get("input_dtype", self._input_dtype)
            self.build(config["input_shape"])

    def compile_from_config(self, config):
        # Keras skips this for models that override compile(); ours only adds
        # checks, so restoring the saved compile arguments is safe.
        config = keras.saving.deserialize_keras_object(config)
        config.pop("jit_compile", None)
        self.compile(**config)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        strategy = strategy_lib.current_pipeline_strategy() or strategy_lib.PipelineStrategy()
        stage_configs = config.pop("stages")
        try:
            devices = strategy.pipeline_devices(len(stage_configs))[1]
        except ValueError:
            devices = ()  # __init__ below raises the same error, with context
        stages = []
        for k, stage_config in enumerate(stage_configs):
            # A deserialised Sequential builds itself: do it on its device.
            with tf.device(devices[k]) if k < len(devices) else contextlib.nullcontext():
                stages.append(keras.saving.deserialize_keras_object(
                    stage_config, custom_objects=custom_objects))
        return cls(stages=stages, **config)


class _Step:
    """One batch and its micro-batches.

    xs, ys, sws: lists of M structures (unrolled) or structures of (M, b, ...)
    tensors (loop form); `micro(m)` picks micro-batch m either way (m a Python
    int or a scalar int32 tensor).
    """

    def __init__(self, x, y, sample_weight, scatter, xs, ys, sws):
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.scatter, self.xs, self.ys, self.sws = scatter, xs, ys, sws

    def micro(self, m):
        """(x, y, sample_weight) of micro-batch m."""
        if isinstance(self.xs, list):
            return self.xs[m], self.ys[m], self.sws[m]

        def pick(structure):
            if structure is None:
                return None
            return tf.nest.map_structure(lambda t: tf.gather(t, m), structure)

        return pick(self.xs), pick(self.ys), pick(self.sws)
