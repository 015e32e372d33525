"""The loop form: a schedule run as one `tf.while_loop` over clock ticks.

The schedule becomes a constant (T, D) table of branch codes and micro-batch
indices (`tfpipe.schedules.clock_ticks`); at each tick every device runs a
`tf.switch_case` over the `tfpipe.runtime` handlers of its actions, so the
body is traced once whatever M. The state is TensorArrays (free batch
dimension) and tensors carried by the loop (`_Layout.state`). Only stage
inputs and seeds are kept: every B, I and W replays its stage with its F's
seeds (`recompute="always"`).
"""

import tensorflow as tf

from tfpipe import _internal
from tfpipe import actions
from tfpipe import boundary
from tfpipe import gradients as gradients_lib
from tfpipe import loss as loss_lib
from tfpipe import runtime
from tfpipe import schedules
from tfpipe import stage as stage_lib
from tfpipe import xla


def _array(spec, m_count, rows=None):
    """A TensorArray of `m_count` micro-batch elements of `spec` (batch dim
    None). Under XLA `rows` is the micro-batch size (int32 scalar): an XLA
    TensorList must be created with its whole element shape before the loop."""
    if not isinstance(spec, tf.TensorSpec):
        raise ValueError(
            f"execution='loop' passes dense tensors between stages; a stage returns "
            f"{spec!r}. Use execution='unrolled' for composite tensors between stages.")
    if rows is None:
        return tf.TensorArray(spec.dtype, size=m_count, element_shape=spec.shape,
                              infer_shape=False, clear_after_read=False)
    if spec.shape.rank is None or not spec.shape[1:].is_fully_defined():
        raise ValueError(
            f"execution='loop' under jit_compile=True needs stage boundaries whose shape "
            f"is static except the batch dimension; one has shape {spec.shape}. Give the "
            f"model static shapes (keras.Input(shape=...) without None), or use "
            f"execution='unrolled'.")
    shape = tf.concat([tf.reshape(rows, [1]) if spec.shape.rank else tf.zeros([0], tf.int32),
                       tf.constant(spec.shape[1:].as_list(), tf.int32)], 0)
    flow = tf.raw_ops.TensorListReserve(element_shape=shape, num_elements=m_count,
                                        element_dtype=spec.dtype)
    return tf.TensorArray(spec.dtype, flow=flow, infer_shape=False, clear_after_read=False)


def _shaped(t, shape):
    t.set_shape(shape)
    return t


def _read(arrays, specs, m):
    return tf.nest.pack_sequence_as(specs, [
        _shaped(ta.read(m), s.shape) for ta, s in zip(arrays, tf.nest.flatten(specs))])


def _write(arrays, structure, m):
    return [ta.write(m, t) for ta, t in zip(arrays, tf.nest.flatten(structure))]


def _concat(arrays, specs):
    return tf.nest.pack_sequence_as(specs, [
        _shaped(ta.concat(), tf.TensorShape([None]).concatenate(s.shape[1:]))
        for ta, s in zip(arrays, tf.nest.flatten(specs))])


