"""Cutting a model's graph (`tfpipe.graph`) into K contiguous stages.

`balance=[n0, n1, ...]` gives stage k the next `n_k` units, as a `GraphStage`
whose input is every tensor crossing into it and whose output every tensor a
later stage or the model's output needs (a skip passes through the stages in
between). The units call the user's own layer objects: nothing is copied.
"""

import keras

from tfpipe import _internal
from tfpipe import graph as graph_lib
from tfpipe import partition
from tfpipe.graph import Ref, fill, flatten_like, is_shape, refs, run_units


class Piece:
    """Stage k of a cut: its units, input template and output template."""

    def __init__(self, units, inputs, outputs):
        self.units, self.inputs, self.outputs = units, inputs, outputs


def _crossing(graph, balance):
    starts = [sum(balance[:k]) for k in range(len(balance))]
    stage_of = {}
    for k, (start, size) in enumerate(zip(starts, balance)):
        for unit in graph.units[start:start + size]:
            stage_of[id(unit)] = k
    made = {i: -1 for i in refs(graph.inputs)}
    last_use = {}
    for unit in graph.units:
        k = stage_of[id(unit)]
        for i in unit.outputs:
            made[i] = k
        for i in unit.inputs:
            last_use[i] = max(last_use.get(i, -1), k)
    for i in refs(graph.outputs):
        last_use[i] = len(balance)
    return [sorted(i for i, k in made.items() if k <= b < last_use.get(i, -1))
            for b in range(len(balance) - 1)], starts


def cut(graph, balance):
    """Cuts `graph` into `len(balance)` `Piece`s of `balance[k]` units each."""
    if sum(balance) != len(graph.units):
        raise ValueError(f"balance {balance} does not add up to {len(graph.units)} units.")
    crossing, starts = _crossing(graph, balance)

    def as_template(ids):
        return Ref(ids[0]) if len(ids) == 1 else [Ref(i) for i in ids]

    pieces = []
    for k, (start, size) in enumerate(zip(starts, balance)):
        inputs = graph.inputs if k == 0 else as_template(crossing[k - 1])
        outputs = graph.outputs if k == len(balance) - 1 else as_template(crossing[k])
        pieces.append(Piece(graph.units[start:start + size], inputs, outputs))
    return pieces


def boundaries(graph, balance):
    """Names of the tensors crossing each of the K - 1 cuts of `balance`."""
    crossing, _ = _crossing(graph, list(balance))
    return [[graph.names[i] for i in ids] for ids in crossing]


class Source:
    """The model `from_model` cut (its `graph`, `balance` per stage and how
    that was chosen, `method`), held out of Keras' layer tracking."""

    def __init__(self, model, graph, balance, method):
        self.model, self.graph, self.balance, self.method = model, graph, balance, method


def cut_model(model, balance, num_stages, sample=None):
    """`from_model`'s cut: (graph, balance, method, unbuilt stages) over <= `num_stages`."""
    graph = graph_lib.model_graph(model)
    balance, method = partition.choose_balance(graph, balance, num_stages, sample)
    return graph, balance, method, make_stages(graph, balance)


def make_stages(graph, balance):
    """Unbuilt stage layers (Sequentials or `GraphStage`s) holding the model's own layers."""
    stages = []
    for k, piece in enumerate(cut(graph, balance)):
        if graph.sequential:
            stages.append(keras.Sequential([u.op for u in piece.units], name=f"stage_{k}"))
            continue
        ids = refs(piece.inputs) + refs(piece.outputs)
        specs = {i: graph.specs[i] for i in ids}
        kinds = {i: graph.kinds[i] for i in ids if i in graph.kinds}
        stages.append(GraphStage(piece.units, piece.inputs, piece.outputs, specs,
                                 input_kinds=kinds, name=f"stage_{k}"))
    return stages


