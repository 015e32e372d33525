"""A small U-Net for segmentation, and how to cut it into pipeline stages.

The model is a functional `keras.Model` with a skip connection from every
encoder level to the decoder level of the same resolution, so a pipeline cut
anywhere in the middle is crossed by skip tensors, which tfpipe passes
through the stages in between. Train it as-is with Keras, or cut it with
`tfpipe.PipelinedModel.from_model(model, balance=stage_balance(model, K))`.
"""

import keras


def unet(input_shape=(32, 32, 1), num_classes=2, filters=8, depth=3, batch_norm=False):
    """A U-Net: `depth` encoder levels, a bottleneck, `depth` decoder levels.

    Shapes: inputs (batch, H, W, C) float32, H and W divisible by 2**depth ->
    logits (batch, H, W, num_classes) (no softmax; use a loss with
    from_logits=True).

    Encoder level i (filters * 2**i channels): two 3x3 same-padded ReLU
    convolutions, whose output is the skip tensor `enc{i}_conv2`, then 2x2 max
    pooling. Bottleneck: two 3x3 convolutions. Decoder level i: a 2x2 stride-2
    transposed convolution, concatenation with the encoder's skip tensor of
    that level, two 3x3 convolutions. Head: a 1x1 convolution to logits.

    Args:
      input_shape: (H, W, C).
      num_classes: output channels (logits per class).
      filters: channels of the first level (doubled at each level down).
      depth: number of encoder (and decoder) levels.
      batch_norm: add BatchNormalization after each 3x3 convolution (before
        its ReLU). Off by default: with BN a pipelined step equals full-batch
        training only with one micro-batch (BN normalises per micro-batch).

    Returns:
      A functional `keras.Model` named "unet".
    """
    height, width = input_shape[0], input_shape[1]
    if depth < 1 or height % 2 ** depth or width % 2 ** depth:
        raise ValueError(
            f"unet needs depth >= 1 and H, W divisible by 2**depth; got "
            f"input_shape={input_shape}, depth={depth}."
        )

    def conv(h, channels, name):
        if not batch_norm:
            return keras.layers.Conv2D(channels, 3, padding="same", activation="relu",
                                       name=name)(h)
        h = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False, name=name)(h)
        h = keras.layers.BatchNormalization(name=f"{name}_bn")(h)
        return keras.layers.Activation("relu", name=f"{name}_relu")(h)

    inputs = keras.Input(input_shape, name="image")
    h, skips = inputs, []
    for i in range(depth):
        h = conv(h, filters * 2 ** i, f"enc{i}_conv1")
        h = conv(h, filters * 2 ** i, f"enc{i}_conv2")
        skips.append(h)
        h = keras.layers.MaxPooling2D(name=f"enc{i}_pool")(h)
    h = conv(h, filters * 2 ** depth, "bottleneck_conv1")
    h = conv(h, filters * 2 ** depth, "bottleneck_conv2")
    for i in reversed(range(depth)):
        h = keras.layers.Conv2DTranspose(filters * 2 ** i, 2, strides=2, name=f"dec{i}_up")(h)
        h = keras.layers.Concatenate(name=f"dec{i}_concat")([h, skips[i]])
        h = conv(h, filters * 2 ** i, f"dec{i}_conv1")
        h = conv(h, filters * 2 ** i, f"dec{i}_conv2")
    logits = keras.layers.Conv2D(num_classes, 1, name="logits")(h)
    return keras.Model(inputs, logits, name="unet")


def stage_balance(model, num_stages):
    """Unit counts per stage for cutting a `unet` into `num_stages` stages.

    The units are `model.operations` without the input (every layer here).
    The first-level skip (`enc0_conv2`) is made near the start and used by
    `dec0_concat` near the end; a cut placed after `enc0_pool` (so that the
    skip and the main path are different tensors) and no later than just
    before `dec0_concat` has the skip crossing it besides the main path. The
    `num_stages - 1` cuts are spread as evenly as possible by unit count,
    then moved into that window (and kept strictly increasing), so every cut
    carries the main path plus at least one skip tensor. K = 1 gives all
    units to one stage; K = 2, 4 and 8 work for `unet()` (24 units; 52 with
    batch_norm=True, which makes each 3x3 convolution three units) and for
    any deeper one.

    Examples (default `unet()`, 24 units): K=1 -> [24], K=2 -> [12, 12],
    K=4 -> [6, 6, 6, 6], K=8 -> [3, 3, 3, 3, 3, 3, 2, 4].

    Args:
      model: a model made by `unet`.
      num_stages: K (>= 1).

    Returns:
      A list of K ints, each >= 1, summing to the number of units.

    Raises:
      ValueError: num_stages is not a positive integer, or the window between
        `enc0_pool` and `dec0_concat` has fewer than K - 1 cut positions.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}.")
    names = [op.name for op in model.operations if not isinstance(op, keras.layers.InputLayer)]
    n = len(names)
    if num_stages == 1:
        return [n]
    low, high = names.index("enc0_pool") + 1, names.index("dec0_concat")  # allowed cuts
    if high - low + 1 < num_stages - 1:
        raise ValueError(
            f"Cannot cut {model.name!r} into {num_stages} stages with a skip across "
            f"every cut: only {high - low + 1} cut positions lie between enc0_pool "
            f"and dec0_concat. Use at most {high - low + 2} stages."
        )
    cuts = [min(max(n * k // num_stages, low), high) for k in range(1, num_stages)]
    for k in range(1, len(cuts)):              # strictly increasing, left to right
        cuts[k] = max(cuts[k], cuts[k - 1] + 1)
    for k in range(len(cuts) - 1, -1, -1):     # and within the window, right to left
        cuts[k] = min(cuts[k], high - (len(cuts) - 1 - k))
    bounds = [0] + cuts + [n]
    return [bounds[k + 1] - bounds[k] for k in range(num_stages)]
