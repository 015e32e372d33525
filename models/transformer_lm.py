"""A decoder-only Transformer language model, and its pipeline stages.

The model is a chain of layers,

    TokenAndPositionEmbedding -> TransformerBlock x num_layers
        -> LayerNormalization ("final_norm") -> Dense(vocab_size) ("logits"),

so there are two ways to pipeline it, which give the same network:

- `transformer_stages(num_stages, ...)`: K unbuilt `keras.Sequential` stages
  for `tfpipe.PipelinedModel(stages, input_shape=(None, seq_len),
  input_dtype="int32")`. Stage 0 holds the embedding and the first blocks, the
  middle stages hold blocks, the last stage holds its blocks, the final norm
  and the logits head.
- `transformer_lm(...)`, a plain `keras.Sequential` of the same layers, trains
  as-is with Keras (the reference) or is cut with
  `PipelinedModel.from_model(model, balance=stage_balance(model, K))`, which
  makes exactly the stages above.

Shapes: tokens (batch, seq_len) int32 in [0, vocab_size) -> logits (batch,
seq_len, vocab_size) float32 (no softmax: use a loss with from_logits=True).
Position t only sees positions <= t (causal self-attention).

    >>> stages = transformer_stages(4, num_layers=4)       # doctest: +SKIP
    >>> with tfpipe.PipelineStrategy(num_microbatches=4).scope():  # doctest: +SKIP
    ...     model = tfpipe.PipelinedModel(stages, input_shape=(None, 64),
    ...                                   input_dtype="int32")
"""

import keras

PACKAGE = "tfpipe_models"


