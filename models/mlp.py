"""A small MLP for the scikit-learn digits data set, and how to cut it into stages.

The model is a plain `keras.Sequential`, so it trains as-is with Keras or is cut
into pipeline stages with `tfpipe.PipelinedModel.from_model(model,
balance=stage_balance(model, num_stages))`.
"""

import keras

NUM_FEATURES = 64  # 8x8 digit images, flattened


def digits_mlp(num_stages, hidden=128, depth=4, num_classes=10):
    """A Sequential MLP: `depth` Dense(hidden, relu) layers, then Dense(num_classes).

    Shapes: inputs (batch, 64) float32 -> hidden activations (batch, hidden) ->
    logits (batch, num_classes) (no softmax; use a loss with from_logits=True).

    The model has `depth + 1` layers (the Input is not a layer). So that it can
    be cut into `num_stages` non-empty stages, the number of hidden layers is
    raised to `num_stages - 1` when `depth` is smaller (e.g. 8 stages with the
    default depth=4 gives 7 hidden layers + the output layer).

    Args:
      num_stages: the number of pipeline stages the model will be cut into (>= 1).
      hidden: width of each hidden layer.
      depth: number of hidden Dense+relu layers (at least `num_stages - 1` are built).
      num_classes: number of output logits.

    Returns:
      A built `keras.Sequential` named "digits_mlp" with
      `max(depth, num_stages - 1) + 1` layers.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}.")
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth!r}.")
    depth = max(depth, num_stages - 1)
    layers = [keras.Input((NUM_FEATURES,))]
    layers += [keras.layers.Dense(hidden, activation="relu", name=f"dense_{i}")
               for i in range(depth)]
    layers.append(keras.layers.Dense(num_classes, name="logits"))
    return keras.Sequential(layers, name="digits_mlp")


def stage_balance(model, num_stages):
    """Layer counts per stage for cutting `model` into `num_stages` stages.

    The layers are split as evenly as possible by count; when they do not
    divide evenly, the later stages get one layer more (for this MLP the last
    layer, Dense(num_classes), is the smallest, so this also evens out the
    parameter counts). Works for any num_stages, e.g. 1, 2, 4 or 8.

    Examples (a 5-layer model): K=1 -> [5], K=2 -> [2, 3], K=4 -> [1, 1, 1, 2].

    Args:
      model: a keras.Sequential (or anything with a `layers` list).
      num_stages: K, the number of stages (>= 1).

    Returns:
      A list of K ints, each >= 1, summing to len(model.layers).

    Raises:
      ValueError: num_stages is not a positive integer, or exceeds the number
        of layers (a stage would be empty).
    """
    num_layers = len(model.layers)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}.")
    if num_stages > num_layers:
        raise ValueError(
            f"Cannot cut {model.name!r} ({num_layers} layers) into {num_stages} stages: "
            f"every stage needs at least one layer. Use at most {num_layers} stages "
            f"or a deeper model (e.g. digits_mlp(num_stages={num_stages}))."
        )
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if k >= num_stages - extra else 0) for k in range(num_stages)]
