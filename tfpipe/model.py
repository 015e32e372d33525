"""`PipelinedModel`: the Keras face of the pipeline.

`fit`, `evaluate` and `predict` work as for any Keras model; each step cuts
the batch into M micro-batches (`tfpipe.microbatch`), runs the schedule on the
stage devices (`tfpipe.engine`, or `tfpipe.loop`), and — in training —
applies one optimizer update with the gradients summed over micro-batches.

Exactness. The compiled loss is split over micro-batches exactly as Keras
reduces it over the batch (`tfpipe.loss`: masks, `ignore_class`, sample
weights, every reduction), the last stage's backward starts from the loss
itself (so softmax/sigmoid heads with Keras' default crossentropy train, as in
Keras), weight regularisers are counted once per step, and metrics are
updated once per step on the whole batch's outputs (Keras masks and logits
attached), so every metric sees exactly what full-batch training shows it.
A trainable variable that gets no gradient raises a `ValueError` (Keras
would only warn and leave it unchanged).

`from_model` keeps the user's own layers: nothing is cloned; each variable's
storage moves to its stage's device (`tfpipe.placement.place_variables`).
"""

import contextlib
import functools

import keras
import numpy as np
import tensorflow as tf

from tfpipe import _internal
from tfpipe import batchnorm
from tfpipe import config as config_lib
from tfpipe import devices as devices_lib
from tfpipe import engine
from tfpipe import layout
from tfpipe import loss as loss_lib
from tfpipe import microbatch
from tfpipe import partition
from tfpipe import placement
from tfpipe import replicas
from tfpipe import runtime
from tfpipe import schedules
from tfpipe import strategy as strategy_lib
from tfpipe import xla


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


class _Source:
    """Holds the model `from_model` cut, out of Keras' layer tracking (it
    is not a sub-layer of the pipeline: its layers are, through the stages)."""

    def __init__(self, model, graph, balance, method):
        self.model, self.graph, self.balance, self.method = model, graph, balance, method


def _host_device():
    cpus = placement.available_devices("CPU")
    return cpus[0] if cpus else None


