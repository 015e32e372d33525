"""A Keras model as units: what `from_model` reads, and what `tfpipe.cutting` cuts.

A model is read as *units* in topological order: one per call of a layer or
raw op (`x + y` is in `model.operations`, not `model.layers`), nested models
inlined. A layer called at several nodes (a shared layer, a tied embedding)
becomes several units sharing that one object.
"""

import keras
import tensorflow as tf

from tfpipe import _internal


class Ref:
    """A placeholder for graph tensor number `id` inside a call template."""

    __slots__ = ("id",)

    def __init__(self, tensor_id):
        self.id = int(tensor_id)

    def __repr__(self):
        return f"Ref({self.id})"


def map_template(fn, template):
    """Applies `fn` to every leaf of a nest of lists, tuples and dicts."""
    if isinstance(template, (list, tuple)):
        return type(template)(map_template(fn, t) for t in template)
    if isinstance(template, dict):
        return {k: map_template(fn, v) for k, v in template.items()}
    return fn(template)


def refs(template):
    found = []
    map_template(lambda leaf: found.append(leaf.id) if isinstance(leaf, Ref) else None, template)
    return found


def fill(template, env):
    """`template` with every `Ref(i)` replaced by `env[i]`."""
    return map_template(lambda leaf: env[leaf.id] if isinstance(leaf, Ref) else leaf, template)


class Unit:
    """One call of `op`: positional and keyword templates, and output ids."""

    __slots__ = ("op", "args", "kwargs", "outputs")

    def __init__(self, op, args, kwargs, outputs):
        self.op, self.args, self.kwargs, self.outputs = op, args, kwargs, list(outputs)

    @property
    def inputs(self):
        """Ids of the graph tensors this call reads."""
        return refs((self.args, self.kwargs))

    def __repr__(self):
        name = getattr(self.op, "name", None)
        return f"Unit({name!r}, inputs={self.inputs}, outputs={self.outputs})"


def call_unit(op, args, kwargs, env, training):
    """Calls `op` as one unit records, on the tensors in `env`; returns its
    outputs. A `training` not None replaces the value recorded at that call."""
    args, kwargs = fill(args, env), fill(kwargs, env)
    if training is not None and "training" in _internal.call_context_args(op):
        kwargs["training"] = training
    return op(*args, **kwargs)


def run_units(units, env, training):
    """Calls each unit in order on the tensors in `env`, adding its outputs."""
    for unit in units:
        outputs = call_unit(unit.op, unit.args, unit.kwargs, env, training)
        flat = tf.nest.flatten(outputs)
        if len(flat) != len(unit.outputs):
            raise RuntimeError(
                f"tfpipe graph bug: {unit.op.name!r} returned {len(flat)} tensors, "
                f"expected {len(unit.outputs)}.")
        env.update(zip(unit.outputs, flat))
    return env


class Graph:
    """A model as units in topological order; `inputs`, `outputs`: structures
    of `Ref`s; `specs`, `names`, `kinds`: per tensor id its (shape, dtype),
    "layer" or "layer:i" name, and {"sparse"/"ragged": True}."""

    def __init__(self, model, units, inputs, outputs, specs, names, sequential, kinds=None):
        self.model, self.units, self.inputs, self.outputs = model, units, inputs, outputs
        self.specs, self.names, self.sequential = specs, names, sequential
        self.kinds = kinds or {}

    @property
    def input_shape(self):
        """Shapes of the model's inputs, in its input structure; None if unknown."""
        shapes = [self.specs[i][0] for i in refs(self.inputs)]
        if any(shape is None for shape in shapes):
            return None
        return map_template(lambda ref: self.specs[ref.id][0], self.inputs)

    @property
    def input_dtype(self):
        """Dtype of the model's first input."""
        return self.specs[refs(self.inputs)[0]][1]

    @property
    def input_names(self):
        """Names of the model's inputs (its `keras.Input`s), in flat order."""
        if self.sequential:
            return []
        return [getattr(t, "name", None) for t in tf.nest.flatten(self.model.input)]

    def standardize_inputs(self, x):
        """`x` as the model's input structure (a dict keyed by Input name put in order)."""
        template = self.inputs
        if not isinstance(x, dict) or isinstance(template, dict):
            return x
        names = self.input_names
        missing = [n for n in names if n not in x]
        if missing:
            raise ValueError(
                f"The inputs are a dict with keys {sorted(x)}, but model "
                f"{self.model.name!r} takes inputs named {names}; missing {missing}. "
                f"Key the dict by the keras.Input names, or pass a list in input order.")
        if isinstance(template, Ref):
            return x[names[0]]
        return type(template)(x[n] for n in names)

    @property
    def unit_name(self):
        """What a balance count counts, for messages."""
        return "layers" if self.sequential else "operations (layers and ops)"


