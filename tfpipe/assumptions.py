"""What micro-batching assumes of a model, checked on the model in hand.

A pipeline runs each stage's forward once per micro-batch (and again when it
recomputes), and adds each micro-batch's call losses weighted by its share of
the rows. That is plain Keras on the whole batch only if

1. the forward writes no variable (`variable_writes`, read from the stage's
   traced forward, function bodies included), except the two kinds tfpipe
   handles itself: BatchNormalization's moving statistics (`tfpipe.batchnorm`)
   and random seed states (a replay restores them). Any other write is exact
   only with one micro-batch and no replay of its stage (`check_writes`);
2. every call loss (`add_loss`, activity regularisers) is a mean over rows:
   its value on two micro-batches together equals the row-weighted mean of
   its values on each (`check_call_losses`, measured on real data).

Neither is decided by a list of known layers: a SpectralNormalization,
a stateful RNN or an MoE router loss is found by what it does.
"""

import re
import typing

import numpy as np
import tensorflow as tf

from tfpipe import _internal
from tfpipe import batchnorm
from tfpipe import microbatch

# Relative agreement a mean over rows reaches in float32 (sums in another order).
CALL_LOSS_RTOL = 1e-4


class Write(typing.NamedTuple):
    """A variable written by a stage's forward: the outermost layer of the
    stage holding it, its path, and the writing op's type."""
    layer: str
    variable: str
    op: str


def _is_write(op_type):
    # TF's primitive writes of a resource variable (and of a tf.random.Generator's state).
    return ((op_type.startswith("Assign") and op_type.endswith("VariableOp"))
            or op_type.startswith(("ResourceScatter", "ResourceApply", "ResourceSparseApply"))
            or op_type in ("ResourceStridedSliceAssign", "RngSkip", "RngReadAndSkip")
            or (op_type.startswith("Stateful") and "Call" not in op_type))


def _source(tensor, calls):
    """The tensor outside every traced function that the resource `tensor`
    passes on (a variable's eager handle), following pass-throughs, function
    arguments (`calls`: the (op, body) pairs entered) and captures."""
    for _ in range(256):
        if not tf.is_symbolic_tensor(tensor):
            return tensor
        op = tensor.op
        if op.type in ("Identity", "IdentityN"):
            tensor = op.inputs[tensor.value_index]
            continue
        if op.type != "Placeholder":
            return None
        graph = tensor.graph
        if calls and calls[-1][1] is graph:
            call_op, body = calls[-1]
            calls = calls[:-1]
            position = next(i for i, t in enumerate(body.inputs) if t is tensor)
            # A Case's and an If's first input is the branch selector.
            shift = 1 if {"branches", "then_branch"} & set(call_op.node_def.attr) else 0
            tensor = call_op.inputs[position + shift]
            continue
        outer = {id(inner): external for external, inner in getattr(graph, "captures", ())}
        if id(tensor) not in outer:
            return None
        tensor = outer[id(tensor)]
    return None


def _written_handles(ops, calls=()):
    """(op, source handle or None) of every write among `ops` and in the
    function bodies they run."""
    found = []
    for op in ops:
        if _is_write(op.type):
            for t in op.inputs:
                if t.dtype == tf.resource:
                    found.append((op, _source(t, calls)))
        for body in _internal.called_graphs(op):
            found += _written_handles(body.get_operations(), calls + ((op, body),))
    return found


def _describe(layer):
    return f"{type(layer).__name__} {layer.name!r}"


def _owner(stage, variable, op):
    """The outermost layer of `stage` holding `variable`, else the innermost
    whose name scope the writing `op` was made in, else the stage."""
    layers = [layer for layer in _internal.flatten_layers(stage) if layer is not stage]
    for layer in layers:
        if variable is not None and any(v is variable for v in layer.variables):
            return _describe(layer)
    # TF makes a reused name scope unique with a suffix: lstm, lstm_1, ...
    scopes = op.name.split("/")
    named = [layer for layer in layers if any(
        re.fullmatch(re.escape(layer.name) + r"(_[0-9]+)?", scope) for scope in scopes)]
    return _describe(named[-1] if named else stage)


