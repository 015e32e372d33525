"""tfpipe: GPipe-style pipeline-parallel training for TensorFlow 2 / Keras 3.

Module map (data flows down): `strategy` (devices) and `config` (the one
owner of M, schedule, recompute, execution, BatchNorm mode) -> `placement`
(where variables live) -> `graph` (a model as units; cutting it) and
`partition` (which units form a stage) -> `schedules` (in what order stages
run) -> `microbatch` (scatter/gather), `boundary` (masks and logits across
stages), `loss` (the compiled loss split exactly), `batchnorm` (deferred BN)
and `recompute` (re-materialisation) -> `engine` / `loop` (one step in a
tf.function) -> `model` (`PipelinedModel`, the Keras face).
"""

from tfpipe import testing
from tfpipe import schedules
from tfpipe import profile
from tfpipe import graph
from tfpipe import partition
from tfpipe import batchnorm
from tfpipe import placement
from tfpipe import config
from tfpipe import devices
from tfpipe import tpu
from tfpipe import xla
from tfpipe.config import PipelineConfig
from tfpipe.strategy import PipelineStrategy
from tfpipe.model import PipelinedModel
from tfpipe.planner import Plan, plan
from tfpipe import layout
from tfpipe.layout import load_model, to_keras
from tfpipe import cluster
from tfpipe.watchdog import StepWatchdog

__version__ = "0.1.0"

__all__ = ["PipelineStrategy", "PipelinedModel", "PipelineConfig", "config", "testing", "schedules", "profile", "partition",
           "placement", "graph", "batchnorm", "layout", "load_model", "to_keras", "devices",
           "tpu", "xla", "plan", "Plan", "cluster", "StepWatchdog", "__version__"]
