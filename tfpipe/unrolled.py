"""The unrolled backend: every action of the schedule traced, in its order.

The step's state is Python values keyed by (stage, micro-batch). Ordering
tokens make each device run its actions in the table's order, as one stream
would: an action's inputs wait for the device's previous action, whose token
exists only once everything that action produced does (ordering on the input
gradient alone let TF run the weight-gradient ops late, keeping every
micro-batch's tensors alive). A split backward's weight-only ops are held
back from I until W (`stage.release`).
"""

import tensorflow as tf

from tfpipe import _internal
from tfpipe import batchnorm
from tfpipe import gradients as gradients_lib
from tfpipe import runtime
from tfpipe import stage as stage_lib


class UnrolledStore:
    """The step's state as Python values (`tfpipe.runtime.Store`)."""

    def __init__(self, step, timeline=None):
        self.step, self.batch, self.plan = step, step.batch, step.plan
        self.timeline = timeline
        self.acts, self.kept, self.out_grads = {}, {}, {}
        self.outputs = [None] * step.num_microbatches
        self.extras = []
        self.bn_calls = [[None] * step.num_microbatches for _ in range(step.num_stages)]
        n_terms = len(step.split.terms) if step.split is not None else 0
        self.numerators = [[] for _ in range(n_terms)]
        self.divisors = [[] for _ in range(n_terms)]
        self.seeds_cache = None
        self.grads = [None] * len(step.variables)
        self.homes = step.table.homes()
        self.unique_rows = set()  # variables whose slices are merged row by row
        self.last = [None] * len(self.plan.devices)  # each device's token
        self.start = None
        self.enforce_order = self.plan.options.enforce_order and not tf.executing_eagerly()
        # Under stage functions the walk puts the whole action under a control
        # edge from the token, not an identity per input (`begin`); a timeline's
        # start stamp needs the inputs gated.
        self.orders_by_control = (self.enforce_order and self.plan.traits.stage_functions
                                  and timeline is None)

    def begin(self, d, structure, release=()):
        """`structure` made to wait for device d's previous action (and the start stamp)."""
        if self.enforce_order and self.last[d] is not None and not self.orders_by_control:
            with tf.control_dependencies([self.last[d]]):
                structure = _identity(structure)
        if self.timeline is not None:
            # Unordered: a plain tf.timestamp() would be chained by tf.function
            # to every other stamp of the step, serialising the devices.
            with tf.control_dependencies(
                    runtime.float_leaves(structure) + [t for t in [self.last[d]]
                                                      if t is not None]):
                self.start = _internal.unordered_timestamp()
            with tf.control_dependencies([self.start]):
                structure = _identity(structure)
        if release:  # a W: its held half waits for the gate
            gate = self.start if self.timeline is not None else (
                self.last[d] if self.enforce_order else None)
            stage_lib.release(list(release), gate)
        return structure

    def forward_input(self, d, k, m):
        return self.begin(d, self.batch.micro(m)[0] if k == 0 else self.acts.pop((k, m)))

    def put_forward(self, d, k, m, result):
        if k == self.step.num_stages - 1:
            self.outputs[m] = result.out
        else:
            self.acts[(k + 1, m)] = result.out
        if result.kept is not None:  # a training step
            self.kept[(k, m)] = result.kept
            self.bn_calls[k][m] = result.moments
        if result.extra is not None:
            self.extras.append(result.extra)
        for j, (s, divisor, _) in enumerate(result.parts):
            self.numerators[j].append(s)
            self.divisors[j].append(divisor)

    def _divisor_sums(self):
        return [runtime.sum_or_none(ds) if ds and ds[0] is not None else None
                for ds in self.divisors]

    def take_kept(self, k, m):
        return self.kept.pop((k, m))

    def loss_seeds(self, plan, scale):
        if self.seeds_cache is None:
            self.seeds_cache = [s * scale for s in plan.seeds(self._divisor_sums())]
        return self.seeds_cache

    def output_gradients(self, k, m):
        return self.out_grads.pop((k, m))

    def put_input_gradients(self, k, m, grads):
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        self.out_grads[(k - 1, m)] = grads
        return grads

    def add_weight_gradients(self, d, k, m, grads):
        produced, by_home = [], {}
        for i, grad, is_sum in grads:
            if is_sum:
                self.grads[i] = grad
                produced.append(grad)
                continue
            if isinstance(grad, tf.IndexedSlices) and gradients_lib.gathers_unique_rows(grad):
                self.unique_rows.add(i)
            by_home.setdefault(self.homes[i], []).append((i, grad))
        # One scope per home stage and one call per action, not one per weight.
        for home, pairs in by_home.items():
            with self.plan.stage_scope(home):
                totals = gradients_lib.add_each([self.grads[i] for i, _ in pairs],
                                                [g for _, g in pairs])
            if len({i for i, _ in pairs}) < len(pairs):
                raise RuntimeError(f"tfpipe bug: a weight given twice in one action: {pairs}")
            for (i, _), total in zip(pairs, totals):
                self.grads[i] = total
                produced += ([total.values, total.indices]
                             if isinstance(total, tf.IndexedSlices) else [total])
        return produced

    def weight_sum(self, i):
        return self.grads[i]

    def gradients(self):
        out = []
        for i, g in enumerate(self.grads):
            if i in self.unique_rows and isinstance(g, tf.IndexedSlices):
                with self.plan.home_scope(self.step.table, i):
                    g = gradients_lib.merge_rows(g)
            out.append(g)
        return out

    def loss_sums(self):
        numerators = [runtime.sum_or_none(ns) if ns else tf.zeros(()) for ns in self.numerators]
        return numerators, self._divisor_sums(), [runtime.sum_or_none(self.extras)]

    def bn_sites(self):
        return [batchnorm.stack_sites(calls) if all(c is not None for c in calls) else []
                for calls in self.bn_calls]

    def merged_outputs(self):
        return self.batch.split.merge(self.outputs)