class GraphStage(keras.layers.Layer):
    """A contiguous piece of a functional graph run as one layer: `units` in
    call order, `inputs` and `outputs` templates (nests of `Ref`), and
    `input_specs` / `input_kinds` of its inputs (and known outputs)."""

    def __init__(self, units, inputs, outputs, input_specs, input_kinds=None, **kwargs):
        kwargs.setdefault("autocast", False)  # the layers inside cast for themselves
        super().__init__(**kwargs)
        operations, seen = [], set()
        for unit in units:
            if id(unit.op) not in seen:
                seen.add(id(unit.op))
                operations.append(unit.op)
        # Tracked by Keras (weights, saving); each layer once.
        self._operations = operations
        # Plain Python objects Keras does not track: how to wire the operations.
        self._program = _Program(
            list(units), inputs, outputs,
            {int(i): (tuple(s) if s is not None else None, d)
             for i, (s, d) in dict(input_specs).items()},
            dict(input_kinds or {}))

    @property
    def operations(self):
        """The distinct layers and raw ops of this stage, in first-call order."""
        return list(self._operations)

    @property
    def layers(self):
        """The Keras layers of this stage (raw ops excluded)."""
        return [op for op in self._operations if isinstance(op, keras.layers.Layer)]

    @property
    def input_ids(self):
        return refs(self._program.inputs)

    @property
    def output_ids(self):
        return refs(self._program.outputs)

    def _flatten_inputs(self, structure, leaf_is_shape=False):
        template = self._program.inputs
        is_leaf = is_shape(structure) if leaf_is_shape else not isinstance(
            structure, (list, tuple, dict))
        if isinstance(template, list) and len(template) == 1 and is_leaf:
            structure = [structure]
        return flatten_like(template, structure, self.name)

    def build(self, input_shape):
        if all(getattr(op, "built", True) for op in self._operations):
            self.built = True  # the model's own layers: built with the model
            return
        env = {}
        for i, shape in zip(self.input_ids, self._flatten_inputs(input_shape, leaf_is_shape=True)):
            env[i] = keras.KerasTensor(tuple(shape), dtype=self._program.specs[i][1],
                                       **self._program.kinds.get(i, {}))
        # Builds any unbuilt layer under the caller's tf.device.
        run_units(self._program.units, env, training=False)
        self.built = True

    def compute_output_spec(self, inputs, training=None):
        """The recorded output specs (Keras' dense placeholders break ragged inputs)."""
        program = self._program
        if not all(i in program.specs and program.specs[i][0] is not None
                   for i in self.output_ids):
            return super().compute_output_spec(inputs, training=training)
        return fill(program.outputs, {
            i: keras.KerasTensor(program.specs[i][0], dtype=program.specs[i][1],
                                 **program.kinds.get(i, {}))
            for i in self.output_ids})

    def call(self, inputs, training=None):
        env = {}
        for i, x in zip(self.input_ids, self._flatten_inputs(inputs)):
            shape, dtype = self._program.specs[i]
            if keras.backend.standardize_dtype(x.dtype) != dtype:
                mask = _internal.get_keras_mask(x)
                x = keras.ops.cast(x, dtype)  # as a functional model casts its inputs
                if mask is not None:
                    _internal.set_keras_mask(x, mask)
            if shape is not None and len(x.shape) == len(shape) + 1 and x.shape[-1] == 1:
                x = keras.ops.squeeze(x, axis=-1)
            elif shape is not None and len(x.shape) == len(shape) - 1 and shape[-1] == 1:
                x = keras.ops.expand_dims(x, axis=-1)
            env[i] = x
        run_units(self._program.units, env, training)
        return fill(self._program.outputs, env)


class _Program:
    """How a GraphStage wires its operations (kept out of Keras' tracking)."""

    def __init__(self, units, inputs, outputs, specs, kinds=None):
        self.units, self.inputs, self.outputs, self.specs = units, inputs, outputs, specs
        self.kinds = kinds or {}
