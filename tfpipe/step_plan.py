"""What a step runs: the stages, their devices, the variable table, the options.

The engine (`tfpipe.engine.Pipeline`) builds one `StepPlan` and hands it to
its backend; the backends, the interpreter (`tfpipe.runtime`) and the stages
(`tfpipe.stage`) read it and never see the `Pipeline`.
"""

import dataclasses

import tensorflow as tf

from tfpipe import schedules


class VariableTable:
    """Each distinct trainable variable of the stages, in stage order, and
    the stages that use it (the first is its home: its storage and its
    gradient sum live there).

    Attributes:
      variables: the distinct trainable variables.
      per_stage: per stage, the indices (into `variables`) of those it uses.
      users: per variable, the stages that use it.
    """

    def __init__(self, layers):
        self.variables, self.per_stage, self.users = [], [], []
        index = {}
        for k, layer in enumerate(layers):
            mine = []
            for v in layer.trainable_variables:
                if id(v) not in index:
                    index[id(v)] = len(self.variables)
                    self.variables.append(v)
                    self.users.append([])
                i = index[id(v)]
                if i not in mine:
                    mine.append(i)
                    self.users[i].append(k)
            self.per_stage.append(mine)

    def home(self, i):
        """The home stage of variable i."""
        return self.users[i][0]


@dataclasses.dataclass(frozen=True)
class TraceOptions:
    """How steps are traced; not saved with the model. Set them with
    `PipelinedModel.set_trace_options`.

    Attributes:
      enforce_order: control dependencies make each device run its actions
        in exactly the schedule's order (as one accelerator stream would).
      serialize_ops: every op of a device runs one after another in trace
        order, as on an accelerator's stream (benchmarks on CPU: without it
        a logical CPU device runs independent ops of one action at once,
        which a GPU stream would not). The loop form ignores it.
      observer: an object with `on_stage_call(k)`, told of each stage call
        while a step is traced (`tfpipe.testing.StageCalls` counts them).
    """

    enforce_order: bool = True
    serialize_ops: bool = False
    observer: object = None


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The static part of every step of one pipeline.

    Attributes:
      layers: the K stage layers.
      devices: the D `tfpipe.devices.StageDevice`s the schedule runs on.
      stage_device: per stage, the index of its device.
      states: per stage, its `tfpipe.recompute.StageState`.
      schedule: the `tfpipe.schedules.Schedule`.
      recompute: the recompute mode.
      batch_norm: "deferred" or "plain".
      traits: the `tfpipe.config.Execution`.
      options: the `TraceOptions`.
    """

    layers: tuple
    devices: tuple
    stage_device: tuple
    states: tuple
    schedule: object
    recompute: str
    batch_norm: str
    traits: object
    options: TraceOptions

    @property
    def num_stages(self):
        return len(self.layers)

    def stage_scope(self, k):
        """The placement scope of stage k's device."""
        return self.devices[self.stage_device[k]].scope()

    def variable_table(self):
        """The `VariableTable` of the stages as they are now (read when a
        step is traced: a stage's variables exist once it is built)."""
        return VariableTable(self.layers)

    def home_scope(self, table, i):
        """The placement scope of variable i's home stage."""
        return self.stage_scope(table.home(i))

    def run_order(self, num_microbatches, forward_only=False):
        """The validated (device, action) order a step is traced in: the
        schedule's, with I and W merged into B where this execution cannot
        hold W apart from I (nor can one that holds W's ops in the graph
        when running eagerly: there is no graph)."""
        order = schedules.validate(self.schedule, num_microbatches, len(self.devices))
        if forward_only:
            return [(d, a) for d, a in order if a.kind == "F"]
        traits = self.traits
        if not traits.holds_weight_gradients or (traits.holds_ops_in_graph
                                                 and tf.executing_eagerly()):
            return schedules.merge_split_backward(order)
        return order