class UnrolledBackend:
    """Walks the schedule's actions in run order, each traced once."""

    def train(self, plan, batch, split, scale_loss, timeline):
        order = plan.run_order(batch.num_microbatches)
        step = runtime.Step(plan, batch, order, split, scale_loss, training=True)
        store = UnrolledStore(step, timeline)
        self._walk(plan, step, store, order, timeline)
        return step.finish(store)

    def forward(self, plan, batch, training):
        order = plan.run_order(batch.num_microbatches, forward_only=True)
        step = runtime.Step(plan, batch, order, None, training=training)
        store = UnrolledStore(step)
        self._walk(plan, step, store, order, None)
        return step.finish_forward(store)

    @staticmethod
    def _walk(plan, step, store, order, timeline):
        graph = tf.compat.v1.get_default_graph()
        serialize = plan.options.serialize_ops and not tf.executing_eagerly()
        last_op = [None] * len(plan.devices)  # each device's last op (serialize_ops)
        for d, action in order:
            first_op = len(graph.get_operations()) if serialize else None
            store.start = None
            token = [store.last[d]] if store.orders_by_control and store.last[d] is not None else []
            with plan.devices[d].scope(), tf.control_dependencies(token):
                produced = step.run(store, d, action)
                end = None
                if timeline is not None:
                    # After the start too: an action may produce nothing (stage 0's I).
                    with tf.control_dependencies(produced.tensors + [
                            t for t in [store.start, store.last[d]] if t is not None]):
                        end = _internal.unordered_timestamp()
                    timeline.append(dict(device=d, kind=action.kind, stage=action.stage,
                                         microbatch=action.microbatch, start=store.start,
                                         end=end))
                    store.last[d] = end
                elif produced.tensors and store.enforce_order:
                    # Under stage functions a device's token is the call op all its
                    # outputs come from (not an inlined layer's op: a control edge
                    # out of it changed predictions in the last bit, test_layout).
                    makers = {id(t.op): t.op for t in produced.tensors}
                    if store.orders_by_control and len(makers) == 1:
                        store.last[d] = next(iter(makers.values()))
                    else:
                        with tf.control_dependencies(produced.tensors):
                            store.last[d] = tf.identity(produced.tensors[0])
            if serialize:
                excluded = {id(op) for op in produced.exclude_ops}
                new = [op for op in graph.get_operations()[first_op:] if id(op) not in excluded]
                # Ops released by this action (a W's held half) wait for its gate,
                # with a timeline the start stamp: chain them right after it.
                at = next((i + 1 for i, op in enumerate(new)
                           if store.start is not None and op is store.start.op), 0)
                ops = new[:at] + produced.include_ops + new[at:]
                # Constants are left out: they run no kernel on the stream, and
                # grappler's constant folding made a cycle of a Const's control
                # edge (then TF ran the whole step unoptimised: up to 12%
                # slower on the transformer, BUILD.md).
                last_op[d] = _internal.chain_ops([op for op in ops if op.type != "Const"],
                                                 last_op[d])


def _identity(structure):
    """tf.identity of every dense tensor of a nest (others pass through)."""
    return tf.nest.map_structure(
        lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, structure)
