"""Which units go to which stage: balancing K contiguous groups.

A balance is a list of K counts of the model's units (`tfpipe.graph`), stage
k taking the next `balance[k]`. `split_by_costs` minimises the largest
stage's cost exactly, with a unit's cost its parameter count, or its measured
time or memory (`tfpipe.costs`), as torchgpipe's `balance_by_time` / `_size`.
"""

import keras

from tfpipe import costs
from tfpipe import graph as graph_lib

BALANCE_METHODS = ("params", "time", "memory")


def validate_balance(balance, num_layers, num_devices, unit_name="layers"):
    """Checks a list of per-stage unit counts; returns it as a list of ints."""
    if isinstance(balance, int) or not hasattr(balance, "__iter__"):
        raise ValueError(f"balance must be a list of layer counts per stage, got {balance!r}.")
    balance = list(balance)
    if not balance or any(isinstance(b, bool) or not isinstance(b, int) for b in balance):
        raise ValueError(f"balance must be a non-empty list of ints, got {balance!r}.")
    empty = [k for k, b in enumerate(balance) if b < 1]
    if empty:
        raise ValueError(
            f"balance {balance} gives stage {empty[0]} no layers; every stage needs "
            f"at least one layer. Use fewer stages or move a layer into it.")
    if sum(balance) != num_layers:
        raise ValueError(
            f"balance {balance} sums to {sum(balance)} but the model has "
            f"{num_layers} {unit_name}; the counts must add up to {num_layers}.")
    if len(balance) > num_devices:
        raise ValueError(
            f"balance {balance} asks for {len(balance)} stages but the strategy has "
            f"{num_devices} devices; use at most {num_devices} stages or more devices.")
    return balance


def split_by_costs(costs, num_stages):
    """Unit counts per stage minimising the largest stage's summed cost
    (exact, over contiguous cuts; every stage non-empty).

    >>> split_by_costs([4, 1, 1, 1, 1, 4], 3)
    [1, 4, 1]
    """
    costs = [float(c) for c in costs]
    n = len(costs)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or not 1 <= num_stages <= n:
        raise ValueError(
            f"Cannot cut {n} layers into {num_stages} non-empty stages; "
            f"use between 1 and {n} stages.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-stage cost for the first i units in k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            row = best[k - 1]
            for j in range(k - 1, i):
                value = max(row[j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def _units(layers_or_model):
    if isinstance(layers_or_model, (keras.Model, graph_lib.Graph)):
        return [u.op for u in graph_lib.as_graph(layers_or_model).units]
    return list(layers_or_model)


def param_costs(layers_or_model):
    """Per-unit cost used by `balance_by_params`: parameters + 1."""
    costs = []
    for op in _units(layers_or_model):
        built = getattr(op, "built", False) and hasattr(op, "count_params")
        costs.append(op.count_params() + 1 if built else 1)
    return costs


def balance_by_params(layers, num_stages):
    """Unit counts per stage minimising the largest stage's parameter count
    (+1 per unit, so parameter-free layers spread). `layers`: a list of
    layers (and raw ops), or a Keras model; `num_stages`: K.

    >>> import keras
    >>> layers = [keras.layers.Dense(4) for _ in range(4)]
    >>> for layer in layers: layer.build((None, 4))
    >>> balance_by_params(layers, 2)
    [2, 2]
    """
    return split_by_costs(param_costs(layers), num_stages)


def time_costs(model, sample, repeats=3):
    """Seconds of forward + backward of each unit on `sample`, the fastest of
    `repeats` runs (`tfpipe.costs.measure`). `model` may be its `Graph`."""
    units, _ = costs.measure(model, [sample], repeats)
    return [u.seconds(costs.rows_of(sample)) for u in units]


def memory_costs(model, sample):
    """Bytes per unit on `sample`: its outputs (activations) plus its
    parameters (`tfpipe.costs.measure`). `model` may be its `Graph`."""
    units, _ = costs.measure(model, [sample], times=False, backward=False)
    return [u.output_bytes + u.param_bytes for u in units]


def balance_by_time(model, sample, num_stages, repeats=3):
    """Unit counts per stage minimising the slowest stage's forward + backward
    time on `sample` (the fastest of `repeats` runs; noisy on near-ties).
    `model` is left as it was."""
    return split_by_costs(time_costs(model, sample, repeats), num_stages)


def balance_by_memory(model, sample, num_stages):
    """Unit counts per stage minimising the largest stage's activation (its
    outputs on `sample`) + parameter bytes. `model` is left as it was.

    >>> import keras, numpy as np
    >>> model = keras.Sequential([keras.Input((16,))] +
    ...                          [keras.layers.Dense(16) for _ in range(4)])
    >>> balance_by_memory(model, np.ones((8, 16), "float32"), 2)
    [2, 2]
    """
    return split_by_costs(memory_costs(model, sample), num_stages)


def choose_balance(model, balance, num_stages, sample=None):
    """Resolves `from_model`'s `balance` argument to (counts, method name).

    `balance` is a list of counts (at most `num_stages` stages), None or
    "params", "time" or "memory" (measured on `sample`, default
    `tfpipe.costs.sample_batch`); the automatic methods use min(num_stages,
    units) stages. `model` may be a `tfpipe.graph.Graph`.
    """
    graph = graph_lib.as_graph(model)
    n = len(graph.units)
    k = min(num_stages, n)
    if balance is None or (isinstance(balance, str) and balance == "params"):
        counts, method = split_by_costs(param_costs(graph), k), "params"
    elif isinstance(balance, str) and balance in ("time", "memory"):
        sample = costs.sample_batch(graph) if sample is None else sample
        unit_costs = (time_costs(graph, sample) if balance == "time"
                      else memory_costs(graph, sample))
        counts, method = split_by_costs(unit_costs, k), balance
    elif isinstance(balance, str):
        raise ValueError(
            f"Unknown balance {balance!r}. Use a list of counts per stage, or one of "
            f"{list(BALANCE_METHODS)}.")
    else:
        counts, method = balance, "explicit"
    return validate_balance(counts, n, num_stages, graph.unit_name), method
