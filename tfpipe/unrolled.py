"""The unrolled backend: every action of the schedule traced, in its order.

The step's state is a Python dict keyed by (what, stage, micro-batch); each
action is traced once, under its device, in the order `schedules.validate`
gives. Ordering tokens make each device run its actions in the table's
order, as one accelerator stream would: an action's inputs wait for the
device's previous action, whose token exists only once everything that
action produced does (ordering on the input gradient alone let TF run the
weight-gradient ops late, keeping every micro-batch's tensors alive).

A forward keeps its tape unless the recompute policy replays it. A split
backward (I then W) is one `tape.gradient` at I whose weight-only ops are
held back by a control edge until W's turn on the device
(`runtime.release`): W costs only the weight-gradient ops, as in the
zero-bubble paper, not a second backward.

The graph and its trace time grow with M; the loop form does not. Under
execution="stage_functions" (`tfpipe.runtime.StageFunction` and
`StageBackward`) each action is a call of a function traced once per stage,
so they grow far less.
"""

import tensorflow as tf

from tfpipe import _internal
from tfpipe import batchnorm
from tfpipe import devices
from tfpipe import gradients as gradients_lib
from tfpipe import recompute as recompute_lib
from tfpipe import runtime


class UnrolledStore:
    """The step's state as Python values (see the protocol in `tfpipe.runtime`)."""

    splits_in_graph = True

    def __init__(self, step, pipeline, timeline=None):
        self.step, self.pipeline, self.batch = step, pipeline, step.batch
        self.timeline = timeline
        self.acts, self.kept, self.deferred = {}, {}, {}
        self.out_grads = {}
        self.outputs = [None] * step.num_microbatches
        self.extras = []
        self.bn_calls = [[None] * step.num_microbatches for _ in range(step.num_stages)]
        n_terms = len(step.split.terms) if step.split is not None else 0
        self.numerators = [[] for _ in range(n_terms)]
        self.divisors = [[] for _ in range(n_terms)]
        self.seeds_cache = None
        self.grads = [None] * len(step.variables)
        self.unique_rows = set()  # variables whose slices are merged row by row
        # Ordering: each device's token, and the current action's gate.
        self.last = [None] * len(pipeline.devices)
        self.start = None
        # Under stage functions an action is a call or two: the walk puts
        # the whole action under a control edge from the device's token
        # rather than an identity per input tensor here (`begin`). With a
        # timeline the start stamp needs the inputs gated, as unrolled.
        self.orders_by_control = (pipeline.enforce_order and step.stage_functions is not None
                                  and timeline is None)

    # -- ordering and timeline ---------------------------------------------

    def begin(self, d, structure, release=()):
        """`structure`, made to wait for device d's previous action; the
        action's start stamp is taken once those inputs exist."""
        pipeline = self.pipeline
        if pipeline.enforce_order and self.last[d] is not None and not self.orders_by_control:
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
        gate = self.start if self.timeline is not None else (
            self.last[d] if pipeline.enforce_order else None)
        runtime.release(list(release), gate)
        return structure

    # -- forward -----------------------------------------------------------

    def replays(self, k, m):
        return recompute_lib.should_recompute(self.pipeline.recompute, m,
                                              self.step.num_microbatches)

    def stage_input(self, k, m):
        return self.batch.micro(m)[0] if k == 0 else self.acts.pop((k, m))

    def put_output(self, k, m, out):
        if k == self.step.num_stages - 1:
            self.outputs[m] = out
        else:
            self.acts[(k + 1, m)] = out

    def keep(self, k, m, record):
        self.kept[(k, m)] = record

    def put_bn(self, k, m, calls):
        self.bn_calls[k][m] = calls

    def add_extra(self, d, value):
        self.extras.append(value)

    def add_loss_parts(self, parts):
        for j, (s, divisor, _) in enumerate(parts):
            self.numerators[j].append(s)
            self.divisors[j].append(divisor)

    def divisor_sums(self):
        return [runtime.sum_or_none(ds) if ds and ds[0] is not None else None
                for ds in self.divisors]

    # -- backward ----------------------------------------------------------

    def take_kept(self, k, m):
        return self.kept.pop((k, m))

    def loss_seeds(self, plan, scale):
        if self.seeds_cache is None:
            self.seeds_cache = [s * scale for s in plan.seeds(self.divisor_sums())]
        return self.seeds_cache

    def output_gradients(self, k, m):
        return self.out_grads.pop((k, m))

    def put_input_gradients(self, k, m, grads):
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        self.out_grads[(k - 1, m)] = grads
        return grads

    def add_weight_gradient(self, d, k, m, i, g):
        if isinstance(g, tf.IndexedSlices) and gradients_lib.gathers_unique_rows(g):
            self.unique_rows.add(i)
        total = self.pipeline.on_home(self.step.variables[i], gradients_lib.add_gradients,
                                      self.grads[i], g)
        self.grads[i] = total
        return [total.values, total.indices] if isinstance(total, tf.IndexedSlices) else [total]

    def weight_sum(self, i):
        return self.grads[i]

    def set_weight_sum(self, i, total):
        self.grads[i] = total

    def has_deferred(self, k, m):
        return (k, m) in self.deferred

    def defer_weights(self, k, m, grads, ops):
        self.deferred[(k, m)] = (grads, ops)

    def take_deferred(self, k, m):
        return self.deferred.pop((k, m))

    # -- the end of the step -------------------------------------------------

    def gradients(self):
        return [self.pipeline.on_home(v, gradients_lib.merge_rows, g)
                if i in self.unique_rows and isinstance(g, tf.IndexedSlices) else g
                for i, (v, g) in enumerate(zip(self.step.variables, self.grads))]

    def numerator_sums(self):
        return [runtime.sum_or_none(ns) if ns else tf.zeros(()) for ns in self.numerators]

    def extra_terms(self):
        return [runtime.sum_or_none(self.extras)]

    def bn_sites(self):
        return [batchnorm.stack_sites(calls) if all(c is not None for c in calls) else []
                for calls in self.bn_calls]

    def merged_outputs(self):
        return self.batch.split.merge(self.outputs)


