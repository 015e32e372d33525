"""tfpipe: GPipe-style pipeline-parallel training for TensorFlow 2 / Keras 3.

Module map (data flows down): `strategy` (devices) -> `placement` (where
variables live) -> `graph` (a model as units; cutting it) and `partition`
(which units form a stage; `batchnorm` for deferred BN) -> `schedules` (in
what order stages run) -> `microbatch` (scatter/gather) and `recompute`
(re-materialisation) -> `engine` (one step in a tf.function) -> `model`
(`PipelinedModel`, the Keras face).
"""

from tfpipe import testing
from tfpipe import schedules
from tfpipe import profile
from tfpipe import graph
from tfpipe import partition
from tfpipe import batchnorm
from tfpipe import placement
from tfpipe.strategy import PipelineStrategy
from tfpipe.model import PipelinedModel

__version__ = "0.1.0"

__all__ = ["PipelineStrategy", "PipelinedModel", "testing", "schedules", "profile", "partition",
           "placement", "graph", "batchnorm", "__version__"]
