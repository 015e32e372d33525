"""One step of a schedule: the action interpreter.

Each action kind (F forward, B backward, I and W its input- and
weight-gradient halves) has one handler here for every execution; it calls
the action's `tfpipe.stage.Stage` and reads and writes a `Store` keyed by
(stage, micro-batch), the one thing the backends implement differently.
"""

import typing

import tensorflow as tf

from tfpipe import actions
from tfpipe import assumptions
from tfpipe import batchnorm
from tfpipe import boundary
from tfpipe import gradients as gradients_lib
from tfpipe import loss as loss_lib
from tfpipe import stage as stage_lib
from tfpipe import stage_functions

float_leaves = boundary.float_leaves
sum_or_none = stage_lib.sum_or_none


class Store(typing.Protocol):
    """Where a step's state lives: `d` a device index, `k` a stage, `m` a
    micro-batch (int, or a scalar tensor in the loop), `i` a variable of the
    step's `VariableTable`."""

    def begin(self, d, structure, release=()):
        """`structure` gated for an action on device d (ordering, timeline);
        `release`: held ops that may run from now on."""

    def forward_input(self, d, k, m):
        """Stage k's packed input boundary for F(k, m) on device d (stage 0:
        the micro-batch's x), gated as `begin` gates."""

    def put_forward(self, d, k, m, result):
        """What F(k, m) made (a `tfpipe.stage.Forward`): its output (packed,
        except the last stage's), what its backward needs and its BatchNorm
        moments (in a training step), its loss parts and weighted call losses."""

    def take_kept(self, k, m):
        """What `put_forward` kept for F(k, m)'s backward (`Replay`, `Taped`)."""

    def loss_seeds(self, plan, scale):
        """The seeds of the last stage's loss numerators (`loss.Plan.seeds`)."""

    def output_gradients(self, k, m):
        """d loss / d stage k's output boundary's float leaves (None: unconnected)."""

    def put_input_gradients(self, k, m, grads):
        """Stage k's input gradients; returns the tensors produced."""

    def add_weight_gradients(self, d, k, m, grads):
        """Adds one action's weight gradients, `grads` a list of (variable i,
        gradient, is_sum: it replaces i's running sum); returns the tensors
        produced."""

    def weight_sum(self, i):
        """Variable i's running gradient sum, or None."""

    def gradients(self):
        """At the end: one gradient per variable (None: unconnected)."""

    def loss_sums(self):
        """At the end: (numerator sums, divisor sums, call-loss terms)."""

    def bn_sites(self):
        """At the end: per stage, its BatchNorm call sites (`batchnorm.stack_sites`)."""

    def merged_outputs(self):
        """At the end: the last stage's outputs for the whole batch."""


class StepResult(typing.NamedTuple):
    """One training step's result: `y_pred` (whole batch), `loss` (float32,
    unscaled), `term_values` (per compiled loss term), `grads` (per entry of
    `table.variables`; None: unconnected) and `table`, the step's
    `VariableTable`."""
    y_pred: object
    loss: object
    term_values: list
    grads: list
    table: object


class Produced:
    """What an action made: its tensors (the device's next action waits for
    them), ops not to chain now (`exclude_ops`: a weight half left for W) and
    ops made earlier to chain now (`include_ops`)."""

    def __init__(self, tensors, exclude_ops=(), include_ops=()):
        self.tensors = [t for t in tensors if t is not None]
        self.exclude_ops, self.include_ops = list(exclude_ops), list(include_ops)