def _is_functional(op):
    return isinstance(op, keras.Model) and hasattr(op, "operations") and hasattr(op, "outputs")


class _Reader:
    """Walks a functional model into `Unit`s; a nested model inlined twice gets fresh ids."""

    def __init__(self, model):
        self.model = model
        self.ids = {}        # id(KerasTensor) -> int, in the current scope
        self.specs, self.names = {}, {}
        self.kinds = {}      # tensor id -> {"sparse": True} or {"ragged": True}
        self.units = []

    def fresh_id(self, spec, name):
        i = len(self.specs)
        self.specs[i] = (tuple(spec.shape), keras.backend.standardize_dtype(spec.dtype))
        self.names[i] = name
        kind = {k: True for k in ("sparse", "ragged") if getattr(spec, k, False)}
        if kind:
            self.kinds[i] = kind
        return i

    def new_id(self, tensor, name):
        if id(tensor) not in self.ids:
            self.ids[id(tensor)] = self.fresh_id(tensor, name)
        return self.ids[id(tensor)]

    def template(self, structure, where):
        def leaf(x):
            if isinstance(x, keras.KerasTensor):
                if id(x) not in self.ids:
                    raise ValueError(
                        f"from_model: {where} uses a tensor that is not computed from "
                        f"the inputs of {self.model.name!r}; cannot cut this graph.")
                return Ref(self.ids[id(x)])
            return x
        return map_template(leaf, structure)

    def read_functional(self, fn):
        """Adds the units of functional `fn`; its inputs must already have ids."""
        for op, node in _nodes_in_order(fn):
            self.read_node(op, node)

    def read_node(self, op, node):
        args, kwargs = node.arguments.args, dict(node.arguments.kwargs)
        if ((_is_functional(op) or isinstance(op, keras.Sequential))
                and overriding_class(op, "call") is None):
            self.inline(op, node, args, kwargs)
            return
        template = self.template((args, kwargs), f"layer {op.name!r}")
        outputs = node.outputs
        names = [op.name] if len(outputs) == 1 else [f"{op.name}:{i}" for i in range(len(outputs))]
        out_ids = [self.fresh_id(t, n) for t, n in zip(outputs, names)]
        self.ids.update((id(t), i) for t, i in zip(outputs, out_ids))
        self.units.append(Unit(op, template[0], template[1], out_ids))

    def inline(self, sub, node, args, kwargs):
        inputs = args[0] if args else kwargs.pop("inputs", None)
        kwargs.pop("training", None)  # replaced by the stage's training flag, as Keras does
        # Keras records the mask it auto-fills (all None without one).
        if "mask" in kwargs and all(m is None for m in tf.nest.flatten(kwargs["mask"])):
            kwargs.pop("mask")
        if len(args) > 1 or kwargs:
            raise ValueError(
                f"from_model cannot inline the nested model {sub.name!r}: it is "
                f"called with extra arguments {sorted(kwargs) or list(args[1:])}. Call it "
                f"on its inputs only, or pass the stages explicitly.")
        outer = tf.nest.flatten(inputs)
        outer_ids = self.ids
        if isinstance(sub, keras.Sequential):
            layers = [l for l in sub.layers if not isinstance(l, keras.layers.InputLayer)]
            current = self.template(outer[0], f"nested model {sub.name!r}")
            for layer in layers:
                shape, dtype = self.specs[current.id]
                out = layer.compute_output_spec(keras.KerasTensor(shape, dtype))
                new = self.fresh_id(out, layer.name)
                self.units.append(Unit(layer, (current,), {}, [new]))
                current = Ref(new)
            final = [current.id]
        else:
            inner = tf.nest.flatten(sub.input)
            if len(inner) != len(outer):
                raise ValueError(
                    f"from_model: nested model {sub.name!r} takes {len(inner)} inputs, "
                    f"called with {len(outer)}.")
            scope = {}
            for i, o in zip(inner, outer):
                ref = self.template(o, f"nested model {sub.name!r}")
                if (len(i.shape) != len(o.shape)
                        or keras.backend.standardize_dtype(i.dtype)
                        != keras.backend.standardize_dtype(o.dtype)):
                    raise ValueError(
                        f"from_model cannot inline the nested model {sub.name!r}: input "
                        f"{i.name!r} is {i.dtype}{tuple(i.shape)} but receives "
                        f"{o.dtype}{tuple(o.shape)}.")
                scope[id(i)] = ref.id
            self.ids = scope
            try:
                self.read_functional(sub)
                final = [self.ids[id(t)] for t in tf.nest.flatten(sub.output)]
            finally:
                self.ids = outer_ids
        for tensor, tensor_id in zip(node.outputs, final):
            self.ids[id(tensor)] = tensor_id


