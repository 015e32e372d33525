"""Which layers go to which stage: cutting a layer chain into K groups."""

import keras


def chain_layers(model):
    """The layers of a Sequential model, or of a functional chain, in order.

    Raises:
      ValueError: the model is not a chain (branches, skip connections, several
        inputs or outputs, raw ops between layers, shared layers).
    """
    if isinstance(model, keras.Sequential):
        return list(model.layers)
    if not isinstance(model, keras.Model) or not hasattr(model, "operations"):
        raise ValueError(
            f"from_model needs a keras.Sequential or functional keras.Model, "
            f"got {type(model).__name__}."
        )
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise ValueError(
            f"from_model cuts chains of layers; model {model.name!r} has "
            f"{len(model.inputs)} inputs and {len(model.outputs)} outputs. "
            f"Pass the stages explicitly with PipelinedModel(stages=[...])."
        )
    ops = [op for op in model.operations if not isinstance(op, keras.layers.InputLayer)]
    previous = model.inputs[0]
    for op in ops:
        if not isinstance(op, keras.layers.Layer):
            raise ValueError(
                f"from_model found the raw op {op.name!r} in {model.name!r}; "
                f"wrap it in a keras layer (e.g. keras.layers.Lambda) to cut the model."
            )
        nodes = [n for n in op._inbound_nodes]  # pylint: disable=protected-access
        inputs = nodes[0].input_tensors if len(nodes) == 1 else None
        if inputs is None or len(inputs) != 1 or inputs[0] is not previous:
            raise ValueError(
                f"from_model needs a chain: layer {op.name!r} of {model.name!r} does "
                f"not take exactly the previous layer's output (shared layer, "
                f"branch or skip connection). Pass the stages explicitly with "
                f"PipelinedModel(stages=[...])."
            )
        previous = nodes[0].output_tensors[0]
    return ops


def validate_balance(balance, num_layers, num_devices):
    """Checks a list of per-stage layer counts; returns it as a list of ints."""
    if isinstance(balance, int) or not hasattr(balance, "__iter__"):
        raise ValueError(f"balance must be a list of layer counts per stage, got {balance!r}.")
    balance = list(balance)
    if not balance or any(isinstance(b, bool) or not isinstance(b, int) for b in balance):
        raise ValueError(f"balance must be a non-empty list of ints, got {balance!r}.")
    empty = [k for k, b in enumerate(balance) if b < 1]
    if empty:
        raise ValueError(
            f"balance {balance} gives stage {empty[0]} no layers; every stage needs "
            f"at least one layer. Use fewer stages or move a layer into it."
        )
    if sum(balance) != num_layers:
        raise ValueError(
            f"balance {balance} sums to {sum(balance)} but the model has "
            f"{num_layers} layers; the counts must add up to {num_layers}."
        )
    if len(balance) > num_devices:
        raise ValueError(
            f"balance {balance} asks for {len(balance)} stages but the strategy has "
            f"{num_devices} devices; use at most {num_devices} stages or more devices."
        )
    return balance


def balance_by_params(layers, num_stages):
    """Layer counts per stage minimising the largest stage's parameter count.

    Each layer costs its parameter count plus one (so parameter-free layers
    still spread out). Exact dynamic programme over contiguous cuts.

    >>> import keras
    >>> layers = [keras.layers.Dense(4) for _ in range(4)]
    >>> for layer in layers: layer.build((None, 4))
    >>> balance_by_params(layers, 2)
    [2, 2]
    """
    costs = [layer.count_params() + 1 if layer.built else 1 for layer in layers]
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(
            f"Cannot cut {n} layers into {num_stages} non-empty stages; "
            f"use between 1 and {n} stages."
        )
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-stage cost for the first i layers in k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]