class Interpreter:
    """The action handlers over K stages (as `tfpipe.stage.Stage`) and a
    store; pure Python, so a test can drive it with fakes. `holds_ops`: the
    graph holds a split backward's weight half, so I builds both halves and W
    releases the held one; else I and W each run their half."""

    def __init__(self, stages, stage_device, holds_ops, backward_step):
        self.stages, self.stage_device = stages, stage_device
        self.num_stages = len(stages)
        self.holds_ops, self.backward_step = holds_ops, backward_step
        self.loss_plan = self.scale = None  # what the last stage's seeds come from

    def run(self, store, d, action):
        """Runs `action` on device d; returns what it produced (`Produced`)."""
        kind, k, m = action.kind, action.stage, action.microbatch
        if kind == "F":
            return self.forward(store, d, k, m)
        if kind == "I" and self.holds_ops:
            return self.backward_input(store, d, k, m)
        if kind == "W" and self.holds_ops:
            return self.backward_weight(store, d, k, m)
        return self.backward(store, d, k, m, kind)

    def forward(self, store, d, k, m):
        result = self.stages[k].forward(m, store.forward_input(d, k, m))
        store.put_forward(d, k, m, result)
        return Produced(result.produced)

    def backward(self, store, d, k, m, kind):
        """B(k, m), or I or W each running the stage's backward for its half."""
        if k == 0 and kind == "I":
            return Produced([])  # stage 0 has no input gradient to compute
        g_out = store.begin(d, self.output_gradients(store, k, m))
        stage = self.stages[k]
        want_inputs, want_weights = kind in ("B", "I"), kind in ("B", "W")
        input_grads, grads, summed = stage.backward(
            m, store.take_kept(k, m), g_out, store.weight_sum, want_inputs, want_weights)
        produced = []
        if want_inputs and k > 0:
            produced += store.put_input_gradients(k, m, input_grads)
        return Produced(produced + self._add_weights(store, stage, m, grads, summed))

    def backward_input(self, store, d, k, m):
        """I(k, m) building both halves, the weight half held back for W."""
        g_out = store.begin(d, self.output_gradients(store, k, m))
        input_grads, held = self.stages[k].backward_input(m, store.take_kept(k, m), g_out)
        produced = store.put_input_gradients(k, m, input_grads) if k else []
        return Produced(produced, exclude_ops=held)

    def backward_weight(self, store, d, k, m):
        """W(k, m) after `backward_input`: releases the held ops."""
        stage = self.stages[k]
        grads, held = stage.backward_weight(m)
        store.begin(d, [], release=held)
        return Produced(self._add_weights(store, stage, m, grads, [False] * len(grads)),
                        include_ops=held)

    def _add_weights(self, store, stage, m, grads, summed):
        given = [(i, g, is_sum) for i, g, is_sum in zip(stage.indices, grads, summed)
                 if g is not None]
        if not given:
            return []
        return store.add_weight_gradients(self.stage_device[stage.k], stage.k, m, given)

    def output_gradients(self, store, k, m):
        """d loss / d stage k's output float leaves; the last stage's loss seeds."""
        if k < self.num_stages - 1:
            return store.output_gradients(k, m)
        return store.loss_seeds(self.loss_plan, self.scale)


