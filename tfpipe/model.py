"""`PipelinedModel`: the Keras face of the pipeline.

Each `fit`/`evaluate`/`predict` step cuts the batch into M micro-batches, runs
the schedule on the stage devices (`tfpipe.engine`) and, in training, applies
one optimizer update with the gradients summed over micro-batches. This module
only wires: checks, loss split, cut and saving live in their own modules.
"""

import contextlib
import dataclasses
import functools

import keras
import numpy as np
import tensorflow as tf

from tfpipe import _internal
from tfpipe import batchnorm
from tfpipe import config as config_lib
from tfpipe import cutting
from tfpipe import engine
from tfpipe import gradients as gradients_lib
from tfpipe import graph as graph_lib
from tfpipe import host as host_lib
from tfpipe import inputs as inputs_lib
from tfpipe import keras_calls
from tfpipe import keras_config
from tfpipe import loss as loss_lib
from tfpipe import microbatch
from tfpipe import placement
from tfpipe import recompute_choice
from tfpipe import replicas
from tfpipe import saving
from tfpipe import strategy as strategy_lib
from tfpipe import summary


@keras.saving.register_keras_serializable(package="tfpipe")
class PipelinedModel(keras_config.KerasConfig, keras_calls.KerasCalls, _internal.CheckpointAs,
                     _internal.EmptyDataLikeKeras, keras.Model):
    """A Keras model whose `stages` run as a pipeline on the strategy's devices.

    Args:
      stages: K Keras layers; stage k takes stage k - 1's output and is built
        (or has its variables moved) under its device.
      num_microbatches, schedule, recompute, execution, batch_norm,
        call_losses: the `tfpipe.config.PipelineConfig` settings; None takes
        the strategy's.
      input_shape: optional shape or nest of shapes (batch dimension
        included): builds the model now. input_dtype: the build's dtype.

    Create it under `tfpipe.PipelineStrategy(...).scope()`; outside any scope
    it makes a default `PipelineStrategy()`.
    """

    def __init__(self, stages, num_microbatches=None, recompute=None,
                 input_shape=None, input_dtype="float32", execution=None, schedule=None,
                 batch_norm=None, call_losses=None, **kwargs):
        # A PipelineStrategy, or the TPUPipelineHost of a TPUStrategy.
        strategy = strategy_lib.current_pipeline_host()
        if strategy is None and tf.distribute.has_strategy():
            raise ValueError(
                f"PipelinedModel must be created under a tfpipe.PipelineStrategy or a "
                f"tf.distribute.TPUStrategy scope, not "
                f"{type(tf.distribute.get_strategy()).__name__}: other strategies "
                f"override the per-stage device placement.")
        strategy = strategy or strategy_lib.PipelineStrategy()
        source = kwargs.pop("_source", None)
        super().__init__(**kwargs)
        # Inputs reach the stages as given; each stage converts what it takes.
        _internal.keep_input_types(self)
        _internal.set_distribute_strategy(self, strategy.distribute_strategy)
        self._pipeline_strategy = strategy
        self._variable_devices = host_lib.VariableDevices()
        self._trace_options = engine.TraceOptions()
        self._source = source
        self._first_batch = None  # the data's first batch, read when a check needs it
        if source is not None and hasattr(source.model, "output_names"):
            self.output_names = list(source.model.output_names)
        stages = inputs_lib.check_stages(stages)
        # Keras and checkpoints track the user's model when one was cut (files
        # keyed by its layers load at any layout), else the stages.
        self._stage_holder = _StageList(stages)
        if source is None:
            self._tracked_stages = stages
        else:
            self._user_model = source.model
        self._input_dtype = keras.backend.standardize_dtype(input_dtype)
        self._use_config(config_lib.merge(strategy.given_settings, dict(
            num_microbatches=num_microbatches, schedule=schedule, recompute=recompute,
            execution=execution, batch_norm=batch_norm, call_losses=call_losses)))
        if input_shape is not None:
            self.build(input_shape)

    def _use_config(self, config, keep_steps=False):
        """Makes `config` (a `PipelineConfig`) the model's configuration;
        `keep_steps`: it differs in nothing the traced steps read yet."""
        strategy = self._pipeline_strategy
        devices, stage_devices = strategy.pipeline_devices(len(self.stages), config.schedule)
        self._pipeline_config = config
        # The D devices the schedule runs on; stage k lives on stage_devices[k]. Both
        # hold `tfpipe.devices.StageDevice`s, whatever the host's kind.
        self.pipeline_devices, self.stage_devices = devices, stage_devices
        # One pipeline per data-parallel replica; replica 0's is `self.pipeline`.
        self.replica_pipelines = [
            engine.Pipeline(self.stages, strategy.pipeline_devices(
                len(self.stages), config.schedule, replica=r)[0], config, self._trace_options)
            for r in range(len(strategy.device_grid))]
        self.pipeline = self.replica_pipelines[0]
        if self.built:
            batchnorm.check_layers(self.stages, config.batch_norm, strategy.num_replicas)
        if not keep_steps:  # steps traced for the old configuration must not be reused
            self.train_function = self.test_function = self.predict_function = None

    def set_trace_options(self, **options):
        """Sets how steps are traced (`tfpipe.engine.TraceOptions`: `enforce_order`,
        `serialize_ops`, `observer`); not saved. The next call traces again."""
        self._trace_options = dataclasses.replace(self._trace_options, **options)
        self._use_config(self._pipeline_config)

    @property
    def trace_options(self):
        """The `tfpipe.engine.TraceOptions` steps are traced with."""
        return self._trace_options

    @property
    def pipeline_host(self):
        """The `tfpipe.host.PipelineHost` this model runs on: its
        `PipelineStrategy`, or the host of its `TPUStrategy`."""
        return self._pipeline_strategy

    @property
    def stages(self):
        """The K stage layers; stage k runs on `stage_devices[k]`."""
        return self._stage_holder.stages

    def checkpoint_children(self):
        """What tf.train.Checkpoint saves (Keras 3 lists none): a cut model's are
        its source model's, so its checkpoints load at any stage layout."""
        if self._source is not None:
            return _internal.checkpoint_children(self._source.model)
        return {f"stage_{k}": s for k, s in enumerate(self.stages)}

    @property
    def pipeline_config(self):
        """The `tfpipe.config.PipelineConfig` this model runs with."""
        return self._pipeline_config

    # Read-only: set them in the strategy or the constructor.
    num_microbatches = property(lambda self: self._pipeline_config.num_microbatches)
    schedule = property(lambda self: self._pipeline_config.schedule)
    recompute = property(lambda self: self._pipeline_config.recompute)
    execution = property(lambda self: self._pipeline_config.execution)
    batch_norm = property(lambda self: self._pipeline_config.batch_norm)
    call_losses = property(lambda self: self._pipeline_config.call_losses)

    @property
    def balance(self):
        """Units per stage as `from_model` cut them (None for hand-made stages)."""
        return None if self._source is None else list(self._source.balance)

    @property
    def balance_method(self):
        """How `from_model` chose the balance ("params", "time", "memory", "explicit")."""
        return None if self._source is None else self._source.method

    @property
    def source_model(self):
        """The Keras model `from_model` cut (its layers are the stages' layers)."""
        return None if self._source is None else self._source.model

    @classmethod
    def from_model(cls, model, balance=None, sample=None, **kwargs):
        """Cuts a Sequential or functional model (any DAG) into pipeline stages.

        Stage k takes the next `balance[k]` units in topological order
        (`tfpipe.cutting`). The stages call `model`'s own layers, whose
        variables move to the first stage using them: training the pipeline
        trains `model`.

        Args:
          balance: units per stage, e.g. `[3, 2, 2, 1]`; None or `"params"`
            balances parameter counts, `"time"` or `"memory"` measured costs
            (`tfpipe.partition`, on `sample`: default 8 random rows), over as
            many stages as the strategy can place.
          **kwargs: passed to `PipelinedModel` (settings, `name`).
        """
        if kwargs.get("batch_norm") is not None:
            config_lib.validate_batch_norm(kwargs["batch_norm"])
        in_scope = strategy_lib.current_pipeline_host()
        strategy = in_scope or strategy_lib.PipelineStrategy()
        slots = strategy.max_stages(kwargs.get("schedule") or strategy.schedule)
        graph, balance, method, stages = cutting.cut_model(model, balance, slots, sample)
        if "input_shape" not in kwargs and graph.input_shape is not None:
            kwargs["input_shape"] = graph.input_shape
            kwargs.setdefault("input_dtype", graph.input_dtype)
        kwargs.setdefault("name", f"pipelined_{model.name}")
        with strategy.scope() if in_scope is None else contextlib.nullcontext():
            pipelined = cls(stages, _source=cutting.Source(model, graph, balance, method), **kwargs)
        if not pipelined.built:
            raise ValueError(
                f"from_model could not infer the input shape of {model.name!r}; "
                f"pass input_shape=(None, ...).")
        return pipelined

    def build(self, input_shape):
        if _internal.in_keras_symbolic_build():
            raise ValueError(
                f"{self.name}: Keras tried to build the pipeline symbolically, which "
                f"would put every stage's variables on the default device. Build it "
                f"first: pass input_shape=(None, ...) to PipelinedModel, call "
                f"model.build(input_shape), or call fit/evaluate/predict with arrays "
                f"or a tf.data.Dataset (tfpipe builds from their shapes).")
        self._built_input_shape = inputs_lib.map_shapes(list, input_shape)
        # Eagerly even inside a Keras FuncGraph: variables created there would
        # land on the default device. Symbolic inputs keep the batch dimension
        # None; unbuilt layers build under their stage's device.
        with tf.init_scope(), self._strategy_scope():
            if self._source is not None and not self._source.graph.sequential:
                # The model's own inputs: they say which are sparse or ragged.
                h = self._source.model.input
            else:
                h = inputs_lib.map_shapes(
                    lambda s: keras.KerasTensor(s, dtype=self._input_dtype), input_shape)
            outputs = []  # each stage's symbolic output, for pipeline_summary
            for k, stage in enumerate(self.stages):
                with self.pipeline.stage_scope(k):
                    try:
                        h_next = stage(h, training=False)
                    except (ValueError, TypeError) as err:
                        if k == 0:
                            raise
                        raise ValueError(
                            f"Stage {k} ({stage.name!r}) cannot take the output of stage "
                            f"{k - 1} ({self.stages[k - 1].name!r}): {summary.describe(h)}. "
                            f"Make stage {k} accept that (or change the cut). Keras said: "
                            f"{err}") from err
                    h = h_next
                    outputs.append(h)
            # Stage k's column: its device in each data-parallel replica.
            columns = [[p.devices[p.stage_device[k]].name for p in self.replica_pipelines]
                       for k in range(len(self.stages))]
            if len(self.replica_pipelines) == 1:
                columns = list(self.stage_devices)
            homes = placement.place_variables(self.stages, columns)
            self._variable_devices.set((v, self.stage_devices[homes[id(v)]])
                                       for stage in self.stages for v in stage.variables)
            batchnorm.check_layers(self.stages, self.batch_norm,
                                   self._pipeline_strategy.num_replicas)
            self._stage_outputs = outputs
        if self._source is not None:
            # Its traced functions (if any) hold the variables' old storage.
            _internal.reset_compiled_functions(self._source.model)
        self._build_optimizer()

    def _strategy_scope(self):
        if tf.distribute.get_strategy() is self._pipeline_strategy.distribute_strategy:
            return contextlib.nullcontext()
        return self._pipeline_strategy.scope()

    def _build_optimizer(self):
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or optimizer.built or not self.built:
            return
        # Eagerly, so that each slot is created next to its variable (Keras
        # would build it in the first traced step, on CPU:0), in the order of
        # `trainable_variables`, so slot i is the same variable's at any layout.
        with tf.init_scope(), self._strategy_scope():
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
        # The recorded shapes: tracing the layers on dense placeholders breaks
        # on ragged inputs.
        h = inputs
        for stage in self.stages:
            h = stage.compute_output_spec(h, training=training)
        return h

    def call(self, inputs, training=None):
        """Runs the stages one after another on the whole batch (no pipelining)."""
        if self._source is not None and _internal.in_keras_symbolic_scope():
            # Keras' symbolic build wants only the outputs' shapes: the recorded
            # ones (its dense placeholders break a layer taking a ragged input).
            return tf.nest.map_structure(
                lambda s: tf.compat.v1.placeholder(s.dtype, s.shape),
                self.compute_output_spec(inputs, training=training))
        inputs = tf.nest.map_structure(
            lambda t: tf.convert_to_tensor(t) if isinstance(t, np.ndarray) else t, inputs)
        h = inputs if self._source is None else self._source.graph.standardize_inputs(inputs)
        for k, stage in enumerate(self.stages):
            with self.pipeline.stage_scope(k):
                h = stage(h, training=training)
        return h

    def compile(self, *args, jit_compile="auto", **kwargs):
        """As `keras.Model.compile`. `jit_compile=True` compiles the whole step
        with every stage on one device, else each stage function on its own
        device (an execution tfpipe chooses becomes "stage_functions"); Keras'
        `"auto"` does the latter when every device is a GPU
        (`tfpipe.xla.stage_xla`). A cut model whose class has its own
        `compile` (a keras-hub Task: "auto" optimizer, loss and metrics) has
        its defaults resolved by that `compile`, on the model itself."""
        source = self.source_model
        if source is not None and type(source).compile is not keras.Model.compile:
            source.compile(*args, jit_compile=False, **kwargs)
            args, kwargs = (), _internal.compile_arguments(source)
            kwargs.pop("jit_compile", None)
            source.compiled = False  # this model trains it: saved without its own compile
        host = self._pipeline_strategy
        config = self.pipeline_config.choose_execution(
            host.prefers_stage_functions(jit_compile, self.pipeline_devices))
        if config != self.pipeline_config:
            self._use_config(config)
        whole, per_stage = host.xla_modes(jit_compile, self.pipeline_devices,
                                          self.pipeline_config.traits.stage_functions)
        self._jit_request = jit_compile  # saved as asked (get_compile_config), not as resolved
        if per_stage != self._trace_options.stage_xla:
            self.set_trace_options(stage_xla=per_stage)
        with self._strategy_scope():
            super().compile(*args, jit_compile=whole, **kwargs)
        if self.optimizer is not None:
            host.place_optimizer(self.optimizer, self._variable_devices.of)
        self._build_optimizer()

    def _choose_recompute(self, x=None):
        """Sets the recompute mode nobody gave, chosen from memory
        (`tfpipe.recompute_choice`) on the first batch fit was given, else on
        zeros shaped as `x` (a step traced outside fit: its inputs)."""
        first = self._first_batch and functools.partial(
            inputs_lib.first_batch_values, self._first_batch, self.name, 1)
        graph, balance = (self._source.graph, self.balance) if self._source else (
            graph_lib.stage_chain(self.stages, self._built_input_shape, self._input_dtype,
                                  self.name) or (None, None))
        choice = recompute_choice.choose(
            graph, balance, first, x, self.pipeline_config,
            [p.devices for p in self.replica_pipelines], self.optimizer,
            getattr(self._pipeline_strategy, "device_memory_bytes", None))
        self._use_config(self.pipeline_config.choose_recompute(*choice), keep_steps=True)

    def split_batch(self, data, sample=None):
        """A Keras batch `data` as a `tfpipe.microbatch.Batch` of M micro-batches
        (`sample`: see `Batch`)."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if self._source is not None:
            x = self._source.graph.standardize_inputs(x)
        return microbatch.Batch(x, y, sample_weight, self.num_microbatches, sample,
                                cut_at_once=self.pipeline_config.traits.stage_functions)

    def _sample_batch(self):
        """The first batch of the data fit or evaluate was given, as an eager `Batch`."""
        return self.split_batch(inputs_lib.first_batch_values(
            self._first_batch, self.name, self.num_microbatches))

    def loss_split(self):
        """The compiled loss, split over micro-batches (`tfpipe.loss.LossSplit`)."""
        return loss_lib.LossSplit(_internal.compiled_loss(self))

    def _replica_pipeline(self):
        """The pipeline of the replica being traced (a TPU's replicas share one)."""
        if len(self.replica_pipelines) == 1:
            return self.pipeline
        return self.replica_pipelines[replicas.replica_index()]

    def _update_metrics(self, batch, y_pred, loss, split, term_values):
        # Once, on the whole batch's outputs, as full-batch training, where the
        # host puts metrics. With replicas, `loss` and `term_values` are this
        # replica's shares: the trackers record the global values weighted by
        # this replica's rows.
        with self._pipeline_strategy.metrics_scope(self.pipeline):
            loss, term_values = replicas.sum_over_replicas((loss, list(term_values)))
            _internal.loss_tracker(self).update_state(loss, sample_weight=batch.split.num_rows)
            arranged = split.arrange(batch.y, y_pred, None)[1] if split.terms else None
            for metric, value, term in zip(split.trackers, term_values, split.terms):
                y_p = loss_lib.resolve(term.path, arranged)
                metric.update_state(value, sample_weight=keras.tree.flatten(y_p)[0].shape[0])
            logs = self.compute_metrics(batch.x, batch.y, y_pred,
                                        sample_weight=batch.sample_weight)
            if replicas.num_replicas() == 1:
                return logs
            # Each replica's metric state holds its own rows: read the sum over replicas.
            return replicas.across_replicas(self.get_metrics_result)

    def train_step(self, data):
        if self.pipeline_config.recompute_pending:  # a step traced outside fit
            self._choose_recompute(keras.utils.unpack_x_y_sample_weight(data)[0])
        batch = self.split_batch(data, sample=self._sample_batch)
        split = self.loss_split()
        scale = self.optimizer.scale_loss if self.optimizer is not None else None
        try:
            result = self._replica_pipeline().train(batch, split, scale)
        except loss_lib.NeedsForwardsFirst:
            config = self.pipeline_config
            if not config.schedule_chosen:
                raise
            # The loss decides it, known once the step is traced: GPipe splits
            # every loss, so the schedule tfpipe chose gives way (the refused
            # step was only traced, never run). The first replica to meet it
            # switches every replica's pipeline.
            if not config.schedule_reason:
                self._use_config(config.fall_back_to_gpipe(
                    f"the loss needs every forward before the first backward, so not "
                    f"{config.schedule.name}"), keep_steps=True)
                if self.pipeline_config.recompute_pending:
                    self._choose_recompute(keras.utils.unpack_x_y_sample_weight(data)[0])
            batch = self.split_batch(data, sample=self._sample_batch)
            result = self._replica_pipeline().train(batch, split, scale)
        gradients_lib.check_reached(result.table, result.grads,
                                    [stage.name for stage in self.stages], self.name)
        pairs = list(zip(result.grads, result.table.variables))
        if pairs:
            self.optimizer.apply_gradients(pairs)
        return self._update_metrics(batch, result.y_pred, result.loss, split,
                                    result.term_values)

    def test_step(self, data):
        batch = self.split_batch(data, sample=self._sample_batch)
        split = self.loss_split()
        pipeline = self._replica_pipeline()
        y_pred, call_loss = pipeline.forward(batch, training=False)
        with pipeline.stage_scope(pipeline.num_stages - 1):
            data_loss, term_values = split.batch_values(batch.y, y_pred, batch.sample_weight)
            regularization = gradients_lib.regularization_loss(self.pipeline.variables)
            terms = [data_loss] + [tf.cast(t, data_loss.dtype) for t in (call_loss, regularization)
                                   if t is not None]
            loss = tf.add_n(terms)
        return self._update_metrics(batch, y_pred, loss, split, term_values)

    def predict_step(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, _ = self._replica_pipeline().forward(self.split_batch((x,)))
        return y_pred

    def pipeline_summary(self):
        """A text table of stages: device, layer count, parameter count."""
        return summary.stage_table(
            self.stages, self.stage_devices, getattr(self, "_stage_outputs", None),
            self.pipeline_config, len(self.pipeline_devices),
            [[p.devices[d].name for d in p.stage_device] for p in self.replica_pipelines],
            self.balance, self.balance_method)

    def to_keras(self, device=None, include_optimizer=True):
        """The plain Keras model with this pipeline's weights (`tfpipe.saving.to_keras`)."""
        return saving.to_keras(self, device=device, include_optimizer=include_optimizer)

    def summary(self, *args, print_fn=None, **kwargs):
        """Keras' summary, then the stage table (`pipeline_summary`)."""
        super().summary(*args, print_fn=print_fn, **kwargs)
        (print_fn or print)(self.pipeline_summary())


class _StageList:
    """Holds the stage list out of Keras' and TensorFlow's tracking."""

    def __init__(self, stages):
        self.stages = list(stages)