def variable_writes(stage, ops, all_variables):
    """The `Write`s of `ops` (those one traced call of `stage` made), BatchNorm
    moving statistics and seed states left out. `all_variables`: every Keras
    variable of the model (a stage may write another stage's)."""
    exempt = {id(g.state) for g in _internal.seed_generators(stage)}
    for layer in batchnorm.batch_norm_layers(stage):
        exempt |= {id(layer.moving_mean), id(layer.moving_variance)}
    by_handle = {}
    for variable in all_variables:
        for copy in _internal.local_copies(variable):
            by_handle[id(copy.handle)] = variable
    writes = []
    for op, handle in _written_handles(ops):
        variable = by_handle.get(id(handle))
        if variable is not None and id(variable) in exempt:
            continue
        path = ("an untracked variable (not in any layer's variables)" if variable is None
                else repr(variable.path))
        write = Write(_owner(stage, variable, op), path, op.type)
        if write not in writes:
            writes.append(write)
    return tuple(writes)


def check_writes(writes_per_stage, num_microbatches, recompute, replays):
    """Raises a ValueError if a stage's forward writes a variable (`Write`s
    per stage) and the step would write it other than once, as plain Keras
    does: M > 1 calls, or a replay (`replays`: the step recomputes forwards
    under `recompute`)."""
    for k, writes in enumerate(writes_per_stage):
        if not writes:
            continue
        write = writes[0]
        what = (f"Stage {k}: {write.layer} writes {write.variable} in its "
                f"forward ({write.op}; {len(writes)} write(s) in this stage)")
        handled = ("tfpipe handles BatchNormalization's moving statistics and random seed "
                   "states itself, no other writes")
        if num_microbatches > 1:
            raise ValueError(
                f"{what}. tfpipe runs each stage's forward once per micro-batch, so with "
                f"num_microbatches={num_microbatches} the write would happen "
                f"{num_microbatches} times a step, each from one micro-batch, where plain "
                f"Keras writes once from the whole batch ({handled}). Use num_microbatches=1 "
                f"with recompute='never' or 'except_last' (a stateful layer keeps its "
                f"batch size then), or train the model without tfpipe.")
        if replays:
            raise ValueError(
                f"{what}. recompute={recompute!r} replays the forward in the backward pass, "
                f"which would write the variable again, from the value the first forward "
                f"wrote ({handled}). Use recompute='never' or 'except_last' (with "
                f"num_microbatches=1 nothing is then recomputed) on execution='unrolled' or "
                f"'stage_functions' (the loop always recomputes).")


def _join(a, b):
    """Two micro-batches' nests as one, rows of `a` first (masks, logits kept)."""
    def join(x, y):
        if x is None:
            return None
        if isinstance(x, tf.SparseTensor):
            return tf.sparse.concat(0, [x, y])
        if isinstance(x, tf.RaggedTensor):
            return tf.concat([x, y], 0)
        return microbatch.concat_with_metadata([x, y])
    return tf.nest.map_structure(join, a, b)


def _call(stage, state, seeds, inputs, training):
    """(output, {layer id: (layer, float64 sum of the losses it added)}) of one
    eager call of `stage` from seed states `seeds`; every non-trainable
    variable (BatchNorm statistics, seeds) is put back after."""
    def run():
        out = stage(inputs, training=training)
        return out, {id(layer): (layer, float(sum(np.sum(np.asarray(v, np.float64))
                                                  for v in losses)))
                     for layer, losses in _internal.call_losses_by_layer(stage)}
    return state.replay(seeds, run)


def _differ(a, b):
    return abs(a - b) > CALL_LOSS_RTOL * max(abs(a), abs(b), 1e-30)


def _not_per_row(losses, rows):
    """[(layer, L0, L1, L01, mean)] of the layers whose loss on both micro-
    batches together (L01) is not the row-weighted mean of L0 and L1."""
    (l0, l1, l01), (n0, n1) = losses, rows
    found = []
    for key in dict.fromkeys(list(l0) + list(l1) + list(l01)):
        layer = next(d[key][0] for d in (l0, l1, l01) if key in d)
        a, b, ab = (d[key][1] if key in d else 0.0 for d in (l0, l1, l01))
        mean = (n0 * a + n1 * b) / (n0 + n1)
        if _differ(ab, mean):
            found.append((layer, a, b, ab, mean))
    return found


