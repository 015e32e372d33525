"""What a `PipelinedModel` asks of the devices it runs on: `PipelineHost`.

A host owns the stage slots (the devices, or a TPU replica's cores), the
pipeline settings of models made in its scope, and every policy that
differs by the kind of device: how `compile(jit_compile=...)` uses XLA,
whether batches need one static size, where optimizer updates run, and where
metrics are updated. `tfpipe.PipelineStrategy` (CPUs, GPUs, remote tasks'
devices) and `tfpipe.tpu.TPUPipelineHost` (a `TPUStrategy`'s cores) are its
kinds; the model and the step never test which one they have, so a new kind
of device is one subclass.
"""

import contextlib

from tfpipe import _internal
from tfpipe import devices
from tfpipe import placement
from tfpipe import schedules
from tfpipe import xla


class PipelineHost:
    """The base of every host. A subclass sets `_config` (the default
    `tfpipe.config.PipelineConfig`) and `_given` (the settings given
    explicitly, a dict), and defines `distribute_strategy`, `scope()`,
    `num_replicas`, `_stage_slots(replica)` (the row of devices that replica
    places stages on) and `_too_many_stages(num_stages, most, count)` (the
    ValueError's text)."""

    # -- the stage slots and settings --------------------------------------------

    @property
    def config(self):
        """The default `PipelineConfig` of models made in this scope."""
        return self._config

    @property
    def given_settings(self):
        """The settings this host was given explicitly (a dict)."""
        return dict(self._given)

    @property
    def schedule(self):
        return self._config.schedule

    @property
    def num_stages(self):
        """The most stages this host can place with its default schedule
        (v per device; v = 1 but for `Interleaved`)."""
        return self.max_stages(self._config.schedule)

    def max_stages(self, schedule):
        """The most stages `schedule` can place on one replica's slots."""
        return schedules.max_stages(schedule, len(self._stage_slots(0)))

    def pipeline_devices(self, num_stages, schedule=None, replica=0):
        """(devices, stage_devices) for a model of `num_stages` stages: the D
        slots replica `replica`'s pipeline uses and the one holding each
        stage, as `tfpipe.devices.StageDevice`s. `schedule` defaults to the
        host's. Raises ValueError if it cannot place them here."""
        schedule = self._config.schedule if schedule is None else schedules.get(schedule)
        placed = schedules.stage_devices(schedule, num_stages, self._stage_slots(replica))
        if placed is None:
            raise ValueError(self._too_many_stages(
                num_stages, self.max_stages(schedule),
                schedules.devices_needed(schedule, num_stages)))
        return placed

    # -- the policies that differ by device kind --------------------------------------

    # Why every batch must have one static size (a sentence), or None.
    static_batch_reason = None

    # Why tfpipe cannot time these devices from outside the step's program
    # (`tfpipe.plan`, `tfpipe.timeline.record_step`): a sentence that says what
    # to do instead, or None.
    timing_refusal = None

    def xla_modes(self, jit_compile, pipeline_devices, stage_functions):
        """(whole step as one XLA program, each stage function as its own) for
        `compile(jit_compile=...)` (`tfpipe.xla.stage_xla`)."""
        return xla.stage_xla(jit_compile, pipeline_devices, stage_functions)

    def prefers_stage_functions(self, jit_compile, pipeline_devices):
        """Whether an execution tfpipe chooses must be "stage_functions"
        under `compile(jit_compile=...)`."""
        return xla.needs_stage_functions(jit_compile, pipeline_devices)

    def place_optimizer(self, optimizer, device_of):
        """Makes `optimizer` (and the optimizers it wraps) create its slots
        through this host's strategy, which puts each next to its variable,
        and do each variable's update, weight decay and gradient all-reduce on
        `update_device`: one mechanism for every kind of device.
        `device_of(tf_variable)`: the variable's stage device, or None."""
        optimizers = placement.nested_optimizers(optimizer)
        _internal.adopt_optimizers(optimizers, self.distribute_strategy)
        for each in optimizers:
            _internal.place_optimizer_updates(
                each, lambda variable: self.update_device(variable, device_of(variable)))

    def update_device(self, variable, stage_device):
        """Where the optimizer works on TF `variable` (of `stage_device`, or
        None for the optimizer's own): the variable's own device, a
        `StageDevice`. A replica's copy names its own, and so does a mirrored
        variable read in a replica's context, so each replica of a grid
        updates its own copy; `stage_device` is replica 0's."""
        del stage_device
        return devices.StageDevice(variable.device) if variable.device else None

    def metrics_scope(self, pipeline):
        """Where a step updates its loss tracker and metrics: as plain Keras
        does, in no device scope."""
        del pipeline
        return contextlib.nullcontext()


class VariableDevices:
    """The stage device of each stage variable's home stage, keyed by its TF
    variable (`keras.Variable.value`, what Keras' optimizer works on): the
    `device_of` a host's `place_optimizer` is given. Held out of Keras'
    tracking, updated in place at each build."""

    def __init__(self):
        self._by_id = {}

    def set(self, pairs):
        """`pairs`: (keras.Variable, stage device) for every stage variable."""
        self._by_id = {id(variable.value): device for variable, device in pairs}

    def of(self, variable):
        """The device of a TF `variable`, or None (an optimizer's own variable)."""
        return self._by_id.get(id(variable))