class LoopStore:
    """The `tfpipe.runtime.Store` over a copy of the loop's carried dict `st`."""

    def __init__(self, layout, st):
        self.layout, self.st = layout, _copy(st)
        self.step = layout.step
        self.start = None  # with a timeline: the current action's start stamp

    def begin(self, d, structure, release=()):
        del d, release
        if self.start is None:
            return structure
        # Stamp once the inputs exist; the action's work waits for the stamp.
        with tf.control_dependencies(runtime.float_leaves(structure)):
            self.start = _internal.unordered_timestamp()
        with tf.control_dependencies([self.start]):
            return tf.nest.map_structure(
                lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, structure)

    def _stage_input(self, k, m):
        if k == 0:
            return self.step.batch.micro(m)[0]
        return _read(self.st["acts"][k], self.step.interfaces[k - 1].specs, m)

    def forward_input(self, d, k, m):
        return self.begin(d, self._stage_input(k, m))

    def put_forward(self, d, k, m, result):
        step, st = self.step, self.st
        if k < step.num_stages - 1:
            st["acts"][k + 1] = _write(st["acts"][k + 1], result.out, m)
        else:
            packed = boundary.pack(result.out, step.interfaces[k])
            st["outs"] = _write(st["outs"], step.batch.split.keep_real(packed, m), m)
        if result.kept is not None:  # a training step: the input is re-read from acts
            st["seeds"][k] = [ta.write(m, s) for ta, s in zip(st["seeds"][k],
                                                              result.kept.seeds)]
        if result.kept is not None and result.moments:
            st["bn"][k] = [ta.write(m, t) for ta, t in zip(st["bn"][k], [
                t for c in result.moments for t in (c.count, c.mean, c.variance)])]
        if result.extra is not None:
            st["extra"][d] = st["extra"][d] + tf.cast(result.extra, st["extra"][d].dtype)
        if result.parts:
            st["num"] = [acc + tf.cast(s, acc.dtype)
                         for acc, (s, _, _) in zip(st["num"], result.parts)]
            st["div"] = [acc if dp is None else acc + tf.cast(dp, acc.dtype)
                         for acc, (_, dp, _) in zip(st["div"], result.parts)]

    def take_kept(self, k, m):
        return stage_lib.Replay(self._stage_input(k, m),
                                [ta.read(m) for ta in self.st["seeds"][k]])

    def loss_seeds(self, plan, scale):
        return [s * scale for s in plan.seeds(_divisor_sums(self.st, self.step))]

    def output_gradients(self, k, m):
        """Per float leaf of stage k's output boundary, its gradient or None."""
        arrays = iter(zip(self.st["gin"][k], self.layout.connected_specs(k)))
        grads = []
        for connected in self.step.interfaces[k + 1].inputs_connected:
            if not connected:
                grads.append(None)
                continue
            ta, spec = next(arrays)
            grads.append(_shaped(ta.read(m), spec.shape))
        return grads

    def put_input_gradients(self, k, m, grads):
        sources = runtime.float_leaves(self._stage_input(k, m))
        packed = [tf.zeros_like(t) if g is None else tf.convert_to_tensor(g)
                  for t, g, c in zip(sources, grads, self.step.interfaces[k].inputs_connected)
                  if c]
        self.st["gin"][k - 1] = [ta.write(m, g) for ta, g in zip(self.st["gin"][k - 1], packed)]
        return []

    def add_weight_gradients(self, d, k, m, grads):
        layout = self.layout
        self.st["grads"][d] = list(self.st["grads"][d])
        for i, grad, _ in grads:
            j = layout.device_vars[d].index(i)
            self.st["grads"][d][j] = layout.slots[d][i].add(self.st["grads"][d][j], grad, k, m)
        return []

    def weight_sum(self, i):
        return None  # sums live in per-device slots (`_GradientSlot`)


def _divisor_sums(st, step):
    """The counted terms' divisor sums so far (None for the other terms)."""
    return [acc if t.kind == loss_lib.COUNTED else None
            for acc, t in zip(st["div"], step.split.terms)]


