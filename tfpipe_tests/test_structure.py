"""The library's shape, kept by tests: calls go down, one boundary for private
TF/Keras APIs, small modules, pure-Python configuration.

Read from the source files (`ast`), except the set of private TF/Keras
names, which is read from the installed TensorFlow and Keras themselves.
"""

import ast
import pathlib
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

from tfpipe import config as config_lib
from tfpipe import loop
from tfpipe import runtime
from tfpipe import unrolled

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "tfpipe"
MAX_LINES = 500
# The modules that touch private TF/Keras APIs, split by subject (their test
# pins them): `_internal.py` and `_internal_<subject>.py`.
BOUNDARY = "_internal"


def _modules():
    return {f"tfpipe.{p.stem}" if p.stem != "__init__" else "tfpipe": p
            for p in sorted(LIBRARY.glob("*.py"))}


def _imports(path):
    """The tfpipe modules `path` imports, at any depth of its code
    (function-level imports count: they are edges too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the package
                base = "tfpipe" + ("." + base if base else "")
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def _import_graph():
    modules = _modules()
    return {name: sorted(m for m in _imports(path) if m in modules and m not in (name, "tfpipe"))
            for name, path in modules.items()}


def test_no_import_cycles():
    graph = _import_graph()
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


# Below the engine: what runs a step. None of them may know the engine (the
# `Pipeline`) or the Keras model.
BELOW_ENGINE = ("tfpipe.unrolled", "tfpipe.loop", "tfpipe.runtime", "tfpipe.stage",
                "tfpipe.step_plan", "tfpipe.boundary", "tfpipe.loss", "tfpipe.batchnorm",
                "tfpipe.recompute", "tfpipe.gradients", "tfpipe.microbatch")


@pytest.mark.parametrize("module", BELOW_ENGINE)
def test_modules_below_the_engine_do_not_import_it_or_the_model(module):
    reach, frontier = set(), [module]
    graph = _import_graph()
    while frontier:
        for nxt in graph[frontier.pop()]:
            if nxt not in reach:
                reach.add(nxt)
                frontier.append(nxt)
    assert not reach & {"tfpipe.engine", "tfpipe.model", "tfpipe.layout"}, sorted(reach)


def test_no_module_compares_an_execution_by_name():
    """The runtime reads an execution's traits (`config.Execution`); only the
    registry (`config`) and the backend table (`engine`) name executions."""
    names = set(config_lib.EXECUTIONS)
    found = []
    for name, path in _modules().items():
        if name in ("tfpipe.config", "tfpipe.engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                values = [node.left] + list(node.comparators)
                for value in values:
                    items = value.elts if isinstance(value, (ast.Tuple, ast.List, ast.Set)) \
                        else [value]
                    hit = [i.value for i in items
                           if isinstance(i, ast.Constant) and i.value in names]
                    if hit:
                        found.append(f"{path.name}:{node.lineno} compares {hit}")
    assert not found, found


# The device-kind classes, and the one factory that picks a host for the
# strategy in scope (`strategy.current_pipeline_host`).
DEVICE_KIND_MODULES = ("tfpipe.host", "tfpipe.tpu", "tfpipe.devices", "tfpipe.strategy")
KIND_NAMES = {"LogicalCore", "TPUPipelineHost", "PipelineStrategy", "LocalGPU", "LocalCPU",
              "TPUStrategy", "is_tpu_strategy"}


def _kind_tests(source):
    """(line, what) for each test of a device's or host's kind in `source`:
    an isinstance/type check against a kind class, a call of
    `is_tpu_strategy`, `"GPU"`/`"TPU"` in a name, or an `_on_tpu` flag."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "is_tpu_strategy":
                found.append((node.lineno, name))
            if name == "isinstance" and len(node.args) == 2:
                kinds = ast.unparse(node.args[1])
                if any(k in kinds for k in KIND_NAMES):
                    found.append((node.lineno, f"isinstance(..., {kinds})"))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn))
                                                   for op in node.ops):
            if isinstance(node.left, ast.Constant) and node.left.value in ("GPU", "TPU"):
                found.append((node.lineno, f"{node.left.value!r} in"))
        elif isinstance(node, (ast.Attribute, ast.Name)):
            name = node.attr if isinstance(node, ast.Attribute) else node.id
            if name in ("_on_tpu", "on_tpu"):
                found.append((node.lineno, name))
    return found