def _nodes_in_order(fn):
    """The (operation, node) calls computing `fn`'s outputs, each after those
    making its inputs; ties keep `fn.operations`' order, then the node's."""
    input_ids = {id(t) for t in tf.nest.flatten(fn.input)}
    rank = {id(op): i for i, op in enumerate(fn.operations)}
    nodes, deps = {}, {}   # key -> (op, node); key -> keys it waits for
    stack = list(tf.nest.flatten(fn.output))
    seen = set()
    while stack:
        tensor = stack.pop()
        if id(tensor) in input_ids or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        op, node, index = _internal.producing_node(tensor)
        if op is None:
            raise ValueError(
                f"from_model: a tensor of {fn.name!r} has no Keras history; "
                f"only functional models built from keras.Input can be cut.")
        key = (rank.get(id(op), len(rank)), index, id(op))
        if key in nodes:
            continue
        nodes[key] = (op, node)
        deps[key] = []
        for t in node.arguments.keras_tensors:
            if id(t) in input_ids:
                continue
            p_op, _, p_index = _internal.producing_node(t)
            if p_op is not None:
                deps[key].append((rank.get(id(p_op), len(rank)), p_index, id(p_op)))
            stack.append(t)
    ordered, done = [], set()
    pending = sorted(nodes)
    while pending:
        for key in pending:
            if all(d in done or d not in nodes for d in deps[key]):
                ordered.append(key)
                done.add(key)
                pending.remove(key)
                break
        else:
            raise ValueError(f"from_model: the graph of {fn.name!r} has a cycle.")
    return [nodes[key] for key in ordered
            if not isinstance(nodes[key][0], keras.layers.InputLayer)]


def as_graph(model_or_graph):
    """`model_or_graph` if it is a `Graph`, else `model_graph(model_or_graph)`."""
    if isinstance(model_or_graph, Graph):
        return model_or_graph
    return model_graph(model_or_graph)


# The Keras hooks a PipelinedModel does not run (it runs its own step, the
# compiled loss split over micro-batches, and the model's graph layer by
# layer), each with the way out for a model whose class overrides it.
_EXTRA_TERM = ("move the extra work into the compiled loss (a custom loss function of "
               "y_true, y_pred), an add_loss() call in a layer, or a callback")
NOT_RUN_HOOKS = {
    "train_step": _EXTRA_TERM,
    "test_step": _EXTRA_TERM,
    "compute_loss": _EXTRA_TERM,
    "compute_metrics": "pass the metrics to compile(metrics=...) instead",
    "predict_step": ("post-process what predict() returns, or end the model with a layer "
                     "that does it"),
    "call": ("build what call() adds into the functional graph (from layers, or a custom "
             "layer holding that code)"),
}


def overriding_class(model, hook):
    """The first class of `model`'s type below `keras.Model` that defines
    `hook`, Keras' own classes (Sequential, Functional) aside; else None."""
    for cls in type(model).__mro__:
        if cls is keras.Model:
            return None
        if hook in vars(cls) and not cls.__module__.startswith("keras."):
            return cls
    return None


def check_hooks_run(model):
    """Raises ValueError if `model`'s class overrides a hook tfpipe would not
    run (`NOT_RUN_HOOKS`): training would silently differ from its own fit."""
    for hook, fix in NOT_RUN_HOOKS.items():
        cls = overriding_class(model, hook)
        if cls is not None:
            raise ValueError(
                f"{type(model).__name__} overrides {hook}() (in class {cls.__name__}), which "
                f"a PipelinedModel does not run: it runs its own step (the compiled loss, "
                f"split over micro-batches) over the model's layers, so what {hook}() does "
                f"would be silently lost. To pipeline it, {fix}; or train the plain model "
                f"without tfpipe.")