class _Layout:
    """The loop's state for one step, sized when tracing; `owned`: what each device writes."""

    def __init__(self, plan, step):
        self.plan, self.step = plan, step
        m_count, k_count = step.num_microbatches, step.num_stages
        d_count = len(plan.devices)
        interfaces = step.interfaces
        backward = step.backward_step
        var_index = {id(v): i for i, v in enumerate(step.variables)}
        # Under XLA every micro-batch has this many rows (Split.assume_equal).
        rows = step.batch.split.equal_size
        # Per device, the variables its stages' backward passes add to.
        self.device_vars = [[] for _ in range(d_count)]
        self.slots = [{} for _ in range(d_count)]  # device -> variable index -> _GradientSlot
        for k in range(k_count if backward else 0):
            d = plan.stage_device[k]
            for v, c, sparse in zip(plan.layers[k].trainable_variables,
                                    interfaces[k].variables_connected,
                                    interfaces[k].variables_sparse):
                i = var_index[id(v)]
                if not c:
                    continue
                if i not in self.slots[d]:
                    self.device_vars[d].append(i)
                    self.slots[d][i] = _GradientSlot(v, m_count)
                self.slots[d][i].add_user(k, sparse)

        def bn_arrays(k):
            return [tf.TensorArray(t.dtype, size=m_count, element_shape=t.shape)
                    for c in interfaces[k].recorded or [] for t in (c.count, c.mean, c.variance)]

        n_terms = len(step.split.terms) if backward else 0
        if rows is not None and any(slot.sparse for slots in self.slots
                                    for slot in slots.values()):
            raise ValueError(
                "execution='loop' under jit_compile=True cannot keep embedding "
                "(IndexedSlices) gradients, whose row count varies; use "
                "execution='unrolled' with jit_compile=True.")
        self.state = {
            "acts": [[_array(s, m_count, rows) for s in tf.nest.flatten(interfaces[k - 1].specs)]
                     if k else [] for k in range(k_count)],
            "outs": [_array(s, m_count, rows) for s in tf.nest.flatten(interfaces[-1].specs)],
            "seeds": [[tf.TensorArray(v.dtype, size=m_count, element_shape=v.shape,
                                      clear_after_read=False)
                       for v in plan.states[k].seed_variables()] if backward else []
                      for k in range(k_count)],
            "gin": [[_array(s, m_count, rows) for s in self.connected_specs(k)] if backward else []
                    for k in range(k_count - 1)],
            "bn": [bn_arrays(k) if backward else [] for k in range(k_count)],
            "grads": [[self.slots[d][i].initial() for i in self.device_vars[d]]
                      for d in range(d_count)],
            "extra": [tf.zeros((), step.dtype) for _ in range(d_count)],
            # A device's next action starts once every op of its previous one ran.
            "token": [tf.zeros((), tf.float32) for _ in range(d_count)],
            "num": [tf.zeros((), step.dtype) for _ in range(n_terms)],
            "div": [tf.zeros((), step.dtype) for _ in range(n_terms)],
        }
        self.owned = [self._owned_keys(d, n_terms) for d in range(d_count)]

    def connected_specs(self, k):
        """Specs of the float leaves of boundary k that the loss reaches."""
        interfaces = self.step.interfaces
        floats = [s for s in tf.nest.flatten(interfaces[k].specs)
                  if isinstance(s, tf.TensorSpec) and s.dtype.is_floating]
        return [s for s, c in zip(floats, interfaces[k + 1].inputs_connected) if c]

    def _owned_keys(self, d, n_terms):
        """The state entries device d's actions write: (key, index) pairs."""
        keys = [("extra", d), ("grads", d), ("token", d)]
        for k, home in enumerate(self.plan.stage_device):
            if home != d:
                continue
            keys += [("seeds", k), ("gin", k - 1) if k else None, ("bn", k)]
            if k < self.step.num_stages - 1:
                keys.append(("acts", k + 1))
            else:
                keys += [("outs", None)] + [("num", j) for j in range(n_terms)] + \
                        [("div", j) for j in range(n_terms)]
        return [key for key in keys if key is not None]

    def add_timeline(self, ticks):
        """Adds per device a float64 TensorArray of (start, end) stamps, two
        per action in the device's order, and the (T, D) table of positions."""
        rows = [[row[d] for row in ticks if row[d] is not None]
                for d in range(len(self.plan.devices))]
        self.timeline_rows = rows
        self.positions = tf.constant(
            [[0 if a is None else rows[d].index(a) for d, a in enumerate(row)]
             for row in ticks], tf.int32)
        self.state["times"] = [tf.TensorArray(tf.float64, size=2 * len(r), element_shape=[])
                               for r in rows]
        for d, owned in enumerate(self.owned):
            owned.append(("times", d))

    def stamp(self, st, d, t, start, end):
        """Writes action (t, d)'s start and end seconds."""
        at = 2 * self.positions[t, d]
        st["times"][d] = st["times"][d].write(at, start).write(at + 1, end)

    def timeline_events(self, st):
        """One dict per action, as the unrolled backend appends them."""
        events = []
        for d, row in enumerate(self.timeline_rows):
            stamps = st["times"][d].stack()
            for i, a in enumerate(row):
                events.append(dict(device=d, kind=a.kind, stage=a.stage,
                                   microbatch=a.microbatch, start=stamps[2 * i],
                                   end=stamps[2 * i + 1]))
        return events

    def finished(self, st):
        return FinishedStore(self, st)


