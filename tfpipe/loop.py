"""The loop form: a schedule run as one `tf.while_loop` over clock ticks.

The unrolled engine (`tfpipe.engine`) traces every action, so its graph and
trace time grow with M. Here the schedule becomes a constant (T, D) table of
branch codes and micro-batch indices (`tfpipe.schedules.clock_ticks`); the
loop body runs, for each device d under `tf.device`, a `tf.switch_case` over
d's possible actions (idle, F of each of its stages, B of each). The body is
traced once, whatever M is.

State carried from tick to tick (all written once per micro-batch):
  acts[k]   stage k's input for every micro-batch (k >= 1)     TensorArrays
  outs      the last stage's output per micro-batch            TensorArrays
  seeds[k]  stage k's RNG state before each micro-batch's F    TensorArrays
  gin[k]    d loss / d (stage k's output) per micro-batch      TensorArrays
  grads[k]  stage k's gradients summed over micro-batches      dense tensors
  loss[d]   loss terms added on device d                       scalar

A tick is a barrier: the loop runs its iterations one at a time, and an
action only reads what earlier ticks wrote (the table guarantees it), so each
device runs its actions in the schedule's order.

Memory: only stage inputs are kept (every B recomputes its stage's forward),
so this form is `recompute="always"`; a B replays the stage with the seeds
its F used, so dropout masks match. Embedding (IndexedSlices) gradients are
accumulated densely.
"""

import keras
import tensorflow as tf

from tfpipe import engine
from tfpipe import recompute as recompute_lib
from tfpipe import schedules


