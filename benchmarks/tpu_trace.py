"""What a traced TPU step puts on each logical core: the check behind the TPU
placement tests and `benchmarks/tpu_check.py --cpu_dry_run`.

Under a `TPUStrategy` a step is one `tpu.replicate` program; an op made in a
stage's core scope carries `/device:TPU_REPLICATED_CORE:k`. An op in a
function body without a device of its own runs where the calling op does
(TF's placer puts a function's ops with its call). `read(graph)` walks the
program and every function it calls, following each variable handle into
the function bodies it is passed to, and reports per core. It reads a graph
only: nothing here needs (or runs on) a TPU.
"""

import collections
import dataclasses
import re

import tensorflow as tf

from tfpipe import _internal

_CORE = re.compile(r"/device:TPU_REPLICATED_CORE:([0-9]+)$")
# Ops that compute nothing: constants, function arguments, pass-throughs.
STRUCTURAL = frozenset({"Const", "Placeholder", "Identity", "IdentityN", "NoOp",
                        "TPUReplicateMetadata"})
_MATMULS = frozenset({"MatMul", "BatchMatMulV2", "BatchMatMulV3"})
_ALL_REDUCES = frozenset({"CrossReplicaSum"})


@dataclasses.dataclass
class CorePlacement:
    """Where a traced TPU step runs its ops (cores are ints; None: no core).

    Attributes:
      num_replicas, cores_per_replica: from the program's TPUReplicateMetadata.
      handles: {variable handle name: sorted cores of every op using it,
        in function bodies too}; a TF variable's handle is named by its name.
      matmuls, all_reduces: Counter {core: MatMul ops, CrossReplicaSum ops}.
      unplaced: Counter {op type: ops of the program on no core}, structural
        ops left out.
      unplaced_work: names of ops on no core that take a value computed on a
        core (directly or through other such ops): stage work left unplaced.
    """

    num_replicas: int
    cores_per_replica: int
    handles: dict
    matmuls: collections.Counter
    all_reduces: collections.Counter
    unplaced: collections.Counter
    unplaced_work: list

    def variable_handles(self, path, slots=("momentum", "velocity")):
        """{handle name: cores} of the variable at Keras `path` (its TF name
        under a TPUStrategy) and of its optimizer slots, which Keras names
        `<path with _ for />_<slot>` (Adam's: momentum, velocity)."""
        names = {f"{path.replace('/', '_')}_{slot}" for slot in slots}
        return {name: cores for name, cores in self.handles.items()
                if name == path or name.rpartition("/")[2] in names}


def core_of(device):
    """The logical core of an op's device string, or None."""
    match = _CORE.search(device or "")
    return int(match.group(1)) if match else None


def trace_train_step(model, x_spec, y_spec):
    """The graph of one `model.train_step` under its TPUStrategy, traced
    (never run) for inputs of those `tf.TensorSpec`s (global batch)."""
    strategy = model.distribute_strategy

    def train_step(x, y):
        return strategy.run(model.train_step, args=((x, y),))

    return tf.function(train_step).get_concrete_function(x_spec, y_spec).graph


def read(graph):
    """The `CorePlacement` of a traced graph holding one TPU program."""
    ops = graph.get_operations()
    meta = [op for op in ops if op.type == "TPUReplicateMetadata"]
    if len(meta) != 1:
        raise ValueError(f"Expected one TPU program in the graph, found {len(meta)}.")
    matmuls, reduces, handles = collections.Counter(), collections.Counter(), {}
    program = [op for op in ops if _in_program(op)]
    _walk(program, None, matmuls, reduces)
    for op in ops:  # a variable's replicated handle is made outside the program
        if op.type == "TPUReplicatedInput" and op.outputs[0].dtype == tf.resource:
            cores = set()
            _uses(op.outputs[0], None, cores)
            handles[op.name[:-len("/handle")] if op.name.endswith("/handle") else op.name] = \
                sorted(cores, key=lambda c: -1 if c is None else c)
    unplaced = collections.Counter(op.type for op in program
                                   if core_of(op.device) is None and op.type not in STRUCTURAL)
    return CorePlacement(
        num_replicas=meta[0].get_attr("num_replicas"),
        cores_per_replica=meta[0].get_attr("num_cores_per_replica"),
        handles=handles, matmuls=matmuls, all_reduces=reduces, unplaced=unplaced,
        unplaced_work=_unplaced_work(program))


def _in_program(op):
    try:
        op.get_attr("_tpu_replicate")
    except ValueError:
        return False
    return True


def _effective(op, inherited):
    core = core_of(op.device)
    return inherited if core is None else core


def _walk(ops, inherited, matmuls, reduces):
    for op in ops:
        core = _effective(op, inherited)
        if op.type in _MATMULS:
            matmuls[core] += 1
        elif op.type in _ALL_REDUCES:
            reduces[core] += 1
        for body in _internal.called_graphs(op):
            _walk(body.get_operations(), core, matmuls, reduces)


def _uses(tensor, inherited, cores, depth=0):
    """Adds the cores of every op using `tensor` (a handle) to `cores`,
    following it through pass-throughs and into function bodies."""
    if depth > 20:
        return
    for consumer in tensor.consumers():
        core = _effective(consumer, inherited)
        bodies = _internal.called_graphs(consumer)
        if bodies:
            # Argument i is the body's input i (a While's loop variable i; a
            # Case's and an If's inputs follow the branch index).
            shift = 1 if {"branches", "then_branch"} & set(consumer.node_def.attr) else 0
            positions = [i - shift for i, t in enumerate(consumer.inputs) if t is tensor]
            for body in bodies:
                for position in positions:
                    if 0 <= position < len(body.inputs):
                        _uses(body.inputs[position], core, cores, depth + 1)
        elif consumer.type in ("Identity", "IdentityN"):
            for out in consumer.outputs:
                _uses(out, core, cores, depth + 1)
        else:
            cores.add(core)


def _unplaced_work(program):
    """Ops of the program on no core whose inputs come from an op on a core."""
    on_core, found = set(), []
    for op in program:  # get_operations() is in creation order: inputs first
        if core_of(op.device) is not None:
            on_core.add(op.name)
            continue
        if op.type in STRUCTURAL or _internal.called_graphs(op):
            continue
        if any(t.op.name in on_core for t in op.inputs):
            found.append(op.name)
            on_core.add(op.name)
    return found