def test_only_the_host_and_device_classes_test_the_device_kind():
    """A new kind of device is one class (`tfpipe.host`): the model, the step
    and the placement ask a host or a device, never which kind it is."""
    found = [f"{path.name}:{line} {what}" for name, path in _modules().items()
             if name not in DEVICE_KIND_MODULES for line, what in _kind_tests(path.read_text())]
    assert not found, found


@pytest.mark.parametrize("source", [
    "if self._on_tpu:\n    pass",
    "on_gpus = all('GPU' in str(d).upper() for d in devices)",
    "x = isinstance(device, devices_lib.LogicalCore)",
    "y = tpu.is_tpu_strategy(strategy)",
])
def test_the_device_kind_test_finds_a_planted_branch(source):
    assert _kind_tests(source)


def test_no_library_file_is_over_500_lines():
    long = {p.name: n for p in LIBRARY.glob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


# -- the private-API boundary ------------------------------------------------------


def _private_names():
    """Every private (single-underscore) attribute name of the TF and Keras
    objects tfpipe works with: their classes and live instances."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    strategy = tf.distribute.get_strategy()
    objects = [keras.Model, keras.layers.Layer, keras.optimizers.Optimizer, keras.losses.Loss,
               keras.metrics.Metric, keras.Variable, keras.callbacks.Callback,
               keras.layers.BatchNormalization, tf.Variable, tf.Module, tf.distribute.Strategy,
               tf.distribute.StrategyExtended, tf.distribute.ReplicaContext, tf.Tensor,
               tf.TensorSpec, tf.IndexedSlices, tf.GradientTape, tf.Graph, tf.Operation,
               tf.types.experimental.ConcreteFunction, model, model.layers[0],
               model.optimizer, model.trainable_variables[0], strategy, strategy.extended]
    names = set()
    for obj in objects:
        for name in list(dir(obj)) + list(getattr(obj, "__dict__", {})):
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


PRIVATE = None


def _violations(path, private):
    """Private TF/Keras touches in `path`: `import tensorflow.python...` or
    `keras.src...`, an attribute (read, write or definition) named like a
    private TF/Keras one, a getattr/setattr/hasattr of such a name, and a
    protected-access suppression."""
    source = path.read_text()
    tree = ast.parse(source)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""])
            bad += [f"imports {n}" for n in names
                    if n.startswith(("tensorflow.python", "keras.src"))]
        elif isinstance(node, ast.Attribute) and node.attr in private:
            bad.append(f"attribute {node.attr}")
        elif isinstance(node, ast.ClassDef):  # a method overriding a private one
            bad += [f"defines {item.name}" for item in node.body
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and item.name in private]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in private):
            bad.append(f"{node.func.id}(..., {node.args[1].value!r})")
    if "protected-access" in source:
        bad.append("a protected-access suppression")
    return [f"{path.name}: {b}" for b in bad]


def test_only_internal_touches_private_tf_and_keras_apis():
    private = _private_names()
    assert {"_distribute_strategy", "_compile_loss", "_trackable_children",
            "_flatten_layers"} <= private  # the test knows what it looks for
    found = []
    for path in sorted(LIBRARY.glob("*.py")):
        if path.stem != BOUNDARY and not path.stem.startswith(BOUNDARY + "_"):
            found += _violations(path, private)
    assert not found, found


def test_the_boundary_test_finds_a_private_touch(tmp_path):
    """The check above can fail: a module using Keras privates is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("import keras.src.backend\n"
                   "def f(model):\n"
                   "    return model._compile_loss, getattr(model, '_loss_tracker')\n"
                   "class M:\n"
                   "    def _trackable_children(self):\n"
                   "        return {}  # pylint: disable=protected-access\n")
    found = _violations(bad, _private_names())
    assert len(found) == 5, found


# -- pure Python where it must be ---------------------------------------------------


def test_config_and_schedules_import_without_tensorflow():
    code = ("import sys, tfpipe.config, tfpipe.schedules, tfpipe.simulation, tfpipe.actions; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('tensorflow', 'keras')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# -- the store protocol ---------------------------------------------------------------


def _public_methods(cls):
    return {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}


@pytest.mark.parametrize("store", [unrolled.UnrolledStore, loop.LoopStore])
def test_stores_implement_the_protocol_and_nothing_else(store):
    protocol = _public_methods(runtime.Store)
    assert len(protocol) <= 15
    mine = _public_methods(store)
    if store is loop.LoopStore:  # the loop's final state is read by its own object
        mine |= _public_methods(loop.FinishedStore)
    assert mine == protocol, sorted(mine ^ protocol)
