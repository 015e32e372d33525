"""Per-unit costs of a model, measured once on sample batches.

`measure` runs the model's own layers (`tfpipe.graph` units) on sample
batches in training mode and puts every variable back. Per unit it gives what
`tfpipe.partition` and `tfpipe.planner` read: parameter and output bytes,
what its backward keeps, and forward and backward times as fixed + per-row.
"""

import dataclasses
import time

import numpy as np
import tensorflow as tf

from tfpipe import graph as graph_lib

DEFAULT_SAMPLE_BATCH = 8


@dataclasses.dataclass
class UnitCost:
    """What was measured of one unit (bytes at the first sample's rows).

    Attributes:
      name: the unit's layer or op name.
      params, param_bytes, trainable_bytes: of the weights it owns (first use).
      output_bytes: of its outputs.
      saved_internal: bytes its backward keeps of tensors made inside it.
      saved_ids: graph tensors (its inputs or outputs) its backward keeps.
      workspace_bytes: gradients alive during its backward.
      forward, backward: seconds = a + b * rows, as (a, b); (0, 0) untimed.
    """

    name: str
    params: int
    param_bytes: int
    trainable_bytes: int
    output_bytes: int
    saved_internal: int = 0
    saved_ids: frozenset = frozenset()
    workspace_bytes: int = 0
    forward: tuple = (0.0, 0.0)
    backward: tuple = (0.0, 0.0)

    def seconds(self, rows):
        """Forward + backward seconds at `rows` rows."""
        return self.forward[0] + self.backward[0] + (self.forward[1] + self.backward[1]) * rows


def sample_batch(model_or_graph, batch_size=DEFAULT_SAMPLE_BATCH, seed=0):
    """A random batch shaped like the model's inputs (floats ~ N(0, 1), ints 0)."""
    graph = graph_lib.as_graph(model_or_graph)
    rng = np.random.default_rng(seed)

    def make(ref):
        shape, dtype = graph.specs[ref.id]
        if shape is None or any(d is None for d in shape[1:]):
            raise ValueError(
                f"Cannot make a sample batch for {graph.model.name!r}: input shape "
                f"{shape} is not fully known. Pass sample=<a batch of inputs>.")
        shape = (batch_size,) + tuple(shape[1:])
        if "float" in dtype:
            return tf.constant(rng.normal(size=shape).astype(dtype))
        return tf.zeros(shape, dtype)

    return graph_lib.map_template(make, graph.inputs)


def _env(graph, sample):
    """(unit, op inputs env) pairs on `sample`, running the model's own layers."""
    template = graph.inputs
    if isinstance(template, list) and len(template) == 1 and not isinstance(sample, (list, tuple)):
        sample = [sample]
    flat = graph_lib.flatten_like(template, sample, f"sample for {graph.model.name!r}")
    ids = graph_lib.refs(template)
    env = {}
    for i, x in zip(ids, flat):
        dtype = graph.specs[i][1] or "float32"
        env[i] = tf.cast(tf.convert_to_tensor(x), dtype)
    return env


class KeepState:
    """Puts every variable of `variables` back as it was on leaving the block."""

    def __init__(self, variables):
        self.variables = list(variables)

    def __enter__(self):
        self.saved = [v.numpy() for v in self.variables]
        return self

    def __exit__(self, *exc):
        for var, value in zip(self.variables, self.saved):
            var.assign(value)


def _nbytes(t):
    shape = getattr(t, "shape", None)
    if shape is None or shape.num_elements() is None:
        return 0
    return int(shape.num_elements()) * tf.as_dtype(t.dtype).size


def _unit_functions(unit, env, times=True):
    """(forward (None without `times`), forward + backward) concrete functions of `unit` on `env`,
    what the backward keeps (internal bytes, kept input/output ids) and the
    largest tensor the backward makes (bytes)."""
    input_ids = unit.inputs
    floats = [i for i in input_ids if env[i].dtype.is_floating]
    weights = list(getattr(unit.op, "trainable_variables", []))
    traced = {}

    def run(*inputs):
        local = dict(env)
        local.update(zip(input_ids, inputs))
        out = graph_lib.call_unit(unit.op, unit.args, unit.kwargs, local, True)
        return [o for o in tf.nest.flatten(out) if o is not None]

    def forward(*inputs):
        return run(*inputs)

    def forward_backward(*inputs_and_seeds):
        inputs = inputs_and_seeds[:len(input_ids)]
        with tf.GradientTape() as tape:
            tape.watch([x for i, x in zip(input_ids, inputs) if i in floats])
            outs = run(*inputs)
        graph = tf.compat.v1.get_default_graph()
        traced["forward_ops"] = set(graph.get_operations())
        traced["inputs"], traced["outputs"] = list(inputs), outs
        float_outs = [o for o in outs if o.dtype.is_floating]
        seeds = inputs_and_seeds[len(input_ids):]
        sources = [x for i, x in zip(input_ids, inputs) if i in floats] + weights
        if not float_outs or not sources:
            return []
        grads = tape.gradient(float_outs, sources, output_gradients=list(seeds))
        return [g for g in grads if g is not None]

    specs = [tf.TensorSpec(env[i].shape, env[i].dtype) for i in input_ids]
    probe = run(*[env[i] for i in input_ids])
    seeds = [tf.TensorSpec(o.shape, o.dtype) for o in probe if o.dtype.is_floating]
    f = tf.function(forward).get_concrete_function(*specs) if times else None
    fb = tf.function(forward_backward).get_concrete_function(*specs, *seeds)
    forward_ops = traced["forward_ops"]
    by_tensor = {}
    for i, x in zip(input_ids, traced["inputs"]):
        by_tensor[x.ref()] = i
    outs_flat = traced["outputs"]
    out_ids = list(unit.outputs)
    for i, o in zip(out_ids, outs_flat):
        by_tensor.setdefault(o.ref(), i)
    internal, kept, largest = 0, set(), 0
    seen = set()
    for op in fb.graph.get_operations():
        if op in forward_ops:
            continue
        largest = max([largest] + [_nbytes(t) for t in op.outputs if t.dtype.is_floating])
        for t in op.inputs:
            if t.ref() in seen or not t.dtype.is_floating:
                continue
            if t.op not in forward_ops or t.op.type in ("ReadVariableOp", "Const"):
                continue
            if t.op.type == "Placeholder" and t.ref() not in by_tensor:
                continue  # an output-gradient seed or a captured value
            seen.add(t.ref())
            if t.ref() in by_tensor:
                kept.add(by_tensor[t.ref()])
            else:
                internal += _nbytes(t)
    return f, fb, internal, frozenset(kept), largest