@keras.saving.register_keras_serializable(package=PACKAGE)
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Learned token embedding plus learned absolute position embedding.

    Shapes: (batch, T) int tokens, T <= seq_len -> (batch, T, width) float32.
    """

    def __init__(self, vocab_size, seq_len, width, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = int(vocab_size)
        self.seq_len = int(seq_len)
        self.width = int(width)

    def build(self, input_shape):
        init = keras.initializers.RandomNormal(stddev=0.02)
        self.token_embedding = self.add_weight(
            name="token_embedding", shape=(self.vocab_size, self.width), initializer=init)
        self.position_embedding = self.add_weight(
            name="position_embedding", shape=(self.seq_len, self.width), initializer=init)

    def call(self, tokens):
        tokens = keras.ops.cast(tokens, "int32")
        length = keras.ops.shape(tokens)[-1]
        positions = self.position_embedding[:length]
        return keras.ops.take(self.token_embedding, tokens, axis=0) + positions

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.width,)

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size,
                "seq_len": self.seq_len, "width": self.width}


@keras.saving.register_keras_serializable(package=PACKAGE)
class TransformerBlock(keras.layers.Layer):
    """A pre-norm decoder block: x + Attention(LN(x)), then h + MLP(LN(h)).

    Attention is causal multi-head self-attention; the MLP is Dense(mlp_ratio *
    width, gelu) -> Dense(width). Shapes: (batch, T, width) -> same.

    Args:
      width: model width (last axis of the input).
      num_heads: attention heads; must divide `width`.
      mlp_ratio: hidden width of the MLP as a multiple of `width`.
      dropout: dropout rate on attention weights and on each residual branch.
    """

    def __init__(self, width, num_heads, mlp_ratio=4, dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        if width % num_heads:
            raise ValueError(
                f"TransformerBlock: num_heads={num_heads} must divide width={width}.")
        self.width = int(width)
        self.num_heads = int(num_heads)
        self.mlp_ratio = int(mlp_ratio)
        self.dropout = float(dropout)
        self.attention_norm = keras.layers.LayerNormalization(epsilon=1e-5, name="attention_norm")
        self.attention = keras.layers.MultiHeadAttention(
            num_heads=self.num_heads, key_dim=self.width // self.num_heads,
            dropout=self.dropout, name="attention")
        self.mlp_norm = keras.layers.LayerNormalization(epsilon=1e-5, name="mlp_norm")
        self.mlp_in = keras.layers.Dense(self.mlp_ratio * self.width, activation="gelu",
                                         name="mlp_in")
        self.mlp_out = keras.layers.Dense(self.width, name="mlp_out")
        self.residual_dropout = keras.layers.Dropout(self.dropout)

    def build(self, input_shape):
        # Every sub-layer is built here, eagerly, so that its variables are
        # created under the device scope the block is built in.
        input_shape = tuple(input_shape)
        self.attention_norm.build(input_shape)
        self.attention.build(input_shape, input_shape)
        self.mlp_norm.build(input_shape)
        self.mlp_in.build(input_shape)
        self.mlp_out.build(input_shape[:-1] + (self.mlp_ratio * self.width,))

    def call(self, x, training=None):
        h = self.attention_norm(x)
        h = self.attention(h, h, use_causal_mask=True, training=training)
        x = x + self.residual_dropout(h, training=training)
        h = self.mlp_out(self.mlp_in(self.mlp_norm(x)))
        return x + self.residual_dropout(h, training=training)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        return {**super().get_config(), "width": self.width, "num_heads": self.num_heads,
                "mlp_ratio": self.mlp_ratio, "dropout": self.dropout}


def lm_layers(num_layers=4, width=64, num_heads=4, vocab_size=256, seq_len=64,
              mlp_ratio=4, dropout=0.0):
    """The chain of fresh, unbuilt layers: embedding, blocks, final norm, head.

    Returns:
      A list of `num_layers + 3` layers.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}.")
    layers = [TokenAndPositionEmbedding(vocab_size, seq_len, width, name="embedding")]
    layers += [TransformerBlock(width, num_heads, mlp_ratio, dropout, name=f"block_{i}")
               for i in range(num_layers)]
    layers.append(keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm"))
    layers.append(keras.layers.Dense(vocab_size, name="logits"))
    return layers


def transformer_lm(num_layers=4, width=64, num_heads=4, vocab_size=256, seq_len=64,
                   mlp_ratio=4, dropout=0.0, name="transformer_lm"):
    """The plain (one-device) model: a built `keras.Sequential` of `lm_layers`.

    Args:
      num_layers: Transformer blocks (at least the number of pipeline stages
        you want to cut it into).
      width: model width; num_heads: attention heads (must divide width).
      vocab_size: tokens and logits (256 for byte-level text).
      seq_len: longest sequence (the position table's size).
      mlp_ratio: MLP hidden width / width. dropout: rate (0 = deterministic).

    Returns:
      A `keras.Sequential` with input (None, seq_len) int32 and
      `num_layers + 3` layers.
    """
    layers = lm_layers(num_layers, width, num_heads, vocab_size, seq_len, mlp_ratio, dropout)
    return keras.Sequential([keras.Input((seq_len,), dtype="int32")] + layers, name=name)


def blocks_per_stage(num_blocks, num_stages):
    """Blocks of each stage, as even as possible; extra blocks go to the first stages
    (the last stage also holds the logits head).

    >>> blocks_per_stage(6, 4)
    [2, 2, 1, 1]
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}.")
    if num_stages > num_blocks:
        raise ValueError(
            f"Cannot spread {num_blocks} Transformer blocks over {num_stages} stages: "
            f"every stage needs at least one block. Use num_layers >= {num_stages} or at "
            f"most {num_blocks} stages.")
    base, extra = divmod(num_blocks, num_stages)
    return [base + (1 if k < extra else 0) for k in range(num_stages)]


def stage_balance(model, num_stages):
    """Layer counts per stage for `PipelinedModel.from_model(transformer_lm(...))`.

    Stage 0 gets the embedding, the last stage the final norm and logits head,
    and the blocks are spread by `blocks_per_stage`. E.g. 4 blocks (7 layers):
    K=1 -> [7], K=2 -> [3, 4], K=4 -> [2, 1, 1, 3].

    Args:
      model: a `transformer_lm(...)` model (or its list of layers).
      num_stages: K >= 1, at most the number of blocks.

    Returns:
      A list of K ints summing to the number of layers.
    """
    layers = list(getattr(model, "layers", model))
    counts = blocks_per_stage(len(layers) - 3, num_stages)
    counts[0] += 1
    counts[-1] += 2
    return counts


def transformer_stages(num_stages, num_layers=4, width=64, num_heads=4, vocab_size=256,
                       seq_len=64, mlp_ratio=4, dropout=0.0):
    """The model as `num_stages` unbuilt `keras.Sequential` stages ("stage_0", ...).

    The same layers as `transformer_lm` with the same arguments, cut by
    `stage_balance`: embedding + first blocks | blocks | ... | blocks + final
    norm + logits. Pass them to `tfpipe.PipelinedModel(stages,
    input_shape=(None, seq_len), input_dtype="int32")`, which builds stage k on
    device k.

    Returns:
      A list of `num_stages` keras.Sequential models.
    """
    layers = lm_layers(num_layers, width, num_heads, vocab_size, seq_len, mlp_ratio, dropout)
    stages, start = [], 0
    for k, size in enumerate(stage_balance(layers, num_stages)):
        stages.append(keras.Sequential(layers[start:start + size], name=f"stage_{k}"))
        start += size
    return stages
