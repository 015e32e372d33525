"""A ResNet-style CNN for small images, and how to cut it into pipeline stages.

The model is a `keras.Sequential` chain,

    Conv2D 3x3 -> BatchNormalization -> ReLU            (the stem)
        -> ResidualBlock x num_blocks                   (widths double, size halves
                                                         at each new width)
        -> GlobalAveragePooling2D -> Dense(num_classes) (the head),

so `tfpipe.PipelinedModel.from_model(model, balance=stage_balance(model, K))`
cuts it with the stem in stage 0, the head in the last stage and the residual
blocks spread evenly. Each `ResidualBlock` is one serialisable layer, so a skip
connection never crosses a stage boundary.

Shapes: images (batch, H, W, C) float32 -> logits (batch, num_classes) (no
softmax; use a loss with from_logits=True). 8x8x1 (scikit-learn digits) and
28x28x1 (MNIST-sized) both work.

    >>> model = resnet_cnn((8, 8, 1), num_blocks=4)                # doctest: +SKIP
    >>> with tfpipe.PipelineStrategy(num_microbatches=2).scope():  # doctest: +SKIP
    ...     pipelined = tfpipe.PipelinedModel.from_model(
    ...         model, balance=stage_balance(model, 4))
"""

import keras

PACKAGE = "tfpipe_models"
STEM_LAYERS = 3  # Conv2D, BatchNormalization, ReLU
HEAD_LAYERS = 2  # GlobalAveragePooling2D, Dense


@keras.saving.register_keras_serializable(package=PACKAGE)
class ResidualBlock(keras.layers.Layer):
    """relu(BN(conv(relu(BN(conv(x))))) + shortcut(x)), a basic ResNet block.

    The shortcut is the identity, or a strided 1x1 convolution + BN when the
    stride or the number of channels changes.

    Args:
      filters: output channels.
      stride: stride of the first convolution (2 halves height and width).
      kernel_size: size of both convolutions.
    """

    def __init__(self, filters, stride=1, kernel_size=3, **kwargs):
        super().__init__(**kwargs)
        self.filters = int(filters)
        self.stride = int(stride)
        self.kernel_size = int(kernel_size)
        conv = dict(padding="same", use_bias=False, kernel_initializer="he_normal")
        self.conv1 = keras.layers.Conv2D(self.filters, self.kernel_size, strides=self.stride,
                                         name="conv1", **conv)
        self.bn1 = keras.layers.BatchNormalization(name="bn1")
        self.conv2 = keras.layers.Conv2D(self.filters, self.kernel_size, name="conv2", **conv)
        self.bn2 = keras.layers.BatchNormalization(name="bn2")
        self.projection = None
        self.projection_bn = None

    def build(self, input_shape):
        # Every sub-layer is built here, eagerly, so that its variables are
        # created under the device scope the block is built in.
        input_shape = tuple(input_shape)
        self.conv1.build(input_shape)
        inner = tuple(self.conv1.compute_output_shape(input_shape))
        self.bn1.build(inner)
        self.conv2.build(inner)
        self.bn2.build(inner)
        if self.stride != 1 or input_shape[-1] != self.filters:
            self.projection = keras.layers.Conv2D(
                self.filters, 1, strides=self.stride, padding="same", use_bias=False,
                kernel_initializer="he_normal", name="projection")
            self.projection_bn = keras.layers.BatchNormalization(name="projection_bn")
            self.projection.build(input_shape)
            self.projection_bn.build(inner)

    def call(self, x, training=None):
        h = keras.ops.relu(self.bn1(self.conv1(x), training=training))
        h = self.bn2(self.conv2(h), training=training)
        shortcut = x
        if self.projection is not None:
            shortcut = self.projection_bn(self.projection(x), training=training)
        return keras.ops.relu(h + shortcut)

    def compute_output_shape(self, input_shape):
        return tuple(self.conv1.compute_output_shape(tuple(input_shape)))

    def get_config(self):
        return {**super().get_config(), "filters": self.filters, "stride": self.stride,
                "kernel_size": self.kernel_size}


def default_widths(input_shape):
    """Channels per resolution: (16, 32) for images under 16 pixels a side, else (16, 32, 64)."""
    return (16, 32) if min(input_shape[:2]) < 16 else (16, 32, 64)


def resnet_cnn(input_shape=(8, 8, 1), num_classes=10, num_blocks=4, widths=None,
               name="resnet_cnn"):
    """A built `keras.Sequential` ResNet: stem, `num_blocks` residual blocks, head.

    Block i has `widths[i * len(widths) // num_blocks]` filters; the first block
    of each new width has stride 2.

    Args:
      input_shape: (H, W, C) of one image.
      num_classes: output logits.
      num_blocks: residual blocks (at least the number of pipeline stages).
      widths: channels per resolution; None: `default_widths(input_shape)`.
      name: the model's name.

    Returns:
      A `keras.Sequential` with `num_blocks + 5` layers.
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}.")
    widths = tuple(widths or default_widths(input_shape))
    if len(widths) > num_blocks:
        widths = widths[:num_blocks]
    layers = [
        keras.Input(tuple(input_shape)),
        keras.layers.Conv2D(widths[0], 3, padding="same", use_bias=False,
                            kernel_initializer="he_normal", name="stem_conv"),
        keras.layers.BatchNormalization(name="stem_bn"),
        keras.layers.ReLU(name="stem_relu"),
    ]
    previous = 0
    for i in range(num_blocks):
        group = i * len(widths) // num_blocks
        stride = 2 if group != previous else 1
        previous = group
        layers.append(ResidualBlock(widths[group], stride=stride, name=f"block_{i}"))
    layers += [keras.layers.GlobalAveragePooling2D(name="pool"),
               keras.layers.Dense(num_classes, name="logits")]
    return keras.Sequential(layers, name=name)


def stage_balance(model, num_stages):
    """Layer counts per stage: stem + first blocks | blocks | ... | blocks + head.

    Blocks are spread as evenly as possible, extra ones to the first stages.
    E.g. 4 blocks (9 layers): K=1 -> [9], K=2 -> [5, 4], K=4 -> [4, 1, 1, 3].

    Args:
      model: a `resnet_cnn(...)` model (or its list of layers).
      num_stages: K >= 1, at most the number of residual blocks.

    Returns:
      A list of K ints summing to the number of layers.

    Raises:
      ValueError: num_stages is not a positive integer or exceeds the blocks.
    """
    layers = list(getattr(model, "layers", model))
    num_blocks = len(layers) - STEM_LAYERS - HEAD_LAYERS
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}.")
    if num_stages > num_blocks:
        raise ValueError(
            f"Cannot spread {num_blocks} residual blocks over {num_stages} stages: every "
            f"stage needs at least one block. Use resnet_cnn(num_blocks={num_stages}) or "
            f"at most {num_blocks} stages.")
    base, extra = divmod(num_blocks, num_stages)
    counts = [base + (1 if k < extra else 0) for k in range(num_stages)]
    counts[0] += STEM_LAYERS
    counts[-1] += HEAD_LAYERS
    return counts
