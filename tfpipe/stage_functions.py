"""A stage as traced functions, for execution="stage_functions": its forward
(`StageFunction`) and its replay with the whole backward (`StageBackward`),
each traced once per step trace and called by every action of the stage, so
the step's graph does not grow with the micro-batches. `runtime.Step` gives
a `tfpipe.stage.Stage` its two functions; the stage calls them.
"""

import tensorflow as tf

from tfpipe import _internal
from tfpipe import batchnorm
from tfpipe import boundary
from tfpipe import stage as stage_lib


class CalledFunction:
    """A stage's `tf.function`, not inlined (TF optimises its body once), and
    called through its concrete function once a call's argument types were
    seen: TF's own lookup and argument binding cost more than the call op."""

    def __init__(self, body, jit_compile=False):
        # jit_compile: the body is one XLA program (on the stage's own device).
        self.function = tf.function(body, autograph=False, reduce_retracing=True,
                                    jit_compile=jit_compile or None,
                                    experimental_attributes={"_noinline": True})
        self.concrete = {}  # argument types -> (concrete function, flat tensors in TF's order)

    def trace(self, *args):
        """Traces for `args` (tensors or `tf.TensorSpec`s) unless a trace fits."""
        return self.function.get_concrete_function(*args)

    def __call__(self, *args):
        leaves = tf.nest.flatten(args)
        key = _argument_types(leaves)
        if key is None:
            return self.function(*args)
        tensors = [t for t in leaves if isinstance(t, tf.Tensor)]
        if key not in self.concrete:
            concrete = self.function.get_concrete_function(*args)
            # Our order is checked against TF's binding once per argument types.
            theirs = _internal.concrete_inputs(concrete, args)
            self.concrete[key] = (concrete, len(theirs) == len(tensors) and all(
                a is b for a, b in zip(theirs, tensors)))
        concrete, flat = self.concrete[key]
        return _internal.call_concrete(concrete, tensors) if flat else concrete(*args)


def _argument_types(leaves):
    """A hashable key of what TF traces a call by (each leaf's shape and
    dtype, or Python value); None for other leaves (TF's lookup decides)."""
    key = []
    for leaf in leaves:
        if leaf is None or isinstance(leaf, (bool, int, float, str)):
            key.append((type(leaf), leaf))
        elif isinstance(leaf, tf.Tensor):
            key.append((tuple(leaf.shape.as_list()) if leaf.shape.rank is not None else None,
                        leaf.dtype))
        else:
            return None
    return tuple(key)


class StageFunction:
    """A stage's forward traced once per step trace and called per action; only
    tensors cross the call (masks, logits and BatchNorm layers reattached)."""

    def __init__(self, stage):
        self.stage = stage
        self.record = bool(stage.shared.split is not None and stage.recorder.layers)
        self.traced = {}  # per trace: the BatchNorm layers, and per_row of each part
        self.function = CalledFunction(self._traced_body, stage.shared.stage_xla)

    def _traced_body(self, packed, y_true, sample_weight, real):
        stage = self.stage
        # A function body does not inherit the caller's device scope.
        with stage.device.scope():
            out, extra, parts, moments = stage.body(packed, y_true, sample_weight, real,
                                                    self.record)
        self.traced.update(layers=[c.layer for c in moments], per_row=[p[2] for p in parts])
        return (boundary.pack(out, stage.shared.interfaces[stage.k]), extra,
                [p[:2] for p in parts], [(c.count, c.mean, c.variance) for c in moments])

    def __call__(self, packed, y_true, sample_weight, real):
        packed_out, extra, parts, moments = self.function(packed, y_true, sample_weight, real)
        out = boundary.unpack(packed_out, self.stage.shared.interfaces[self.stage.k])
        parts = [(s, d, per_row) for (s, d), per_row in zip(parts, self.traced["per_row"])]
        moments = [batchnorm.Moments(layer, *values)
                   for layer, values in zip(self.traced["layers"], moments)]
        return out, extra, parts, moments


class StageBackward:
    """A stage's replay and whole backward as one function call per backward
    action. It takes the incoming gradients (so it runs at backward time
    without a gate) and, per weight homed here with a dense gradient, its
    running sum (first a scalar zero: 0 + g is g exactly; traced for sums of
    any shape, so later calls do not retrace). A weight the stage's loss does
    not reach comes back None, as from the other executions, never as the
    zero it was given: `gradients.check_reached` decides what that means."""

    def __init__(self, stage):
        self.stage = stage
        self.sparse = set()  # positions in stage.variables with IndexedSlices gradients
        self.unconnected = set()  # positions whose gradient the tape left None
        self.traced_once = False
        self.zeros = {}  # dtype -> the zero a first weight gradient is added to
        self.function = CalledFunction(self._traced_body, stage.shared.stage_xla)

    def _traced_body(self, packed, seeds, y_true, sample_weight, real, g_out, extra_seed,
                     sums):
        stage = self.stage
        with stage.device.scope():
            tape, (out, extra, parts, _) = stage.state.replay(seeds, lambda: stage_lib.taped_run(
                stage.k, packed, lambda: stage.body(packed, y_true, sample_weight, real, False)))
            input_grads, grads = stage_lib.stage_gradients(
                stage, tape, packed, stage.pack(out), extra, parts, g_out, lambda: extra_seed)
            self.sparse |= {j for j, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)}
            self.unconnected |= {j for j, g in enumerate(grads) if g is None}
            grads = [g if s is None or isinstance(g, tf.IndexedSlices) else
                     s if g is None else _sum_like(s, g) for s, g in zip(sums, grads)]
        return input_grads, grads

    def __call__(self, kept, g_out, m, weight_sum):
        """(input gradients, per weight its gradient or new sum, whether each is a sum)."""
        stage = self.stage
        sums, first = [], set()  # first: positions given the zero, not a sum
        for j, i in enumerate(stage.indices):
            if not stage.homes[j] or j in self.sparse:
                sums.append(None)
                continue
            total = weight_sum(i)
            if total is None:
                first.add(j)
                dtype = stage.variables[j].dtype
                if dtype not in self.zeros:
                    self.zeros[dtype] = tf.zeros((), dtype)
                total = self.zeros[dtype]
            sums.append(total)
        y_true, sample_weight = stage.labels(m)
        extra_seed = (stage.extra_seed(m)() if stage.shared.interfaces[stage.k].call_losses
                      else None)
        args = (kept.packed, kept.seeds, y_true, sample_weight,
                stage.shared.batch.split.real(m), list(g_out), extra_seed)
        if not self.traced_once:
            # Traced for sums of any shape: the zeros now, the sums later.
            self.function.trace(
                *args, [None if s is None else tf.TensorSpec(None, s.dtype) for s in sums])
            self.traced_once = True
        input_grads, grads = self.function(*args, sums)
        # The body passed the zero through for an unreached weight: no gradient.
        grads = [None if j in first and j in self.unconnected else g
                 for j, g in enumerate(grads)]
        summed = [s is not None and j not in self.sparse and g is not None
                  for j, (s, g) in enumerate(zip(sums, grads))]
        return input_grads, grads, summed


def _sum_like(total, grad):
    """total + grad, with grad's static shape (`total` may be a scalar zero)."""
    out = total + grad
    out.set_shape(grad.shape)
    return out