def _best_time(fn, args, repeats, overhead=0.0):
    """The fastest of `repeats` timed calls of `fn(*args)` (seconds, after a
    warm-up call), less `overhead` (`_call_overhead`), at least 0."""
    fn(*args)  # one warm-up run: first-call setup
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        out = tf.nest.flatten(fn(*args), expand_composites=True)
        if out:
            out[0].numpy()  # wait for it (an IndexedSlices gradient: its values)
        best = min(best, time.perf_counter() - start)
    return max(best - overhead, 0.0)


def _call_overhead(repeats):
    """Seconds of one eager call of a traced function and the wait for its
    result, measured on an identity function. Each unit is timed as such a
    call, but a step runs every unit inside one traced program, so this is
    taken off each unit's times: left in, a stage's predicted time counted
    it once per unit (the 8-block transformer LM: 11 units, 0.25-0.33 ms
    each on a 2-core EPYC)."""
    identity = tf.function(tf.identity).get_concrete_function(tf.TensorSpec((), tf.float32))
    return _best_time(identity, [tf.constant(0.0)], max(5, repeats))


def measure(model_or_graph, samples, repeats=2, times=True, backward=True):
    """Measures every unit of a model on one or more sample batches.

    `model_or_graph`: a Keras model or its `tfpipe.graph.Graph`; `samples`:
    input batches (bytes at the first's rows, times fitted over all); with
    `times` (needs `backward`), the fastest of `repeats` runs. Returns (a
    `UnitCost` per unit, {graph tensor id: bytes at the first's rows}).
    """
    graph = graph_lib.as_graph(model_or_graph)
    owner, units = set(), []
    overhead = _call_overhead(repeats) if times and backward else 0.0
    with KeepState(graph.model.variables):
        envs = [graph_lib.run_units(graph.units, _env(graph, s), True) for s in samples]
        rows = [rows_of(s) for s in samples]
        tensor_bytes = {i: _nbytes(t) for i, t in envs[0].items()}
        for unit in graph.units:
            weights = [w for w in getattr(unit.op, "weights", []) if id(w) not in owner]
            owner.update(id(w) for w in weights)
            nbytes = [int(np.prod(w.shape)) * tf.as_dtype(w.dtype).size for w in weights]
            cost = UnitCost(
                name=getattr(unit.op, "name", type(unit.op).__name__),
                params=sum(int(np.prod(w.shape)) for w in weights), param_bytes=sum(nbytes),
                trainable_bytes=sum(n for w, n in zip(weights, nbytes)
                                    if getattr(w, "trainable", False)),
                output_bytes=sum(tensor_bytes.get(i, 0) for i in unit.outputs))
            if backward:
                _measure_backward(unit, envs, rows, tensor_bytes, repeats, times, cost, overhead)
            units.append(cost)
    return units, tensor_bytes


def rows_of(sample):
    """The batch size (rows) of a sample batch: its first leaf's first dimension."""
    leaf = next(t for t in tf.nest.flatten(sample) if t is not None)
    return int(np.shape(leaf)[0])


def _measure_backward(unit, envs, rows, tensor_bytes, repeats, times, cost, overhead):
    """Fills `cost`'s stash and workspace, and with `times` its times less
    one call's `overhead` (seconds), from the unit's traced functions."""
    points = []
    for r, env in zip(rows, envs):
        f, fb, internal, kept, largest = _unit_functions(unit, env, times)
        if not points:
            # Its backward holds the gradients of its outputs and of its inputs
            # and, at most, one more gradient of its own size (ReLU's, say).
            io = sum(tensor_bytes.get(i, 0) for i in unit.inputs + unit.outputs
                     if env[i].dtype.is_floating)
            cost.saved_internal, cost.saved_ids = internal, kept
            cost.workspace_bytes = io + largest
        if not times:
            return
        args = [env[i] for i in unit.inputs]
        seeds = [tf.ones_like(o) for o in f(*args) if o.dtype.is_floating]
        t_f = _best_time(f, args, repeats, overhead)
        t_fb = _best_time(fb, args + seeds, repeats, overhead)
        points.append((r, t_f, max(t_fb - t_f, 0.0)))
    cost.forward = _affine([(r, a) for r, a, _ in points])
    cost.backward = _affine([(r, b) for r, _, b in points])


def _affine(points):
    """(a, b) >= 0 with time = a + b * rows through one or two (rows, time) points."""
    if len(points) == 1:
        r, t = points[0]
        return 0.0, t / r
    (r1, t1), (r2, t2) = sorted(points)
    b = max((t2 - t1) / (r2 - r1), 0.0)
    a = max(t2 - b * r2, 0.0)
    return a, b