class FinishedStore:
    """The loop's final state, read by `Step.finish`/`finish_forward`."""

    def __init__(self, layout, st):
        self.layout, self.st, self.step = layout, st, layout.step

    def gradients(self):
        layout, step = self.layout, self.step
        grads = [None] * len(step.variables)
        for d, indices in enumerate(layout.device_vars):
            for j, i in enumerate(indices):
                with layout.plan.home_scope(step.table, i):
                    grads[i] = gradients_lib.add_gradients(
                        grads[i], layout.slots[d][i].result(self.st["grads"][d][j]))
        return grads

    def loss_sums(self):
        divisors = _divisor_sums(self.st, self.step) if self.step.split is not None else []
        return self.st["num"], divisors, list(self.st["extra"])

    def bn_sites(self):
        sites = []
        for k in range(self.step.num_stages):
            stacked = [ta.stack() for ta in self.st["bn"][k]]
            sites.append([(c.layer,) + tuple(stacked[3 * i:3 * i + 3])
                          for i, c in enumerate(self.step.interfaces[k].recorded or [])])
        return sites

    def merged_outputs(self):
        interface = self.step.interfaces[-1]
        return boundary.unpack(_concat(self.st["outs"], interface.specs), interface)


class LoopBackend:
    """Walks the schedule as a `tf.while_loop` over clock ticks."""

    def train(self, plan, batch, split, scale_loss, timeline):
        _equal_under_xla(batch)
        ticks = schedules.clock_ticks(plan.schedule, batch.num_microbatches, len(plan.devices))
        step = runtime.Step(plan, batch, _order(ticks), split, scale_loss, training=True,
                            connectivity=True)
        layout = _Layout(plan, step)
        if timeline is not None:
            layout.add_timeline(ticks)
        state = self._run(plan, step, layout, ticks)
        if timeline is not None:
            timeline += layout.timeline_events(state)
        return step.finish(layout.finished(state))

    def forward(self, plan, batch, training):
        _equal_under_xla(batch)
        ticks = schedules.clock_ticks(plan.schedule, batch.num_microbatches, len(plan.devices),
                                      forward_only=True)
        step = runtime.Step(plan, batch, _order(ticks), None, training=training)
        layout = _Layout(plan, step)
        return step.finish_forward(layout.finished(self._run(plan, step, layout, ticks)))

    @staticmethod
    def _run(plan, step, layout, ticks):
        """The while loop: at tick t, device d runs branch codes[t, d] (0: idle)
        of the (kind, stage) pairs its row holds, on micro-batch mbs[t, d]."""
        d_count = len(plan.devices)
        branches = [sorted({(a.kind, a.stage) for row in ticks for a in [row[d]] if a},
                           key=lambda ks: (ks[1], "FBIW".index(ks[0])))
                    for d in range(d_count)]
        codes = tf.constant([[0 if a is None else 1 + branches[d].index((a.kind, a.stage))
                              for d, a in enumerate(row)] for row in ticks], tf.int32)
        mbs = tf.constant([[0 if a is None else a.microbatch for a in row] for row in ticks],
                          tf.int32)
        owned = layout.owned

        def act(st, d, kind, k, m):
            store = LoopStore(layout, st)
            graph = tf.compat.v1.get_default_graph()
            first_op = len(graph.get_operations())
            timed = "times" in st
            with plan.devices[d].scope():
                # Every op of the action (variable reads and the replay's seed
                # assignments included) waits for the device's previous action.
                with tf.control_dependencies([st["token"][d]]):
                    store.start = _internal.unordered_timestamp() if timed else None
                    step.run(store, d, actions.Action(kind, k, m))
                with tf.control_dependencies(graph.get_operations()[first_op:]):
                    store.st["token"][d] = tf.identity(st["token"][d])
                    if timed:
                        layout.stamp(store.st, d, t_now[0], store.start,
                                     _internal.unordered_timestamp())
            return _select(store.st, owned[d])

        t_now = [None]

        def body(t, st):
            t_now[0] = t
            new = _copy(st)
            for d in range(d_count):
                m = mbs[t, d]
                fns = [lambda st=st, d=d: _select(st, owned[d])]  # idle
                for kind, k in branches[d]:
                    fns.append(lambda st=st, d=d, k=k, m=m, kind=kind: act(st, d, kind, k, m))
                with plan.devices[d].scope():
                    result = tf.switch_case(codes[t, d], fns)
                _assign(new, owned[d], result)
            return t + 1, new

        # No barrier between ticks: an action starts once the TensorArrays hold
        # its inputs and its device's token says the previous action is done.
        _, state = tf.while_loop(lambda t, st: t < len(ticks), body,
                                 (tf.constant(0), layout.state),
                                 parallel_iterations=max(1, len(ticks)))
        return state


