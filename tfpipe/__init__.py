"""tfpipe: GPipe-style pipeline-parallel training for TensorFlow 2 / Keras 3.

Module map (data flows down): `strategy` (devices) -> `placement` (where
variables live) -> `partition` (which layers form a stage) -> `schedules` (in
what order stages run) -> `microbatch` (scatter/gather) and `recompute`
(re-materialisation) -> `engine` (one step in a tf.function) -> `model`
(`PipelinedModel`, the Keras face).
"""

from tfpipe import testing
from tfpipe import schedules
from tfpipe import partition
from tfpipe import placement
from tfpipe.strategy import PipelineStrategy
from tfpipe.model import PipelinedModel

__version__ = "0.1.0"

__all__ = ["PipelineStrategy", "PipelinedModel", "testing", "schedules", "partition",
           "placement", "__version__"]