def _not_a_graph(model):
    """Why `model` cannot be read as a graph, and what to do instead."""
    name = type(model).__name__
    if not isinstance(model, keras.Model):
        return (f"from_model needs a keras.Sequential or functional keras.Model, got {name}, "
                f"which is not a model. Wrap it: keras.Sequential([...]), or pass stages: "
                f"tfpipe.PipelinedModel([stage_0, stage_1, ...]).")
    return (f"from_model needs a keras.Sequential or functional keras.Model, got {name}, a "
            f"subclassed model: its call() is Python code tfpipe cannot read or cut. Either "
            f"rebuild it as a functional model from its own layers (inputs = keras.Input(...); "
            f"h = net.layer_a(inputs); ...; keras.Model(inputs, outputs): the layers and their "
            f"weights are shared) and pass that to from_model, or write the stages yourself: "
            f"tfpipe.PipelinedModel([stage_0, stage_1, ...]), each a Keras layer or model "
            f"taking the previous stage's output (README, 'Subclassed models').")


def model_graph(model):
    """Reads a Sequential or functional `model` as a `Graph` of units.

    Refuses a model whose class overrides a hook tfpipe does not run
    (`check_hooks_run`). A nested model whose class overrides `call` is one
    unit (its call runs as written), not inlined."""
    if not (isinstance(model, keras.Sequential) or _is_functional(model)):
        raise ValueError(_not_a_graph(model))
    check_hooks_run(model)
    if isinstance(model, keras.Sequential):
        layers = list(model.layers)
        specs, names = {}, {}
        try:
            inputs = list(model.inputs)
        except (AttributeError, ValueError):
            inputs = []
        spec = ((tuple(inputs[0].shape), keras.backend.standardize_dtype(inputs[0].dtype))
                if len(inputs) == 1 else (None, "float32"))
        specs[0], names[0] = spec, "input"
        units = []
        for i, layer in enumerate(layers):
            specs[i + 1], names[i + 1] = (None, None), layer.name
            units.append(Unit(layer, (Ref(i),), {}, [i + 1]))
        return Graph(model, units, Ref(0), Ref(len(layers)), specs, names, True)
    reader = _Reader(model)
    inputs = map_template(lambda t: Ref(reader.new_id(t, t.name)), model.input)
    reader.read_functional(model)
    outputs = reader.template(model.output, "outputs")
    return Graph(model, reader.units, inputs, outputs, reader.specs, reader.names, False,
                 reader.kinds)


def flatten_like(template, structure, name="this stage"):
    """The parts of `structure` at `template`'s `Ref` leaves (dicts by key, lists in order)."""
    if isinstance(template, Ref):
        return [structure]
    if (isinstance(template, dict) and isinstance(structure, dict)
            and set(template) <= set(structure)):
        return [x for k in template for x in flatten_like(template[k], structure[k], name)]
    if (isinstance(template, (list, tuple)) and isinstance(structure, (list, tuple))
            and len(template) == len(structure)):
        return [x for t, v in zip(template, structure) for x in flatten_like(t, v, name)]
    raise ValueError(
        f"{name} was called with inputs structured as {_describe(structure)} but "
        f"takes {_describe(template)}.")


def _describe(structure):
    if isinstance(structure, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in structure.items()) + "}"
    if isinstance(structure, (list, tuple)) and not is_shape(structure):
        return "[" + ", ".join(_describe(v) for v in structure) + "]"
    return "tensor"


def is_shape(value):
    """Whether `value` is one shape: a tuple, list or `tf.TensorShape` of ints and Nones."""
    return isinstance(value, (tuple, list, tf.TensorShape)) and all(
        d is None or isinstance(d, int) for d in value)


def stage_chain(stages, input_shape, input_dtype, name):
    """(graph, units per stage) of hand-made stages taking one input of
    `input_shape` (batch dimension included), as one `keras.Sequential` of
    their layers: a Sequential stage unit by layer, another stage as one
    unit. None where the input is a nest of shapes."""
    if not is_shape(input_shape):
        return None
    layers, balance = [], []
    for stage in stages:
        parts = ([l for l in stage.layers if not isinstance(l, keras.layers.InputLayer)]
                 if isinstance(stage, keras.Sequential) else [stage])
        layers += parts
        balance.append(len(parts))
    chain = keras.Sequential([keras.Input(tuple(input_shape[1:]), dtype=input_dtype)] + layers,
                             name=name)
    return model_graph(chain), balance