class _Spec:
    """Shape (batch None) and dtype of one tensor between stages; a nest leaf."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tf.TensorShape(shape), tf.as_dtype(dtype)

    def __iter__(self):  # `shape, dtype = spec`; not a nest: tf.nest sees a leaf
        return iter((self.shape, self.dtype))


def _spec_of(t):
    """The `_Spec` of a per-micro-batch tensor or KerasTensor."""
    shape = tf.TensorShape(t.shape)
    return _Spec(tf.TensorShape([None]).concatenate(shape[1:]), t.dtype)


class LoopPipeline(engine.Pipeline):
    """`engine.Pipeline` whose steps are a `tf.while_loop` over clock ticks.

    Same arguments as `engine.Pipeline`; `recompute` must be "always".
    `train` and `forward` take and return micro-batches stacked on a new
    leading axis: each input leaf has shape (M, b, ...).
    """

    def __init__(self, stages, devices, schedule, recompute="always", enforce_order=True):
        recompute = recompute_lib.resolve(recompute, "loop")  # raises unless "always"
        super().__init__(stages, devices, schedule, recompute, enforce_order)
        self._connected = None

    # -- shapes of the tensors between stages ----------------------------

    def _boundary_specs(self, stacked_inputs):
        """specs[k]: nest of (shape, dtype) of stage k's input; specs[K]: output."""
        first = tf.nest.map_structure(lambda t: _spec_of(t[0]), stacked_inputs)
        specs = [first]
        h = tf.nest.map_structure(lambda s: keras.KerasTensor(s.shape, dtype=s.dtype.name),
                                  first)
        for stage in self.stages:
            h = stage.compute_output_spec(h)
            specs.append(tf.nest.map_structure(_spec_of, h))
        return specs

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

    def train(self, inputs, num_microbatches, loss_fn, loss_coefficient, scale_loss=None):
        """One step's forward and backward as a while loop over clock ticks.

        Args:
          inputs: nest of (M, b, ...) tensors: the micro-batches, stacked.
          num_microbatches: M (a Python int).
          loss_fn: `loss_fn(m, y_pred_m)` with m a scalar int32 tensor.
          loss_coefficient, scale_loss: as `engine.Pipeline.train`.
        Returns:
          (outputs, loss, grads): the last stage's outputs stacked (M, b, ...),
          the step loss, and K lists of gradients (None where unconnected).
        """
        scale_loss = scale_loss or (lambda v: v)
        m_count, k_count, d_count = num_microbatches, self.num_stages, len(self.devices)
        inv_m = 1.0 / m_count
        specs = self._boundary_specs(inputs)
        # Per stage, which trainable variables received a gradient when traced.
        self._connected = [[False] * len(s.trainable_variables) for s in self.stages]
        ticks = schedules.clock_ticks(self.schedule, m_count, d_count)
        codes, mbs, branches = self._tick_tables(ticks)

        def arrays(spec, float_only=False):
            return [tf.TensorArray(dtype, size=m_count, element_shape=shape,
                                   clear_after_read=False)
                    for shape, dtype in _flat_specs(spec)
                    if not float_only or dtype.is_floating]

        state = {
            "acts": [arrays(specs[k]) if k else [] for k in range(k_count)],
            "outs": arrays(specs[k_count]),
            "seeds": [[tf.TensorArray(v.dtype, size=m_count, element_shape=v.shape,
                                      clear_after_read=False)
                       for v in self._states[k]._seed_vars()]  # pylint: disable=protected-access
                      for k in range(k_count)],
            "gin": [arrays(specs[k + 1], float_only=True) for k in range(k_count)],
            "grads": [[tf.zeros(v.shape, v.dtype) for v in s.trainable_variables]
                      for s in self.stages],
            "loss": [tf.zeros((), tf.float32) for _ in range(d_count)],
        }

        def read_input(st, k, m):
            if k == 0:
                return tf.nest.map_structure(lambda t: tf.gather(t, m), inputs)
            flat = [ta.read(m) for ta in st["acts"][k]]
            for t, (shape, _) in zip(flat, _flat_specs(specs[k])):
                t.set_shape(shape)
            return _pack(specs[k], flat)

        def read_gin(st, k, m):
            flat = [ta.read(m) for ta in st["gin"][k]]
            shapes = [s for s, dtype in _flat_specs(specs[k + 1]) if dtype.is_floating]
            for t, shape in zip(flat, shapes):
                t.set_shape(shape)
            return flat

        def forward_branch(st, d, k, m):
            st = _copy(st)
            h = read_input(st, k, m)
            st["seeds"][k] = [ta.write(m, s) for ta, s in
                              zip(st["seeds"][k], self._states[k].snapshot_seeds())]
            if k < k_count - 1:
                out, extra = self._call(k, h, True)
                st["acts"][k + 1] = [ta.write(m, t) for ta, t in
                                     zip(st["acts"][k + 1], tf.nest.flatten(out))]
            else:
                out, extra = self._call(k, h, True)
                leaves = engine._float_leaves(out)  # pylint: disable=protected-access
                with tf.GradientTape() as loss_tape:
                    loss_tape.watch(leaves)
                    data_loss = loss_coefficient * tf.cast(loss_fn(m, out), tf.float32)
                    target = scale_loss(data_loss)
                g = loss_tape.gradient(target, leaves,
                                       unconnected_gradients=tf.UnconnectedGradients.ZERO)
                st["gin"][k] = [ta.write(m, t) for ta, t in zip(st["gin"][k], g)]
                st["outs"] = [ta.write(m, t) for ta, t in zip(st["outs"], tf.nest.flatten(out))]
                st["loss"][d] = st["loss"][d] + data_loss
            if extra is not None:
                st["loss"][d] = st["loss"][d] + extra * inv_m
            return st

        def backward_branch(st, d, k, m):
            st = _copy(st)
            h = read_input(st, k, m)
            g_out = read_gin(st, k, m)
            seeds = [ta.read(m) for ta in st["seeds"][k]]
            stage_vars = self.stages[k].trainable_variables

            def run():
                with tf.GradientTape() as tape:
                    tape.watch(engine._float_leaves(h))  # pylint: disable=protected-access
                    out, extra = self._call(k, h, True)
                    extra_target = None if extra is None else scale_loss(extra * inv_m)
                return tape, out, extra_target

            tape, out, extra_target = self._states[k].replay(seeds, run)
            sources = engine._float_leaves(h)  # pylint: disable=protected-access
            targets = engine._float_leaves(out)  # pylint: disable=protected-access
            seeds_grad = list(g_out)
            if extra_target is not None:
                targets.append(extra_target)
                seeds_grad.append(tf.ones_like(extra_target))
            all_grads = tape.gradient(targets, sources + list(stage_vars),
                                      output_gradients=seeds_grad,
                                      unconnected_gradients=tf.UnconnectedGradients.NONE)
            st["grads"][k] = list(st["grads"][k])
            for i, g in enumerate(all_grads[len(sources):]):
                if g is not None:
                    self._connected[k][i] = True
                    st["grads"][k][i] = st["grads"][k][i] + tf.convert_to_tensor(g)
            if k > 0:
                input_grads = [tf.zeros_like(s) if g is None else tf.convert_to_tensor(g)
                               for s, g in zip(sources, all_grads[: len(sources)])]
                st["gin"][k - 1] = [ta.write(m, g) for ta, g in
                                    zip(st["gin"][k - 1], input_grads)]
            return st

        owned = [self._owned_keys(d) for d in range(d_count)]

        def run(kind, st, d, k, m):
            return (forward_branch if kind == "F" else backward_branch)(st, d, k, m)

        state = self._run_ticks(len(ticks), codes, mbs, branches, owned, run, state)
        with tf.device(self.devices[self.stage_device[-1]]):
            outputs = _pack(specs[k_count], [ta.stack() for ta in state["outs"]])
        grads = [[g if self._connected[k][i] else None for i, g in enumerate(stage_grads)]
                 for k, stage_grads in enumerate(state["grads"])]
        return outputs, tf.add_n(state["loss"]), grads

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

    def _owned_keys(self, d):
        """The state entries device d's actions write: (key, index) pairs."""
        keys = [("loss", d)]
        for k, home in enumerate(self.stage_device):
            if home != d:
                continue
            keys += [("seeds", k), ("gin", k - 1) if k else None, ("grads", k)]
            if k < self.num_stages - 1:
                keys.append(("acts", k + 1))
            else:
                keys += [("outs", None), ("gin", k)]
        return [key for key in keys if key is not None]

    # -- forward only (evaluate / predict) ---------------------------------

    def forward(self, inputs, num_microbatches, training=False):
        """The schedule's forward actions as a while loop over clock ticks.

        Args:
          inputs: nest of (M, b, ...) stacked micro-batches.
        Returns:
          (outputs, extra_loss): the last stage's outputs stacked (M, b, ...)
          and the sum over micro-batches and stages of `layer.losses` / M.
        """
        m_count, k_count, d_count = num_microbatches, self.num_stages, len(self.devices)
        specs = self._boundary_specs(inputs)
        ticks = schedules.clock_ticks(self.schedule, m_count, d_count, forward_only=True)
        codes, mbs, branches = self._tick_tables(ticks)
        state = {
            "acts": [[tf.TensorArray(dtype, size=m_count, element_shape=shape)
                      for shape, dtype in _flat_specs(specs[k])] if k else []
                     for k in range(k_count + 1)],
            "loss": [tf.zeros((), tf.float32) for _ in range(d_count)],
        }
        owned = []
        for d in range(d_count):
            keys = [("loss", d)] + [("acts", k + 1) for k, home in enumerate(self.stage_device)
                                    if home == d]
            owned.append(keys)

        def step(st, d, k, m):
            st = _copy(st)
            if k == 0:
                h = tf.nest.map_structure(lambda t: tf.gather(t, m), inputs)
            else:
                flat = [ta.read(m) for ta in st["acts"][k]]
                for t, (shape, _) in zip(flat, _flat_specs(specs[k])):
                    t.set_shape(shape)
                h = _pack(specs[k], flat)
            out, extra = self._call(k, h, training)
            st["acts"][k + 1] = [ta.write(m, t) for ta, t in
                                 zip(st["acts"][k + 1], tf.nest.flatten(out))]
            if extra is not None:
                st["loss"][d] = st["loss"][d] + extra / m_count
            return st

        def run(kind, st, d, k, m):
            del kind  # a forward-only table has no B actions
            return step(st, d, k, m)

        state = self._run_ticks(len(ticks), codes, mbs, branches, owned, run, state)
        with tf.device(self.devices[self.stage_device[-1]]):
            outputs = _pack(specs[k_count], [ta.stack() for ta in state["acts"][k_count]])
        return outputs, tf.add_n(state["loss"])


# -- small helpers over the nested state ---------------------------------------


def _flat_specs(spec):
    return tf.nest.flatten(spec)


def _pack(spec, flat):
    return tf.nest.pack_sequence_as(spec, list(flat))


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