class Step(Interpreter):
    """One traced step of a `StepPlan` over a `Batch` in the (device, action)
    `order` the backend walks: its stages, the handlers and the end of the
    step. `split` None: forward only; `connectivity`: trace the backward while
    probing (the loop sizes its gradient arrays from it)."""

    def __init__(self, plan, batch, order, split=None, scale_loss=None, training=True,
                 connectivity=False):
        self.plan, self.batch, self.split = plan, batch, split
        self.num_microbatches = batch.num_microbatches
        backward_step = split is not None
        record = backward_step and plan.batch_norm == "deferred" and self.num_microbatches > 1
        recorders = [batchnorm.Recorder(layer, record) for layer in plan.layers]
        self.interfaces = self._probe(recorders, training, connectivity)
        m = self.num_microbatches
        assumptions.check_writes(
            [i.writes for i in self.interfaces], m, plan.recompute,
            replays=backward_step and any(actions.is_recomputed(plan.recompute, j, m)
                                          for j in range(m)))
        if (batch.sample is not None and plan.call_losses == "checked" and m > 1
                and any(i.call_losses for i in self.interfaces)):
            with tf.init_scope():  # eagerly, on real rows
                assumptions.check_call_losses(plan.layers, plan.stage_scope, plan.states,
                                              self.interfaces, batch.sample(), training)
        self.table = table = plan.variable_table()
        self.variables = table.variables
        # Losses and seeds are added in float64 in a float64 model, else float32.
        self.dtype = dtype = stage_lib.widest_float(v.dtype for layer in plan.layers
                                                    for v in layer.weights)
        scale = (tf.cast((scale_loss or (lambda v: v))(tf.constant(1.0)), dtype)
                 if backward_step else None)
        shared = stage_lib.StepInputs(batch, split, training, self.interfaces, plan.recompute,
                                      plan.traits, plan.options.observer, scale,
                                      plan.options.stage_xla, dtype)
        stages = [
            stage_lib.Stage(k, plan.num_stages, layer, plan.devices[plan.stage_device[k]],
                            plan.states[k],
                            [(i, table.variables[i], table.home(i) == k)
                             for i in table.per_stage[k]], shared, recorders[k])
            for k, layer in enumerate(plan.layers)]
        if plan.traits.stage_functions:
            for stage in stages:
                stage.function = stage_functions.StageFunction(stage)
                stage.backward_function = stage_functions.StageBackward(stage)
        super().__init__(stages, plan.stage_device,
                         plan.traits.holds_ops_in_graph and not tf.executing_eagerly(),
                         backward_step)
        if not backward_step:
            return
        self.scale = scale
        self.loss_plan = loss_lib.Plan(split, batch.split.total_rows, forwards_first(order),
                                       any(i.call_losses for i in self.interfaces),
                                       in_loop=plan.traits.in_loop, dtype=dtype)
        self.bn_before = {}
        for recorder in recorders:
            self.bn_before.update(recorder.before_step())

    def _probe(self, recorders, training, connectivity):
        """The stages' `boundary.Interface`s (a training step also classifies loss terms)."""
        split = self.split
        x0, y0, sw0 = self.batch.micro(0)

        def on_output(y_pred, extra):
            if split is None:
                return []
            y_true, sample_weight = extra
            with tf.init_scope():
                split.build(y_true, y_pred)
            return split.classify(y_true, y_pred, sample_weight)

        return boundary.probe(
            self.plan.layers, x0, training, extra=(y0, sw0), on_output=on_output,
            connectivity=connectivity,
            around_stage=(lambda k: recorders[k].forward()) if connectivity else None)

    def finish(self, store):
        """The `StepResult` of a training step (after every action ran)."""
        plan, table = self.plan, self.table
        grads = [gradients_lib.with_static_dense_shape(g, v)
                 for g, v in zip(store.gradients(), table.variables)]
        with plan.stage_scope(self.num_stages - 1):
            numerators, divisors, extras = store.loss_sums()
        final_scale = self.loss_plan.final_scale(divisors)
        if final_scale is not None:
            grads = [None if g is None else _on(plan.home_scope(table, i),
                                                gradients_lib.scale_gradient, g, final_scale)
                     for i, g in enumerate(grads)]
        reg_total = gradients_lib.add_regularization(
            table.variables, grads, self.scale, lambda i: plan.home_scope(table, i), self.dtype)
        bn_ops = self._commit_batch_norm(store.bn_sites())
        with plan.stage_scope(self.num_stages - 1):
            data_loss, term_values = self.loss_plan.values(numerators, divisors)
            loss = tf.add_n([data_loss] + [tf.cast(t, self.dtype) for t in extras + [reg_total]
                                           if t is not None])
            y_pred = store.merged_outputs()
        if bn_ops:
            with tf.control_dependencies(bn_ops):
                loss = tf.identity(loss)
        return StepResult(y_pred, loss, term_values, grads, table)

    def _commit_batch_norm(self, sites_per_stage):
        """Deferred BatchNorm: one moving-statistics update per call site;
        plain BatchNorm: refuse empty micro-batches."""
        ops = []
        if (self.plan.batch_norm == "plain" and self.num_microbatches > 1
                and any(batchnorm.batch_norm_layers(layer) for layer in self.plan.layers)):
            ops.append(batchnorm.empty_microbatch_guard(self.batch))
        for k, sites in enumerate(sites_per_stage):
            if self.stages[k].recorder.layers and sites:
                with self.plan.stage_scope(k):
                    ops += batchnorm.commit(self.bn_before, sites)
        return ops

    def finish_forward(self, store):
        """(y_pred, weighted call losses or None) of a forward-only step."""
        with self.plan.stage_scope(self.num_stages - 1):
            y_pred = store.merged_outputs()
        call_loss = (sum_or_none(store.loss_sums()[2])
                     if any(i.call_losses for i in self.interfaces) else None)
        return y_pred, call_loss


def _on(scope, fn, *args):
    with scope:
        return fn(*args)


def forwards_first(order):
    """Whether every forward of the last stage precedes its first backward."""
    stages = [a.stage for _, a in order]
    if not stages:
        return True
    last = max(stages)
    positions = [i for i, (_, a) in enumerate(order) if a.stage == last]
    first_back = min((i for i in positions if order[i][1].kind != "F"), default=None)
    last_forward = max((i for i in positions if order[i][1].kind == "F"), default=-1)
    return first_back is None or last_forward < first_back
