"""The models `launch.train` trains: name -> `ModelSpec` (its data and how
its pipeline is built). Imports TensorFlow."""

import dataclasses
from typing import Callable

import tfpipe
from launch import config as config_lib
from launch import data as data_lib
from models import mlp
from models import resnet_cnn
from models import transformer_lm
from models import unet


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A trainable model: what data it takes and how to build its pipeline.

    Attributes:
      data_kind: "image", "segmentation" or "text" (see `launch.data.Data`).
      default_dataset: the data set used for dataset="auto".
      build: fn(config, data, **settings) -> an uncompiled
        `tfpipe.PipelinedModel` with those pipeline settings, called under the
        run's strategy scope.
      view: fn(x) -> x as the model takes it (e.g. flattened 8x8 images).
    """

    data_kind: str
    default_dataset: str
    build: Callable
    view: Callable = None

    def __post_init__(self):
        if self.view is None:
            object.__setattr__(self, "view", lambda x: x)


def _depth(config):
    """Blocks (or hidden layers) to build: --depth, else 4, and at least one per stage."""
    return max(config.depth or 4, config.stages)


def _build_mlp(config, data, **settings):
    # digits_mlp adds hidden layers itself when there are fewer than stages - 1.
    plain = mlp.digits_mlp(config.stages, depth=config.depth or 4,
                           num_classes=data.num_classes)
    return tfpipe.PipelinedModel.from_model(
        plain, balance=mlp.stage_balance(plain, config.stages), **settings)


def _build_resnet(config, data, **settings):
    plain = resnet_cnn.resnet_cnn(data.image_shape, data.num_classes,
                                  num_blocks=_depth(config))
    return tfpipe.PipelinedModel.from_model(
        plain, balance=resnet_cnn.stage_balance(plain, config.stages), **settings)


def _build_transformer(config, data, **settings):
    # Cut from the one-device model (not hand-made stages), so that its
    # checkpoints load at any --stages (--reshard).
    plain = transformer_lm.transformer_lm(
        num_layers=_depth(config), vocab_size=data.num_classes, seq_len=data.seq_len)
    return tfpipe.PipelinedModel.from_model(
        plain, balance=transformer_lm.stage_balance(plain, config.stages),
        name="pipelined_transformer_lm", **settings)


def _build_unet(config, data, **settings):
    plain = unet.unet(input_shape=data.image_shape, num_classes=data.num_classes,
                      depth=2)
    return tfpipe.PipelinedModel.from_model(
        plain, balance=unet.stage_balance(plain, config.stages), **settings)


_BUILDERS = {
    "mlp": (_build_mlp, data_lib.as_flat_8x8),
    "resnet": (_build_resnet, None),
    "transformer": (_build_transformer, None),
    "unet": (_build_unet, None),
}
MODELS = {name: ModelSpec(*config_lib.MODEL_DATA[name], build, view)
          for name, (build, view) in _BUILDERS.items()}