class UnrolledBackend:
    """Walks the schedule's actions in run order, each traced once."""

    def train(self, pipeline, batch, split, scale_loss, timeline):
        order = pipeline.run_order(batch.num_microbatches)
        step = runtime.Step(pipeline, batch, order, split, scale_loss, training=True)
        store = UnrolledStore(step, pipeline, timeline)
        self._walk(pipeline, step, store, order, timeline)
        return step.finish(store)

    def forward(self, pipeline, batch, training):
        order = [(d, a) for d, a in pipeline.run_order(batch.num_microbatches)
                 if a.kind == "F"]
        step = runtime.Step(pipeline, batch, order, None, training=training)
        store = UnrolledStore(step, pipeline)
        self._walk(pipeline, step, store, order, None)
        return step.finish_forward(store)

    @staticmethod
    def _walk(pipeline, step, store, order, timeline):
        graph = tf.compat.v1.get_default_graph()
        last_op = [None] * len(pipeline.devices)  # each device's last op (serialize_ops)
        for d, action in order:
            # (Listing the graph's ops costs O(graph); only for serialize_ops.)
            first_op = len(graph.get_operations()) if pipeline.serialize_ops else None
            store.start = None
            token = [store.last[d]] if store.orders_by_control and store.last[d] is not None else []
            with devices.scope(pipeline.devices[d]), tf.control_dependencies(token):
                produced = step.run(store, d, action)
                end = None
                if timeline is not None:
                    # After the start too: an action may produce nothing (stage
                    # 0's I, whose weight half waits for W).
                    with tf.control_dependencies(produced.tensors + [
                            t for t in [store.start, store.last[d]] if t is not None]):
                        end = _internal.unordered_timestamp()
                    timeline.append(dict(device=d, kind=action.kind, stage=action.stage,
                                         microbatch=action.microbatch, start=store.start,
                                         end=end))
                    store.last[d] = end
                elif produced.tensors:
                    # Under stage functions an action whose outputs all come
                    # from one call op has that op as its token. (Not an
                    # inlined layer's op: with it as the token, predictions at
                    # 4 and 2 stages differed in the last bit (test_layout);
                    # a control edge out of an op can change what grappler
                    # fuses, we think, not verified.)
                    makers = {id(t.op): t.op for t in produced.tensors}
                    if store.orders_by_control and len(makers) == 1:
                        store.last[d] = next(iter(makers.values()))
                    else:
                        with tf.control_dependencies(produced.tensors):
                            store.last[d] = tf.identity(produced.tensors[0])
            if pipeline.serialize_ops:
                excluded = {id(op) for op in produced.exclude_ops}
                new = [op for op in graph.get_operations()[first_op:] if id(op) not in excluded]
                # Ops made earlier but released by this action (a split W's
                # weight half) wait for its gate; with a timeline that is the
                # start stamp made here, so they are chained right after it.
                at = next((i + 1 for i, op in enumerate(new)
                           if store.start is not None and op is store.start.op), 0)
                ops = new[:at] + produced.include_ops + new[at:]
                last_op[d] = _internal.chain_ops(ops, last_op[d])


def _identity(structure):
    """tf.identity of every dense tensor of a nest (others pass through)."""
    return tf.nest.map_structure(
        lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, structure)
