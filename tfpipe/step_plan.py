"""What a step runs: the stages, their devices, the variable table, the options.

The engine builds one `StepPlan`; the backends, the interpreter and the
stages read it and never see the `Pipeline`.
"""

import dataclasses

import tensorflow as tf

from tfpipe import actions
from tfpipe import schedules


class VariableTable:
    """The stages' distinct trainable `variables`, the indices each stage uses
    (`per_stage`) and the stages using each (`users`; the first is its home,
    where its storage and gradient sum live)."""

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

    def homes(self):
        """The home stage of every variable, in index order."""
        return [users[0] for users in self.users]


@dataclasses.dataclass(frozen=True)
class TraceOptions:
    """How steps are traced (`PipelinedModel.set_trace_options`; not saved):
    `enforce_order` each device's actions in the schedule's order;
    `serialize_ops` each device's ops one after another, as on a stream (not
    in the loop); `observer.on_stage_call(k, in_xla)` told of each traced stage
    call; `stage_xla` each stage function compiled as its own XLA program on
    its own device (`PipelinedModel.compile` sets it, `tfpipe.xla.stage_xla`)."""
    enforce_order: bool = True
    serialize_ops: bool = False
    observer: object = None
    stage_xla: bool = False


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The static part of every step of one pipeline (D `StageDevice`s; per
    stage its device index and `StageState`)."""
    layers: tuple
    devices: tuple
    stage_device: tuple
    states: tuple
    schedule: object
    recompute: str
    batch_norm: str
    traits: object
    options: TraceOptions
    call_losses: str = "checked"  # `tfpipe.config.CALL_LOSS_MODES`

    @property
    def num_stages(self):
        return len(self.layers)

    def stage_scope(self, k):
        """The placement scope of stage k's device."""
        return self.devices[self.stage_device[k]].scope()

    def variable_table(self):
        """The `VariableTable` of the stages as they are now (when traced)."""
        return VariableTable(self.layers)

    def home_scope(self, table, i):
        """The placement scope of variable i's home stage."""
        return self.stage_scope(table.home(i))

    def run_order(self, num_microbatches, forward_only=False):
        """The validated (device, action) order, I and W merged into B where the
        execution cannot hold W apart (nor can any, eagerly: there is no graph)."""
        order = schedules.validate(self.schedule, num_microbatches, len(self.devices))
        if forward_only:
            return [(d, a) for d, a in order if a.kind == "F"]
        traits = self.traits
        if not traits.holds_weight_gradients or (traits.holds_ops_in_graph
                                                 and tf.executing_eagerly()):
            return actions.merge_split_backward(order)
        return order
