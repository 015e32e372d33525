"""The loop form: a schedule run as one `tf.while_loop` over clock ticks.

The unrolled engine (`tfpipe.engine`) traces every action, so its graph and
trace time grow with M. Here the schedule becomes a constant (T, D) table of
branch codes and micro-batch indices (`tfpipe.schedules.clock_ticks`); the
loop body runs, for each device d under `tf.device`, a `tf.switch_case` over
d's possible actions (idle, F of each of its stages, B of each). The body is
traced once, whatever M is. It computes exactly what the unrolled step does
(same loss parts, seeds, deferred BatchNorm and boundary masks); only where
state lives differs.

State carried from tick to tick (all written once per micro-batch):
  acts[k]   stage k's input boundary for every micro-batch (k >= 1)  TensorArrays
  outs      the last stage's output boundary per micro-batch          TensorArrays
  seeds[k]  stage k's RNG state before each micro-batch's F          TensorArrays
  gin[k]    d loss / d (stage k's connected float outputs)            TensorArrays
  bn[k]     stage k's BatchNorm call statistics (deferred mode)       TensorArrays
  grads[d]  device d's gradients per variable (`_GradientSlot`)     tensors / TensorArrays
  extra[d]  call losses added on device d, weighted                  scalar
  num, div  the loss terms' numerators and divisor parts, summed      scalars

Micro-batches may differ in size by a row (`tfpipe.microbatch`), so the
TensorArrays hold elements with a free batch dimension and outputs are
concatenated. Which gradients exist is decided when tracing, from a traced
probe of the backward pass (`boundary.probe(connectivity=True)`), so an
unconnected variable is reported, never fed zeros.

A tick is a barrier: the loop runs its iterations one at a time, and an
action only reads what earlier ticks wrote (the table guarantees it), so each
device runs its actions in the schedule's order.

Memory: only stage inputs are kept (every B recomputes its stage's forward),
so this form is `recompute="always"`; a B replays the stage with the seeds
its F used, so dropout masks match. Embedding (IndexedSlices) gradients keep
their rows (`_GradientSlot`), as in the unrolled step.
"""

import tensorflow as tf

from tfpipe import batchnorm
from tfpipe import boundary
from tfpipe import engine
from tfpipe import gradients as gradients_lib
from tfpipe import loss as loss_lib
from tfpipe import recompute as recompute_lib
from tfpipe import schedules


def _flat_specs(spec):
    return tf.nest.flatten(spec)


def _array(spec, m_count):
    if not isinstance(spec, tf.TensorSpec):
        raise ValueError(
            f"execution='loop' passes dense tensors between stages; a stage returns "
            f"{spec!r}. Use execution='unrolled' for composite tensors between stages.")
    return tf.TensorArray(spec.dtype, size=m_count, element_shape=spec.shape,
                          infer_shape=False, clear_after_read=False)


def _read(arrays, specs, m):
    flat = []
    for ta, spec in zip(arrays, _flat_specs(specs)):
        t = ta.read(m)
        t.set_shape(spec.shape)
        flat.append(t)
    return tf.nest.pack_sequence_as(specs, flat)


def _write(arrays, structure, m):
    return [ta.write(m, t) for ta, t in zip(arrays, tf.nest.flatten(structure))]


def _concat(arrays, specs):
    flat = []
    for ta, spec in zip(arrays, _flat_specs(specs)):
        t = ta.concat()
        t.set_shape(tf.TensorShape([None]).concatenate(spec.shape[1:]))
        flat.append(t)
    return tf.nest.pack_sequence_as(specs, flat)