def check_call_losses(stages, scope, states, interfaces, sample, training):
    """Raises a ValueError if a call loss of a stage is not a mean over rows.

    Measured eagerly on micro-batches 0 and 1 of `sample` (a
    `tfpipe.microbatch.Batch` of real values, cut as the step cuts): each
    stage up to the last one adding call losses runs on both (the forward the
    step runs on them, once more), and a stage adding losses once more on
    both together, with the same seed states, its non-trainable variables
    put back. Where they disagree and the loss depends on random draws (it
    changes with the seeds), the stage's inference-mode losses decide; a
    loss added only in training is then refused as unverifiable. `scopes[k]`
    places stage k; `states[k]` is its `tfpipe.recompute.StageState`.
    """
    rows = [int(sample.split.size(m)) for m in (0, 1)]
    if rows[1] == 0 or not any(i.call_losses for i in interfaces):
        return  # one real row: the only micro-batch with rows carries the whole loss
    last = max(k for k, i in enumerate(interfaces) if i.call_losses)
    inputs = [sample.micro(0)[0], sample.micro(1)[0]]
    for k in range(last + 1):
        stage, state = stages[k], states[k]
        with scope(k):
            seeds = state.snapshot_seeds()
            (out0, l0), (out1, l1) = (_call(stage, state, seeds, h, training) for h in inputs)
            if interfaces[k].call_losses:
                _check_stage(k, stage, state, seeds, inputs, (l0, l1), rows, training,
                             sample.num_microbatches)
        inputs = [out0, out1]


def _check_stage(k, stage, state, seeds, inputs, alone, rows, training, num_microbatches):
    joined = _join(*inputs)
    bad = _not_per_row((*alone, _call(stage, state, seeds, joined, training)[1]), rows)
    if not bad:
        return
    reseeded = [s + tf.ones_like(s) for s in seeds]
    again = _call(stage, state, reseeded, joined, training)[1]
    random = [layer for layer, *_, ab, _ in bad if _differ(again.get(id(layer), (0, 0.0))[1], ab)]
    note = ""
    if random and training:
        inference = [_call(stage, state, seeds, h, False)[1] for h in (*inputs, joined)]
        adds = {key for d in inference for key in d}
        unverifiable = [layer for layer in random if id(layer) not in adds]
        if unverifiable:
            layer = unverifiable[0]
            raise ValueError(
                f"Stage {k}: {_describe(layer)} adds a loss in its call whose value depends on "
                f"random draws (it changes with the seed) and which it adds only in training, "
                f"so tfpipe cannot check that it is a mean over rows, as splitting it over "
                f"num_microbatches={num_microbatches} micro-batches needs. If it is one (or "
                f"you accept GPipe's meaning: each micro-batch's call loss weighted by its "
                f"rows), pass call_losses='per_microbatch' to the PipelineStrategy or the "
                f"model; else use num_microbatches=1.")
        bad = _not_per_row(inference, rows)
        note = " (measured with training=False: its training value depends on random draws)"
    if not bad:
        return
    layer, a, b, ab, mean = bad[0]
    n0, n1 = rows
    raise ValueError(
        f"Stage {k}: the loss {_describe(layer)} adds in its call is not a mean over rows"
        f"{note}: on micro-batches 0 and 1 of the first batch together ({n0} + {n1} rows) it "
        f"is {ab:.7g}, but the row-weighted mean of its values on each alone is {mean:.7g} "
        f"({a:.7g} on {n0} rows, {b:.7g} on {n1}). tfpipe adds each micro-batch's call loss "
        f"weighted by its rows, which is the whole batch's loss only for a mean over rows: "
        f"with num_microbatches={num_microbatches} this loss and its gradient would differ "
        f"from plain Keras. Pass call_losses='per_microbatch' to the PipelineStrategy or the "
        f"model to train with GPipe's meaning (each micro-batch's loss weighted by its rows, "
        f"as BatchNorm's statistics are per micro-batch), or use num_microbatches=1.")