@keras.saving.register_keras_serializable(package="tfpipe")
class PipelinedModel(keras.Model):
    """A Keras model whose `stages` run as a pipeline on the strategy's devices.

    Args:
      stages: list of K Keras layers or models; stage k takes the output of
        stage k - 1. Unbuilt layers are built under their stage's device;
        built ones have their variables moved there.
      num_microbatches, schedule, recompute, execution, batch_norm: the
        pipeline's settings (`tfpipe.config.PipelineConfig`); each None takes
        the `PipelineStrategy`'s.
      input_shape: optional shape (batch dimension included, may be None) or
        nest of shapes; builds the model (places all variables) right away.
      input_dtype: dtype of the dummy batch used to build stages (default
        float32).
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
                 input_shape=None, input_dtype="float32", execution=None, schedule=None,
                 batch_norm=None, **kwargs):
        strategy = strategy_lib.current_pipeline_strategy()
        if strategy is None and tf.distribute.has_strategy():
            raise ValueError(
                f"PipelinedModel must be created under a tfpipe.PipelineStrategy "
                f"scope, not {type(tf.distribute.get_strategy()).__name__}: other "
                f"strategies override the per-stage device placement."
            )
        strategy = strategy or strategy_lib.PipelineStrategy()
        source = kwargs.pop("_source", None)
        super().__init__(**kwargs)
        # Inputs reach the stages as given (a functional model's do too); each
        # stage converts what it takes.
        _internal.keep_input_types(self)
        self._distribute_strategy = strategy
        self._source = source
        if source is not None and hasattr(source.model, "output_names"):
            self.output_names = list(source.model.output_names)
        stages = self._validate_stages(stages)
        # What Keras and tf.train.Checkpoint track (and list as `layers`): the
        # user's model when `from_model` cut it, so weights files and
        # checkpoints are keyed by its layers, whatever the stage layout
        # (`tfpipe.layout`); hand-made stages otherwise. The stage list itself
        # sits in an untracked holder.
        self._stage_holder = _StageList(stages)
        if source is None:
            self._tracked_stages = stages
        else:
            self._user_model = source.model
        self._input_dtype = keras.backend.standardize_dtype(input_dtype)
        self._configure(config_lib.merge(strategy.given_settings, dict(
            num_microbatches=num_microbatches, schedule=schedule, recompute=recompute,
            execution=execution, batch_norm=batch_norm)))
        if input_shape is not None:
            self.build(input_shape)

    @staticmethod
    def _validate_stages(stages):
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
        return stages

    # -- the pipeline's configuration ------------------------------------

    def _configure(self, config):
        """Makes `config` the model's configuration (the one owner of M,
        the schedule, recompute, execution and the BatchNorm mode)."""
        strategy = self._distribute_strategy
        devices, stage_devices = strategy.pipeline_devices(len(self.stages), config.schedule)
        # Validates the schedule for this (M, D) now, not at the first step.
        schedules.validate(config.schedule, config.num_microbatches, len(devices))
        self._pipeline_config = config
        # The D devices the schedule runs on; stage k lives on stage_devices[k].
        self.pipeline_devices, self.stage_devices = devices, stage_devices
        # One pipeline per data-parallel replica (row of the device grid),
        # all running the same stages; replica 0's is `self.pipeline`.
        self.replica_pipelines = [
            engine.Pipeline(self.stages, strategy.pipeline_devices(
                len(self.stages), config.schedule, replica=r)[0], config)
            for r in range(len(strategy.device_grid))]
        self.pipeline = self.replica_pipelines[0]
        if self.built:
            batchnorm.check_layers(self.stages, config.batch_norm,
                                  self._distribute_strategy.num_replicas)
        # Steps traced for the old configuration must not be reused.
        self.train_function = self.test_function = self.predict_function = None

    @property
    def stages(self):
        """The K stage layers; stage k runs on `stage_devices[k]`."""
        return self._stage_holder.stages

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # What tf.train.Checkpoint saves (Keras 3 would list no children here:
        # the variables would be saved only through an optimizer, and
        # non-trainable ones not at all). A cut model has exactly its source
        # model's children, so its checkpoints are keyed as the plain Keras
        # model's are, whatever the stage layout.
        if save_type != "checkpoint":
            return super()._trackable_children(save_type, **kwargs)
        if self._source is not None:
            return self._source.model._trackable_children(save_type, **kwargs)  # pylint: disable=protected-access
        return {f"stage_{k}": s for k, s in enumerate(self.stages)}

    @property
    def pipeline_config(self):
        """The `tfpipe.config.PipelineConfig` this model runs with."""
        return self._pipeline_config

    @property
    def num_microbatches(self):
        return self._pipeline_config.num_microbatches

    @property
    def schedule(self):
        return self._pipeline_config.schedule

    @property
    def recompute(self):
        return self._pipeline_config.recompute

    @property
    def execution(self):
        return self._pipeline_config.execution

    @property
    def batch_norm(self):
        return self._pipeline_config.batch_norm

    @property
    def balance(self):
        """Units per stage as `from_model` cut them (None for hand-made stages)."""
        return None if self._source is None else list(self._source.balance)

    @property
    def balance_method(self):
        return None if self._source is None else self._source.method

    @property
    def source_model(self):
        """The Keras model `from_model` cut (its layers are the stages' layers)."""
        return None if self._source is None else self._source.model

    # -- construction ----------------------------------------------------

    @classmethod
    def from_model(cls, model, balance=None, sample=None, **kwargs):
        """Cuts a Sequential or functional model (any DAG) into pipeline stages.

        The model is read as units in topological order (`tfpipe.graph`): a
        Sequential's layers, or a functional model's layer calls and raw ops
        (nested models inlined). Stage k takes the next `balance[k]` units;
        tensors needed by later stages (skip connections) are passed through
        the stages in between. Stage 0 takes the model's inputs, the last
        stage returns its outputs.

        Nothing is copied: the stages call `model`'s own layers, so custom
        layers, `Lambda`s, adapted preprocessing layers, wrappers, nested
        models and shared layers (called at several places, in one stage or
        several) all stay as they are. Each variable's storage is moved to the
        device of the first stage that uses it; training the pipeline trains
        `model` too (`model` and the pipeline share every variable). A model
        too large for one accelerator can be built under
        `tf.device("/CPU:0")` first.

        Args:
          model: a `keras.Sequential` or functional `keras.Model`.
          balance: unit counts per stage, e.g. `[3, 2, 2, 1]`; None or
            `"params"` balances parameter counts, `"time"` measured forward +
            backward time, `"memory"` measured activation + parameter bytes
            (see `tfpipe.partition`), over as many stages as the strategy
            can place.
          sample: a batch of inputs for `balance="time"` or `"memory"`;
            default a random batch of 8 rows shaped like the model's inputs.
          **kwargs: passed to `PipelinedModel` (`num_microbatches`,
            `schedule`, `recompute`, `execution`, `batch_norm` — default
            "deferred", see `tfpipe.batchnorm` —, `name`, ...).

        The result has `.balance` (the counts) and `.balance_method`
        (`"params"`, `"time"`, `"memory"` or `"explicit"`); `summary()` shows
        them.
        """
        from tfpipe import graph as graph_lib  # pylint: disable=import-outside-toplevel

        if kwargs.get("batch_norm") is not None:
            batchnorm.validate_mode(kwargs["batch_norm"])
        graph = graph_lib.model_graph(model)
        in_scope = strategy_lib.current_pipeline_strategy()
        strategy = in_scope or strategy_lib.PipelineStrategy()
        schedule = schedules.get(kwargs.get("schedule") or strategy.schedule)
        balance, method = partition.choose_balance(graph, balance, strategy.max_stages(schedule),
                                                   sample)
        stages = graph_lib.make_stages(graph, balance)
        if "input_shape" not in kwargs and graph.input_shape is not None:
            kwargs["input_shape"] = graph.input_shape
            kwargs.setdefault("input_dtype", graph.input_dtype)
        kwargs.setdefault("name", f"pipelined_{model.name}")
        with strategy.scope() if in_scope is None else contextlib.nullcontext():
            pipelined = cls(stages, _source=_Source(model, graph, balance, method), **kwargs)
        if not pipelined.built:
            raise ValueError(
                f"from_model could not infer the input shape of {model.name!r}; "
                f"pass input_shape=(None, ...)."
            )
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
            # recorded shapes; unbuilt layers still build (create variables)
            # eagerly, under their stage's device.
            if self._source is not None and not self._source.graph.sequential:
                # The model's own inputs: they say which are sparse or ragged.
                h = self._source.model.input
            else:
                h = _map_shapes(lambda s: keras.KerasTensor(s, dtype=self._input_dtype),
                                input_shape)
            outputs = []  # each stage's symbolic output, for pipeline_summary
            for k, (stage, device) in enumerate(zip(self.stages, self.stage_devices)):
                with devices_lib.scope(device):
                    try:
                        h_next = stage(h, training=False)
                    except (ValueError, TypeError) as err:
                        if k == 0:
                            raise
                        raise ValueError(
                            f"Stage {k} ({stage.name!r}) cannot take the output of stage "
                            f"{k - 1} ({self.stages[k - 1].name!r}): {_describe(h)}. Make "
                            f"stage {k} accept that (or change the cut). Keras said: "
                            f"{err}") from err
                    h = h_next
                    outputs.append(h)
            # Stage k's column: its device in each data-parallel replica.
            columns = [[p.devices[p.stage_device[k]] for p in self.replica_pipelines]
                       for k in range(len(self.stages))]
            if len(self.replica_pipelines) == 1:
                columns = list(self.stage_devices)
            placement.place_variables(self.stages, columns)
            for k, stage in enumerate(self.stages):
                own = [v for v in stage.variables
                       if not any(v is w for s in self.stages[:k] for w in s.variables)]
                bad = placement.misplaced_variables(own, columns[k])
                if bad:
                    raise RuntimeError(f"tfpipe placement bug: stage {k} variables {bad[:3]}.")
            batchnorm.check_layers(self.stages, self.batch_norm,
                                  self._distribute_strategy.num_replicas)
            self._stage_outputs = outputs
        if self._source is not None:
            # Its traced functions (if any) hold the variables' old storage.
            _internal.reset_compiled_functions(self._source.model)
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
            # In the order of `trainable_variables` (the user's model's when it
            # was cut), so slot i is the same variable's at any stage layout.
            optimizer.build(self._optimizer_variables())

    def _optimizer_variables(self):
        own = {id(v) for v in self.pipeline.variables}
        ordered = [v for v in self.trainable_variables if id(v) in own]
        if len(ordered) != len(own):
            raise RuntimeError(
                f"tfpipe bug: the pipeline trains {len(own)} variables but the model "
                f"tracks {len(ordered)} of them.")
        return ordered

    def compute_output_spec(self, inputs, training=None):
        if self._source is None:
            return super().compute_output_spec(inputs, training=training)
        # The shapes the model recorded (GraphStage.compute_output_spec):
        # tracing the layers on dense placeholders breaks on ragged inputs.
        h = inputs
        for stage in self.stages:
            h = stage.compute_output_spec(h, training=training)
        return h

    def call(self, inputs, training=None):
        """Runs the stages one after another on the whole batch (no pipelining)."""
        if self._source is not None and _internal.in_keras_symbolic_scope():
            # Keras' symbolic build of a built model wants only the outputs'
            # shapes: the recorded ones (its dense placeholders would break a
            # layer that takes a ragged input).
            return tf.nest.map_structure(
                lambda s: tf.compat.v1.placeholder(s.dtype, s.shape),
                self.compute_output_spec(inputs, training=training))
        inputs = tf.nest.map_structure(
            lambda t: tf.convert_to_tensor(t) if isinstance(t, np.ndarray) else t, inputs)
        h = inputs if self._source is None else self._source.graph.standardize_inputs(inputs)
        for stage, device in zip(self.stages, self.stage_devices):
            with devices_lib.scope(device):
                h = stage(h, training=training)
        return h

    # -- Keras API -------------------------------------------------------

    def compile(self, *args, jit_compile="auto", **kwargs):
        """As `keras.Model.compile`. `jit_compile=True` compiles the whole step
        as one XLA program; it is accepted when every stage sits on one device
        and refused for several (`tfpipe.xla.check_jit_compile`). Keras'
        `"auto"` (XLA on GPU machines) is turned into False: a multi-device
        step must not be one XLA cluster.
        """
        jit = jit_compile is True
        if jit:
            xla.check_jit_compile(self.pipeline_devices)
        with self._scope():
            super().compile(*args, jit_compile=jit, **kwargs)
        if self.optimizer is not None:
            _internal.adopt_optimizer(self.optimizer, self._distribute_strategy)
        self._build_optimizer()

    def _check_batch(self, batch_size, x, what):
        m, r = self.num_microbatches, self._distribute_strategy.num_replicas
        if self.execution == "loop" and getattr(self, "_jit_compile", None) is True:
            xla.check_static_batch(x, batch_size, m, what,
                                   "execution='loop' under jit_compile=True")
        for size in (_keras_batch_size(batch_size, x), _dataset_batch_size(x)):
            if size is not None and r > 1 and size < m * r:
                raise ValueError(
                    f"{what}: batch size {size} is split over num_replicas={r} "
                    f"data-parallel replicas of num_microbatches={m} micro-batches each, "
                    f"so some micro-batches would be empty. Use a global batch size of "
                    f"at least {m * r} (a multiple of {m * r} keeps every micro-batch "
                    f"the same size).")
            if size is not None and size < m:
                raise ValueError(
                    f"{what}: batch size {size} is smaller than num_microbatches={m}, "
                    f"so {m - size} micro-batch(es) of every batch would be empty. Use a "
                    f"batch size of at least {m} (a multiple of {m} keeps every "
                    f"micro-batch the same size) or num_microbatches <= {size}."
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

    def _check_labels(self, x, y, what):
        arrays = not (x is None or isinstance(x, (tf.data.Dataset, keras.utils.PyDataset))
                      or callable(getattr(x, "__next__", None)))
        if arrays and y is None and getattr(self, "_compile_loss", None) is not None:
            raise ValueError(
                f"{what}: the model was compiled with a loss but the data has no labels "
                f"(y=None). Pass y, or compile without a loss.")

    def _check_call(self, x, what):
        """Refuses what Keras would report without naming the fix: a call under
        another strategy's scope, a dict fed to hand-made stages built for
        one unnamed input, inputs Keras cannot split over replicas."""
        self._check_replicated_inputs(x, what)
        if tf.distribute.has_strategy() and (
                tf.distribute.get_strategy() is not self._distribute_strategy):
            raise ValueError(
                f"{what}: called under {type(tf.distribute.get_strategy()).__name__}'s "
                f"scope, but this model belongs to its own tfpipe.PipelineStrategy "
                f"({self._distribute_strategy.num_stages} stages); call it outside any "
                f"strategy scope or inside that one.")
        built = getattr(self, "_built_input_shape", None)
        if (isinstance(x, dict) and self._source is None and built is not None
                and not isinstance(built, dict)):
            raise ValueError(
                f"{what}: x is a dict (keys {sorted(x)}) but the pipeline takes one input "
                f"of shape {tuple(built)}; pass the array, or use "
                f"PipelinedModel.from_model with keras.Inputs of those names.")

    def _check_replicated_inputs(self, x, what):
        """With several replicas Keras reduces the first distributed batch to
        build metrics, which fails deep in TensorFlow on strings, SparseTensors
        and RaggedTensors; say so up front."""
        if self._distribute_strategy.num_replicas == 1 or x is None:
            return
        if isinstance(x, tf.data.Dataset):
            leaves = tf.nest.flatten(x.element_spec)
        elif isinstance(x, keras.utils.PyDataset) or callable(getattr(x, "__next__", None)):
            return
        else:
            leaves = tf.nest.flatten(x)
        for leaf in leaves:
            kind = None
            if isinstance(leaf, (tf.SparseTensor, tf.SparseTensorSpec)):
                kind = "a tf.SparseTensor"
            elif isinstance(leaf, (tf.RaggedTensor, tf.RaggedTensorSpec)):
                kind = "a tf.RaggedTensor"
            elif (leaf.dtype.kind in "OSU" if isinstance(leaf, np.ndarray)
                  else isinstance(leaf, (tf.Tensor, tf.TensorSpec)) and leaf.dtype == tf.string):
                kind = "strings"
            if kind:
                raise ValueError(
                    f"{what}: an input is {kind}, which Keras cannot split over the "
                    f"strategy's num_replicas={self._distribute_strategy.num_replicas} "
                    f"data-parallel replicas. Use one replica (num_replicas=1), or turn "
                    f"it into a dense numeric tensor in the input pipeline (e.g. "
                    f"tf.data .map with the preprocessing layer, tf.sparse.to_dense, "
                    f"RaggedTensor.to_tensor).")

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        self._check_call(x, "fit")
        self._check_labels(x, y, "fit")
        self._check_batch(batch_size, x, "fit")
        self._build_from_data(x)
        validation_data = kwargs.get("validation_data")
        if validation_data is not None:
            vx = validation_data if isinstance(validation_data, tf.data.Dataset) else validation_data[0]
            self._check_batch(kwargs.get("validation_batch_size") or batch_size, vx, "fit validation")
        return super().fit(x, y, batch_size, *args, **kwargs)

    def evaluate(self, x=None, y=None, batch_size=None, *args, **kwargs):
        self._check_call(x, "evaluate")
        self._check_labels(x, y, "evaluate")
        self._check_batch(batch_size, x, "evaluate")
        self._build_from_data(x)
        return super().evaluate(x, y, batch_size, *args, **kwargs)

    def predict(self, x, batch_size=None, *args, **kwargs):
        self._check_call(x, "predict")
        self._check_batch(batch_size, x, "predict")
        self._build_from_data(x)
        return super().predict(x, batch_size, *args, **kwargs)

    # Keras calls the function these make once per step (or per
    # steps_per_execution); each call, and the trace the first one starts,
    # runs in the execution's `runtime.call_scope`.

    def make_train_function(self, force=False):
        super().make_train_function(force)
        self.train_function = self._in_call_scope(self.train_function)
        return self.train_function

    def make_test_function(self, force=False):
        super().make_test_function(force)
        self.test_function = self._in_call_scope(self.test_function)
        return self.test_function

    def make_predict_function(self, force=False):
        super().make_predict_function(force)
        self.predict_function = self._in_call_scope(self.predict_function)
        return self.predict_function

    def _in_call_scope(self, function):
        if (function is None or self.execution != "stage_functions"
                or getattr(function, "_tfpipe_call_scope", False)):
            return function

        @functools.wraps(function)
        def call(*args, **kwargs):
            with runtime.call_scope(self.execution):
                return function(*args, **kwargs)
        call._tfpipe_call_scope = True  # pylint: disable=protected-access
        return call

    def _batch(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if self._source is not None:
            x = self._source.graph.standardize_inputs(x)
        return microbatch.Batch(x, y, sample_weight, self.num_microbatches)

    def _update_metrics(self, batch, y_pred, loss, split, term_values):
        # Once, on the whole batch's outputs: identical to a full-batch update
        # for every metric (AUC and unweighted metrics included). With
        # data-parallel replicas `loss` and `term_values` are this replica's
        # shares of the global batch's: the trackers record the global values
        # weighted by this replica's rows, so they sum to plain Keras' update.
        loss, term_values = replicas.sum_over_replicas((loss, list(term_values)))
        self._loss_tracker.update_state(loss, sample_weight=batch.split.num_rows)
        y_true = batch.y
        for metric, value, term in zip(split.trackers, term_values, split.terms):
            _, arranged, _ = split.arrange(y_true, y_pred, None)
            y_p = loss_lib.resolve(term.path, arranged)
            metric.update_state(value, sample_weight=keras.tree.flatten(y_p)[0].shape[0])
        logs = self.compute_metrics(batch.x, batch.y, y_pred, sample_weight=batch.sample_weight)
        if replicas.num_replicas() == 1:
            return logs
        # Each replica's metric state holds its own rows; the results of the
        # global batch read the state summed over the replicas (and workers).
        return replicas.across_replicas(self.get_metrics_result)

    def _check_gradients(self, grads):
        """Raises ValueError naming every trainable variable no gradient reached."""
        variables = self.pipeline.variables
        users = self.pipeline.stage_of_variables()
        missing = {}
        for i, (v, g) in enumerate(zip(variables, grads)):
            if g is None:
                home = users[i][0]
                missing.setdefault(home, []).append(v.path)
        if not missing:
            return
        where = "; ".join(f"stage {k} ({self.stages[k].name!r}): {paths}"
                          for k, paths in sorted(missing.items()))
        raise ValueError(
            f"No gradient reaches {sum(len(p) for p in missing.values())} trainable "
            f"variable(s) in a training step of {self.name!r}: {where}. Keras would "
            f"only warn and leave them unchanged; tfpipe stops rather than train "
            f"silently wrong. If they should stay fixed, set trainable=False on their "
            f"layers before compile; otherwise make the loss depend on them (a loss "
            f"for every output they feed, no stop_gradient on the way).")

    def train_step(self, data):
        batch = self._batch(data)
        split = loss_lib.LossSplit(self._compile_loss)
        scale = self.optimizer.scale_loss if self.optimizer is not None else None
        pipeline = self.replica_pipelines[replicas.replica_index()]
        result = pipeline.train(batch, split, scale)
        self._check_gradients(result.grads)
        pairs = list(zip(result.grads, pipeline.variables))
        if pairs:
            self.optimizer.apply_gradients(pairs)
        return self._update_metrics(batch, result.y_pred, result.loss, split,
                                    result.term_values)

    def _regularization_loss(self):
        values = [tf.cast(v.regularizer(v), tf.float32) for v in self.pipeline.variables
                  if getattr(v, "regularizer", None) is not None]
        # Once per step: each of the R replicas reports its 1/R share.
        return tf.add_n(values) / replicas.num_replicas() if values else None

    def test_step(self, data):
        batch = self._batch(data)
        split = loss_lib.LossSplit(self._compile_loss)
        pipeline = self.replica_pipelines[replicas.replica_index()]
        y_pred, call_loss = pipeline.forward(batch, training=False)
        with devices_lib.scope(pipeline.devices[pipeline.stage_device[-1]]):
            data_loss, term_values = split.batch_values(batch.y, y_pred, batch.sample_weight)
            terms = [data_loss] + [t for t in (call_loss, self._regularization_loss())
                                   if t is not None]
            loss = tf.add_n(terms)
        return self._update_metrics(batch, y_pred, loss, split, term_values)

    def predict_step(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        if self._source is not None:
            x = self._source.graph.standardize_inputs(x)
        pipeline = self.replica_pipelines[replicas.replica_index()]
        y_pred, _ = pipeline.forward(microbatch.Batch(x, None, None, self.num_microbatches))
        return y_pred

    # -- description and serialisation ----------------------------------

    def pipeline_summary(self):
        """A text table of stages: device, layer count, parameter count."""
        k = len(self.stages)
        sim = schedules.simulate(self.schedule, self.num_microbatches,
                                 len(self.pipeline_devices))
        lines = [
            f"Pipeline: {k} stage(s) on {len(self.pipeline_devices)} device(s) x "
            f"{self.num_microbatches} micro-batch(es), schedule={self.schedule.name}, "
            f"recompute={self.recompute}, execution={self.execution}"
            f"{' (tfpipe chose it)' if self.pipeline_config.execution_chosen else ''}, "
            f"schedule's ideal bubble (F=1, B=2)={sim.bubble_fraction:.1%}, "
            f"peak live activations per device={sim.peak_activations}",
            f"{'stage':<7}{'name':<24}{'device':<46}{'layers':>7}{'params':>12}  output",
        ]
        outputs = getattr(self, "_stage_outputs", [None] * k)
        seen = set()
        for i, (stage, device) in enumerate(zip(self.stages, self.stage_devices)):
            n_layers = len(stage.layers) if hasattr(stage, "layers") else 1
            own = [v for v in stage.weights if id(v) not in seen]
            seen.update(id(v) for v in own)
            params = sum(int(np.prod(v.shape)) for v in own)
            shape = "" if outputs[i] is None else _describe_shapes(outputs[i])
            lines.append(f"{i:<7}{stage.name:<24}{device:<46}{n_layers:>7}{params:>12,}  "
                         f"{shape}")
        if len(self.replica_pipelines) > 1:
            lines.append(
                f"Data parallel: {len(self.replica_pipelines)} replicas; the devices above "
                f"are replica 0's, replica r runs stage k on " + "; ".join(
                    f"r={r}: {[p.devices[d] for d in p.stage_device]}"
                    for r, p in enumerate(self.replica_pipelines) if r))
        if self.balance is not None:
            how = ("as given to from_model" if self.balance_method == "explicit"
                   else f"from_model, by {self.balance_method}")
            lines.append(f"Balance: {self.balance} units per stage ({how})")
        return "\n".join(lines)

    def to_keras(self, device=None, include_optimizer=True):
        """The plain Keras model with this pipeline's weights, on one device
        (`tfpipe.layout.to_keras`)."""
        return layout.to_keras(self, device=device, include_optimizer=include_optimizer)

    def summary(self, *args, print_fn=None, **kwargs):
        """Keras' summary, then the stage table (`pipeline_summary`)."""
        super().summary(*args, print_fn=print_fn, **kwargs)
        (print_fn or print)(self.pipeline_summary())

    def get_config(self):
        config = {
            "name": self.name,
            "pipeline": self._pipeline_config.to_json(),
            "input_dtype": self._input_dtype,
        }
        if self._source is not None:
            config["source_model"] = keras.saving.serialize_keras_object(self._source.model)
            config["balance"] = list(self._source.balance)
            config["balance_method"] = self._source.method
            return config
        owners = {}
        for k, stage in enumerate(self.stages):
            for layer in _internal.flatten_layers(stage):
                if id(layer) in owners and owners[id(layer)] != k:
                    raise ValueError(
                        f"Cannot save {self.name!r}: layer {layer.name!r} is shared by "
                        f"stages {owners[id(layer)]} and {k}, and stages saved one by one "
                        f"would no longer share it. Build the pipeline with "
                        f"PipelinedModel.from_model(model), which saves the model once.")
                owners[id(layer)] = k
        config["stages"] = [keras.saving.serialize_keras_object(s) for s in self.stages]
        return config

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
        # XLA was accepted for the saved layout (all stages on one device); a
        # model loaded onto several devices runs without it, as compile says.
        if config.get("jit_compile") is True and len(set(self.pipeline_devices)) > 1:
            config["jit_compile"] = False
        self.compile(**config)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds a saved pipeline under the current `PipelineStrategy`.

        The saved pipeline settings are used, except those the strategy in
        scope was given explicitly (see `tfpipe.config`).
        """
        config = dict(config)
        strategy = strategy_lib.current_pipeline_strategy() or strategy_lib.PipelineStrategy()
        saved = config.pop("pipeline", None)
        if saved is None:  # saved by tfpipe 0.1: settings at the top level
            saved = {k: config.pop(k, None) for k in ("num_microbatches", "recompute", "execution")}
        else:
            saved = config_lib.PipelineConfig.from_json(saved).settings()
        settings = config_lib.merge(saved, strategy.given_settings).settings()
        request = layout.current_load_request()
        if request is not None:  # tfpipe.load_model's overrides come last
            settings.update({k: v for k, v in request.settings.items() if v is not None})
        name, input_dtype = config.pop("name", None), config.pop("input_dtype", "float32")
        with strategy.scope() if strategy_lib.current_pipeline_strategy() is None \
                else contextlib.nullcontext():
            if "source_model" in config:
                # On the host first: the whole model may not fit on one accelerator.
                with tf.device(_host_device()):
                    source = keras.saving.deserialize_keras_object(
                        config["source_model"], custom_objects=custom_objects)
                named = {} if name is None else {"name": name}
                balance = layout.choose_balance(
                    config["balance"], strategy, schedules.get(settings["schedule"]),
                    where=f"The saved model {name!r}")
                pipelined = cls.from_model(source, balance=balance, **named, **settings)
                if balance == config["balance"]:
                    pipelined._source.method = config.get("balance_method", "explicit")  # pylint: disable=protected-access
                return pipelined
            if request is not None and (request.balance is not None or len(
                    config["stages"]) != strategy.max_stages(schedules.get(settings["schedule"]))):
                raise ValueError(
                    f"{request.path} holds {len(config['stages'])} hand-made stages, which "
                    f"cannot be cut again. Load it under a strategy with as many stage "
                    f"slots, or build the pipeline with PipelinedModel.from_model(model) "
                    f"(re-cuttable) and save that.")
            stage_configs = config.pop("stages")
            schedule = settings["schedule"]
            try:
                devices = strategy.pipeline_devices(len(stage_configs), schedule)[1]
            except ValueError:
                devices = ()  # __init__ below raises the same error, with context
            stages = []
            for k, stage_config in enumerate(stage_configs):
                # A deserialised Sequential builds itself: do it on its device.
                with devices_lib.scope(devices[k]) if k < len(devices) else contextlib.nullcontext():
                    stages.append(keras.saving.deserialize_keras_object(
                        stage_config, custom_objects=custom_objects))
            return cls(stages=stages, name=name, input_dtype=input_dtype, **settings)


class _StageList:
    """Holds the stage list out of Keras' and TensorFlow's tracking."""

    def __init__(self, stages):
        self.stages = list(stages)


def _describe_shapes(structure):
    """'(None, 16)' of a tensor, '[(None, 4), (None, 4)]' of a nest."""
    shapes = [tuple(t.shape) for t in tf.nest.flatten(structure) if t is not None]
    return str(shapes[0]) if len(shapes) == 1 else str(shapes)


def _describe(structure):
    """'shape (None, 2, 2), float32' of a tensor, or of each leaf of a nest."""
    leaves = [t for t in tf.nest.flatten(structure) if t is not None]
    parts = [f"shape {tuple(t.shape)}, {keras.backend.standardize_dtype(t.dtype)}"
             for t in leaves]
    return parts[0] if len(parts) == 1 else "; ".join(parts)