def _equal_under_xla(batch):
    """Under XLA, micro-batches of N / M rows each (`Split.assume_equal`)."""
    if xla.in_xla_program():
        batch.split.assume_equal()


def _order(ticks):
    return [(d, a) for row in ticks for d, a in enumerate(row) if a is not None]


class _GradientSlot:
    """One device's running gradient of one variable over micro-batches.
    Dense gradients are summed; IndexedSlices are kept and concatenated at the
    end (Keras' Adam treats repeated rows differently from their sum)."""

    def __init__(self, variable, num_microbatches):
        self.variable, self.num_microbatches = variable, num_microbatches
        self.users, self.index_dtype, self.sparse, self.unique = [], None, True, False

    def add_user(self, stage, sparse):
        """`sparse`: None (dense gradient) or (index dtype, unique rows)."""
        self.users.append(stage)
        if sparse is None:
            self.sparse = False
        else:
            self.index_dtype, unique = sparse
            self.unique = self.unique or unique

    def initial(self):
        v = self.variable
        if not self.sparse:
            return tf.zeros(v.shape, v.dtype)
        size = self.num_microbatches * len(self.users)
        row = tf.TensorShape([None]).concatenate(v.shape[1:])
        return [tf.TensorArray(v.dtype, size=size, element_shape=row, infer_shape=False),
                tf.TensorArray(self.index_dtype, size=size, element_shape=[None],
                               infer_shape=False)]

    def add(self, entry, grad, stage, m):
        if not self.sparse:
            return entry + tf.convert_to_tensor(grad)
        at = m * len(self.users) + self.users.index(stage)
        return [entry[0].write(at, grad.values), entry[1].write(at, grad.indices)]

    def result(self, entry):
        if not self.sparse:
            return entry
        grad = tf.IndexedSlices(entry[0].concat(), entry[1].concat(),
                                tf.constant(list(self.variable.shape), self.index_dtype))
        return gradients_lib.merge_rows(grad) if self.unique else grad


def _copy(st):
    return {key: list(value) if isinstance(value, list) else value for key, value in st.items()}


def _select(st, keys):
    return tuple(st[key] if index is None else st[key][index] for key, index in keys)


def _assign(st, keys, values):
    for (key, index), value in zip(keys, values):
        if index is None:
            st[key] = value
        else:
            st[key][index] = value