class LoopPipeline(engine.Pipeline):
    """`engine.Pipeline` whose steps are a `tf.while_loop` over clock ticks.

    Same arguments as `engine.Pipeline`; the config's recompute must be
    "always". `train` and `forward` take the same `tfpipe.microbatch.Batch`.
    """

    def __init__(self, stages, devices, config, enforce_order=True):
        recompute_lib.resolve(config.recompute, "loop")  # raises unless "always"
        super().__init__(stages, devices, config, enforce_order)

    # -- tables ------------------------------------------------------------

    def _branches(self):
        """Per device, the (kind, stage) of switch branches 1.. (0 is idle)."""
        table = [[] for _ in self.devices]
        for k, d in enumerate(self.stage_device):
            table[d] += [("F", k), ("B", k)]
        return table

    def _tick_tables(self, ticks):
        branches = self._branches()
        codes = [[0 if a is None else 1 + branches[d].index((a.kind, a.stage))
                  for d, a in enumerate(row)] for row in ticks]
        mbs = [[0 if a is None else a.microbatch for a in row] for row in ticks]
        return tf.constant(codes, tf.int32), tf.constant(mbs, tf.int32), branches

    # -- training ------------------------------------------------------

    def train(self, batch, split, scale_loss=None, timeline=None):
        """One step's forward and backward as a while loop over clock ticks.

        Same arguments and result as `engine.Pipeline.train` (no timeline).
        """
        if timeline is not None:
            raise ValueError("The loop form records no timeline; record the unrolled form.")
        m_count, k_count, d_count = batch.num_microbatches, self.num_stages, len(self.devices)
        recorder = batchnorm.Recorder(
            self.stages, self.config.batch_norm == "deferred" and m_count > 1)
        interfaces = self.probe(batch, True, split, connectivity=True,
                                around_stage=recorder.forward)
        ticks = schedules.clock_ticks(self.schedule, m_count, d_count)
        forwards_first = self.forwards_first(
            [(d, a) for row in ticks for d, a in enumerate(row) if a is not None])
        plan = loss_lib.Plan(split, batch.split.num_rows, forwards_first,
                             any(i.call_losses for i in interfaces))
        scale = tf.cast((scale_loss or (lambda v: v))(tf.constant(1.0)), tf.float32)
        codes, mbs, branches = self._tick_tables(ticks)
        variables, stage_vars, _ = self.variable_table()
        # Which stage variables and inputs get a gradient: from the traced probe.
        connected_vars = [[variables[i] for i, c in zip(stage_vars[k],
                                                        interfaces[k].variables_connected) if c]
                          for k in range(k_count)]
        bn_before = recorder.before_step()
        n_terms = len(split.terms)
        var_index = {id(v): i for i, v in enumerate(variables)}

        def connected_specs(k):
            """Specs of the float leaves of boundary k that the loss reaches."""
            floats = [s for s in _flat_specs(interfaces[k].specs)
                      if isinstance(s, tf.TensorSpec) and s.dtype.is_floating]
            return [s for s, c in zip(floats, interfaces[k + 1].inputs_connected) if c]

        def grad_arrays(k):
            return [_array(s, m_count) for s in connected_specs(k)]

        # Per device, the variables its stages' backward passes add to.
        device_vars = [[] for _ in range(d_count)]
        slots = [{} for _ in range(d_count)]  # device -> variable index -> _GradientSlot
        for k in range(k_count):
            d = self.stage_device[k]
            for v, c, sparse in zip(self.stages[k].trainable_variables,
                                    interfaces[k].variables_connected,
                                    interfaces[k].variables_sparse):
                i = var_index[id(v)]
                if not c:
                    continue
                if i not in slots[d]:
                    device_vars[d].append(i)
                    slots[d][i] = _GradientSlot(v, m_count)
                slots[d][i].add_user(k, sparse)

        def bn_arrays(k):
            return [tf.TensorArray(t.dtype, size=m_count, element_shape=t.shape)
                    for c in interfaces[k].recorded for t in (c.count, c.mean, c.variance)]

        state = {
            "acts": [[_array(s, m_count) for s in _flat_specs(interfaces[k - 1].specs)]
                     if k else [] for k in range(k_count)],
            "outs": [_array(s, m_count) for s in _flat_specs(interfaces[-1].specs)],
            "seeds": [[tf.TensorArray(v.dtype, size=m_count, element_shape=v.shape,
                                      clear_after_read=False)
                       for v in self.stage_states[k].seed_variables()] for k in range(k_count)],
            "gin": [grad_arrays(k) for k in range(k_count - 1)],
            "bn": [bn_arrays(k) for k in range(k_count)],
            "grads": [[slots[d][i].initial() for i in device_vars[d]] for d in range(d_count)],
            "extra": [tf.zeros((), tf.float32) for _ in range(d_count)],
            "num": [tf.zeros((), tf.float32) for _ in range(n_terms)],
            "div": [tf.zeros((), tf.float32) for _ in range(n_terms)],
        }

        def read_input(st, k, m):
            """Stage k's input boundary for micro-batch m (stage 0: the inputs)."""
            if k == 0:
                return batch.micro(m)[0]
            return _read(st["acts"][k], interfaces[k - 1].specs, m)

        def forward_fn(k, m, packed):
            return engine.StageForward(self, k, packed, interfaces[k - 1] if k else None,
                                   k == k_count - 1, split, batch, m)

        def forward_branch(st, d, k, m):
            st = _copy(st)
            packed = read_input(st, k, m)
            st["seeds"][k] = [ta.write(m, s) for ta, s in
                              zip(st["seeds"][k], self.stage_states[k].snapshot_seeds())]
            with recorder.forward(k, batch.split.real(m)) as calls:
                out, extra, parts = forward_fn(k, m, packed)()
            if calls:
                st["bn"][k] = [ta.write(m, t) for ta, t in zip(
                    st["bn"][k], [t for c in calls for t in (c.count, c.mean, c.variance)])]
            out_packed = boundary.pack(out, interfaces[k])
            if k < k_count - 1:
                st["acts"][k + 1] = _write(st["acts"][k + 1], out_packed, m)
            else:
                st["outs"] = _write(st["outs"], batch.split.keep_real(out_packed, m), m)
                st["num"] = [acc + tf.cast(s, tf.float32) for acc, (s, _, _) in zip(st["num"], parts)]
                st["div"] = [acc if dp is None else acc + tf.cast(dp, tf.float32)
                             for acc, (_, dp, _) in zip(st["div"], parts)]
            if extra is not None:
                st["extra"][d] = st["extra"][d] + extra * batch.split.fraction(m)
            return st

        def backward_branch(st, d, k, m):
            st = _copy(st)
            packed = read_input(st, k, m)
            seeds_state = [ta.read(m) for ta in st["seeds"][k]]
            run = forward_fn(k, m, packed)

            def replay():
                with tf.GradientTape() as tape:
                    tape.watch(engine.float_leaves(packed) if k else [])
                    result = run()
                return tape, result

            tape, (out, extra, parts) = self.stage_states[k].replay(seeds_state, replay)
            sources = engine.float_leaves(packed) if k else []
            if k == k_count - 1:
                targets = [s for s, _, _ in parts]
                seeds = [s * scale for s in plan.seeds(
                    [acc if t.kind == loss_lib.COUNTED else None
                     for acc, t in zip(st["div"], split.terms)])]
            else:
                outs = engine.float_leaves(boundary.pack(out, interfaces[k]))
                connected = interfaces[k + 1].inputs_connected
                targets = [t for t, c in zip(outs, connected) if c]
                seeds = []
                for ta, spec in zip(st["gin"][k], connected_specs(k)):
                    g = ta.read(m)
                    g.set_shape(spec.shape)
                    seeds.append(g)
            if extra is not None:
                targets.append(extra)
                seeds.append(tf.cast(batch.split.fraction(m) * scale, extra.dtype))
            wanted = connected_vars[k]
            grads = (tape.gradient(targets, sources + wanted, output_gradients=seeds,
                                   unconnected_gradients=tf.UnconnectedGradients.ZERO)
                     if targets else [tf.zeros_like(t) for t in sources + wanted])
            st["grads"][d] = list(st["grads"][d])
            for v, g in zip(wanted, grads[len(sources):]):
                i = var_index[id(v)]
                j = device_vars[d].index(i)
                st["grads"][d][j] = slots[d][i].add(st["grads"][d][j], g, k, m)
            if k > 0:
                in_connected = interfaces[k].inputs_connected
                st["gin"][k - 1] = [ta.write(m, g) for ta, g in zip(
                    st["gin"][k - 1],
                    [g for g, c in zip(grads[:len(sources)], in_connected) if c])]
            return st

        owned = [self._owned_keys(d, n_terms) for d in range(d_count)]

        def run(kind, st, d, k, m):
            return (forward_branch if kind == "F" else backward_branch)(st, d, k, m)

        state = self._run_ticks(len(ticks), codes, mbs, branches, owned, run, state)

        grads = [None] * len(variables)
        for d in range(d_count):
            for j, i in enumerate(device_vars[d]):
                grads[i] = self.on_home(variables[i], gradients_lib.add_gradients, grads[i],
                                         slots[d][i].result(state["grads"][d][j]))
        divisor_sums = [acc if t.kind == loss_lib.COUNTED else None
                        for acc, t in zip(state["div"], split.terms)]
        final_scale = plan.final_scale(divisor_sums)
        if final_scale is not None:
            grads = [self.on_home(v, gradients_lib.scale_gradient, g, final_scale)
                     for v, g in zip(variables, grads)]
        reg_total = self.add_regularization(variables, grads, scale)
        sites = []
        for k in range(k_count):
            stacked = [ta.stack() for ta in state["bn"][k]]
            sites.append([(c.layer,) + tuple(stacked[3 * i:3 * i + 3])
                          for i, c in enumerate(interfaces[k].recorded or [])])
        bn_ops = self.commit_batch_norm(recorder, bn_before, sites, batch)
        with tf.device(self.devices[self.stage_device[-1]]):
            data_loss, term_values = plan.values(state["num"], divisor_sums)
            parts = [data_loss] + state["extra"] + ([reg_total] if reg_total is not None else [])
            loss = tf.add_n(parts)
            y_pred = boundary.unpack(_concat(state["outs"], interfaces[-1].specs), interfaces[-1])
        if bn_ops:
            with tf.control_dependencies(bn_ops):
                loss = tf.identity(loss)
        return engine.StepResult(y_pred, loss, term_values, grads)

    def _run_ticks(self, num_ticks, codes, mbs, branches, owned, run, state):
        """The while loop: at tick t, device d runs branch codes[t, d] on mbs[t, d].

        Args:
          codes, mbs: (T, D) int32 tables (`_tick_tables`).
          branches: per device, the (kind, stage) of branches 1, 2, ...
          owned: per device, the state keys its actions write (`_owned_keys`).
          run: `run(kind, state, d, k, m)` -> the state after the action.
          state: the loop state (a dict of lists of TensorArrays and tensors).
        Returns:
          The state after the last tick.
        """

        def body(t, st):
            new = _copy(st)
            for d in range(len(self.devices)):
                m = mbs[t, d]
                fns = [lambda st=st, d=d: _select(st, owned[d])]  # idle
                for kind, k in branches[d]:
                    fns.append(lambda st=st, d=d, k=k, m=m, kind=kind:
                               _select(self._on(d, run, kind, st, d, k, m), owned[d]))
                with tf.device(self.devices[d]):
                    result = tf.switch_case(codes[t, d], fns)
                _assign(new, owned[d], result)
            return t + 1, new

        # One tick at a time: an action reads only what earlier ticks wrote.
        _, state = tf.while_loop(lambda t, st: t < num_ticks, body, (tf.constant(0), state),
                                 parallel_iterations=1)
        return state

    def _on(self, d, fn, *args):
        with tf.device(self.devices[d]):
            return fn(*args)

    def _owned_keys(self, d, n_terms):
        """The state entries device d's actions write: (key, index) pairs."""
        keys = [("extra", d), ("grads", d)]
        for k, home in enumerate(self.stage_device):
            if home != d:
                continue
            keys += [("seeds", k), ("gin", k - 1) if k else None, ("bn", k)]
            if k < self.num_stages - 1:
                keys.append(("acts", k + 1))
            else:
                keys += [("outs", None)] + [("num", j) for j in range(n_terms)] + \
                        [("div", j) for j in range(n_terms)]
        return [key for key in keys if key is not None]

    # -- forward only (evaluate / predict) ---------------------------------

    def forward(self, batch, training=False):
        """The schedule's forward actions as a while loop over clock ticks.

        Same arguments and result as `engine.Pipeline.forward`.
        """
        m_count, k_count, d_count = batch.num_microbatches, self.num_stages, len(self.devices)
        interfaces = self.probe(batch, training)
        ticks = schedules.clock_ticks(self.schedule, m_count, d_count, forward_only=True)
        codes, mbs, branches = self._tick_tables(ticks)
        state = {
            "acts": [[_array(s, m_count) for s in _flat_specs(interfaces[k - 1].specs)]
                     if k else [] for k in range(k_count + 1)],
            "extra": [tf.zeros((), tf.float32) for _ in range(d_count)],
        }
        owned = []
        for d in range(d_count):
            keys = [("extra", d)] + [("acts", k + 1) for k, home in enumerate(self.stage_device)
                                     if home == d]
            owned.append(keys)

        def step(st, d, k, m):
            st = _copy(st)
            if k == 0:
                h = batch.micro(m)[0]
            else:
                h = boundary.unpack(_read(st["acts"][k], interfaces[k - 1].specs, m),
                                    interfaces[k - 1])
            out, extra = self.call_stage(k, h, training)
            out_packed = boundary.pack(out, interfaces[k])
            if k == k_count - 1:
                out_packed = batch.split.keep_real(out_packed, m)
            st["acts"][k + 1] = _write(st["acts"][k + 1], out_packed, m)
            if extra is not None:
                st["extra"][d] = st["extra"][d] + extra * batch.split.fraction(m)
            return st

        def run(kind, st, d, k, m):
            del kind  # a forward-only table has no B actions
            return step(st, d, k, m)

        state = self._run_ticks(len(ticks), codes, mbs, branches, owned, run, state)
        with tf.device(self.devices[self.stage_device[-1]]):
            y_pred = boundary.unpack(_concat(state["acts"][k_count], interfaces[-1].specs),
                                     interfaces[-1])
        extras = [i.call_losses for i in interfaces]
        return y_pred, (tf.add_n(state["extra"]) if any(extras) else None)


class _GradientSlot:
    """One device's running gradient of one variable over micro-batches.

    Dense gradients are summed. Embedding gradients (IndexedSlices, one row
    per lookup) are kept as they come, each micro-batch's rows written to a
    TensorArray and concatenated at the end: exactly the slices full-batch
    training hands the optimizer (Keras' Adam treats repeated rows of
    IndexedSlices differently from their sum, so densifying is not exact).
    """

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


# -- small helpers over the nested state ---------------------------------------


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
