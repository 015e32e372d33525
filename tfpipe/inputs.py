"""What `fit`, `evaluate` and `predict` are given, checked before Keras runs.

Each check raises a `ValueError` naming the call, the value and the fix,
where Keras would fail deep inside a traced step or not at all;
`input_spec` reads the shapes and dtype a model is built from.
"""

import keras
import numpy as np
import tensorflow as tf

from tfpipe import graph as graph_lib
from tfpipe import xla


def map_shapes(fn, shapes):
    """`fn` applied to every shape of a nest of shapes."""
    if graph_lib.is_shape(shapes):
        return fn(tuple(shapes))
    if isinstance(shapes, dict):
        return {k: map_shapes(fn, v) for k, v in shapes.items()}
    if isinstance(shapes, (list, tuple)):
        return type(shapes)(map_shapes(fn, v) for v in shapes)
    raise ValueError(f"input_shape must be a shape tuple or a nest of them, got {shapes!r}.")


def check_stages(stages):
    """`stages` as a list of K Keras layers; a ValueError naming the bad one."""
    if isinstance(stages, keras.layers.Layer) or not isinstance(stages, (list, tuple)):
        raise ValueError(
            f"stages must be a list of Keras layers (one per stage), got "
            f"{type(stages).__name__}. To cut one model use PipelinedModel.from_model.")
    stages = list(stages)
    if not stages:
        raise ValueError("stages is empty; a pipeline needs at least one stage.")
    for k, stage in enumerate(stages):
        if stage is None or (isinstance(stage, (list, tuple)) and not stage):
            raise ValueError(f"Stage {k} is empty; every stage needs at least one layer.")
        if not isinstance(stage, keras.layers.Layer):
            raise ValueError(
                f"Stage {k} must be a Keras layer or model, got {type(stage).__name__}.")
        if isinstance(stage, keras.Sequential) and not stage.layers:
            raise ValueError(
                f"Stage {k} ({stage.name!r}) is an empty Sequential; every stage "
                f"needs at least one layer.")
    return stages


def _iterated(x):
    """Whether `x` gives its batches only when iterated (generator, PyDataset)."""
    return isinstance(x, keras.utils.PyDataset) or callable(getattr(x, "__next__", None))


def _keras_batch_size(batch_size, x):
    """The batch size Keras will use for `x`: batch_size, or 32 for arrays."""
    if batch_size is not None:
        return batch_size
    if x is None or isinstance(x, tf.data.Dataset) or _iterated(x):
        return None  # batches come ready-made
    return 32


def _dataset_batch_size(x):
    """The rows of a Dataset's full batches: its static batch dimension, else
    the rows of its first batch when a second follows (two elements are
    read). None: not a Dataset, empty, or one batch only, which is its last
    and may be smaller, as an array's last batch may."""
    if not isinstance(x, tf.data.Dataset):
        return None
    for spec in tf.nest.flatten(x.element_spec):
        shape = getattr(spec, "shape", None)
        if shape is not None and shape.rank:
            if shape[0] is not None:
                return shape[0]
            break
    else:
        return None
    batches = list(x.take(2))
    if len(batches) < 2:
        return None
    for leaf in tf.nest.flatten(batches[0]):
        if getattr(leaf, "shape", None) is not None and leaf.shape.rank:
            return int(leaf.shape[0])
    return None


def first_batch(x, y=None, sample_weight=None, batch_size=None):
    """(x for Keras, a function returning the first batch (x, y,
    sample_weight) Keras will see, or None for no data). Arrays, Datasets
    and PyDatasets are read when the function is called; a generator's first
    batch is taken now, and the x returned yields it again first."""
    unpack = keras.utils.unpack_x_y_sample_weight
    if x is None:
        return x, None
    if isinstance(x, tf.data.Dataset):
        return x, lambda: unpack(next(iter(x.take(1))))
    if isinstance(x, keras.utils.PyDataset):
        return x, lambda: unpack(x[0])
    if callable(getattr(x, "__next__", None)):
        try:
            first = next(x)
        except StopIteration:
            return x, None

        def again(rest=x):
            yield first
            yield from rest
        return again(), lambda: unpack(first)
    size = _keras_batch_size(batch_size, x)
    return x, lambda: tuple(None if part is None else
                            tf.nest.map_structure(lambda leaf: leaf[:size], part)
                            for part in (x, y, sample_weight))


def first_batch_values(first_batch, model_name, num_microbatches):
    """The (x, y, sample_weight) `first_batch()` returns (see `first_batch`),
    NumPy floats converted to Keras' float type as Keras converts them; a
    ValueError if there is none (a step traced outside fit and evaluate)."""
    if first_batch is None:
        raise ValueError(
            f"{model_name}: a layer adds a loss in its call, and tfpipe checks on real data "
            f"that it is a mean over rows before the first step of num_microbatches="
            f"{num_microbatches}; this step was traced outside fit, evaluate, train_on_batch "
            f"and test_on_batch, so there is none. Call one of those, or pass "
            f"call_losses='per_microbatch' to skip the check.")
    floatx = keras.config.floatx()
    return tf.nest.map_structure(
        lambda a: tf.convert_to_tensor(a, floatx if a.dtype.kind == "f" else None)
        if isinstance(a, np.ndarray) else a, first_batch())


def check_not_empty_for_predict(x):
    """Refuses `predict` on no rows (plain Keras fails there with an
    UnboundLocalError); `fit` and `evaluate` run no step, as Keras does."""
    if isinstance(x, tf.data.Dataset):
        empty = int(x.cardinality()) == 0
    elif x is None or _iterated(x):
        empty = False
    else:
        leaves = [leaf for leaf in tf.nest.flatten(x) if hasattr(leaf, "shape")]
        empty = bool(leaves) and any(len(leaf.shape) and leaf.shape[0] == 0 for leaf in leaves)
    if empty:
        raise ValueError("predict: x has no rows (an empty array or data set), so there is "
                         "nothing to predict. Pass at least one row.")


def _shape_leaves(shapes):
    """The shapes of a nest of shapes, in `tf.nest.flatten`'s order (dict keys sorted)."""
    if graph_lib.is_shape(shapes):
        return [shapes]
    if isinstance(shapes, dict):
        return [leaf for key in sorted(shapes) for leaf in _shape_leaves(shapes[key])]
    return [leaf for item in shapes for leaf in _shape_leaves(item)]


def check_batched(x, what, built_shape):
    """Refuses a Dataset of single examples (not `.batch()`ed) for a model
    built for `built_shape` (batch dimension first): its feature dimension
    would be read as the batch."""
    if not isinstance(x, tf.data.Dataset) or built_shape is None:
        return
    spec = x.element_spec
    features = spec[0] if isinstance(spec, tuple) else spec
    leaves, shapes = tf.nest.flatten(features), _shape_leaves(built_shape)
    if len(leaves) != len(shapes):
        return  # another structure: Keras' own check names it
    for leaf, built in zip(leaves, shapes):
        shape = getattr(leaf, "shape", None)
        if shape is None or shape.rank is None:
            continue
        if shape.rank == len(built) - 1:
            raise ValueError(
                f"{what}: the tf.data.Dataset yields single examples (x of shape "
                f"{tuple(shape)}), not batches: the model takes {tuple(built)}, batch "
                f"dimension first. Batch it: dataset.batch(batch_size).")


def check_batch(x, batch_size, what, num_microbatches, num_replicas, static_for=None):
    """Refuses batches of `x` that would leave micro-batches empty; `what`
    names the call; `static_for` says why every batch must have one static
    size that is a multiple of M (None: no such need)."""
    m, r = num_microbatches, num_replicas
    if static_for is not None:
        xla.check_static_batch(x, batch_size, m, what, static_for, r)
    for size in (_keras_batch_size(batch_size, x), _dataset_batch_size(x)):
        if size is not None and r > 1 and size < m * r:
            raise ValueError(
                f"{what}: batch size {size} is split over num_replicas={r} "
                f"data-parallel replicas of num_microbatches={m} micro-batches each, "
                f"so some micro-batches would be empty. Use a global batch size of "
                f"at least {m * r} (a multiple of {m * r} keeps every micro-batch "
                f"the same size).")
        if size is not None and size < m:
            raise ValueError(
                f"{what}: batch size {size} is smaller than num_microbatches={m}, "
                f"so {m - size} micro-batch(es) of every batch would be empty. Use a "
                f"batch size of at least {m} (a multiple of {m} keeps every "
                f"micro-batch the same size) or num_microbatches <= {size}.")


def check_labels(x, y, what, has_loss):
    """Arrays without labels for a model compiled with a loss."""
    arrays = not (x is None or isinstance(x, tf.data.Dataset) or _iterated(x))
    if arrays and y is None and has_loss:
        raise ValueError(
            f"{what}: the model was compiled with a loss but the data has no labels "
            f"(y=None). Pass y, or compile without a loss.")


def check_scope(what, strategy):
    """A call under another strategy's scope than the model's own (`strategy`:
    its `PipelineStrategy` or `tfpipe.tpu.TPUPipelineHost`)."""
    if tf.distribute.has_strategy() and \
            tf.distribute.get_strategy() is not strategy.distribute_strategy:
        raise ValueError(
            f"{what}: called under {type(tf.distribute.get_strategy()).__name__}'s "
            f"scope, but this model belongs to its own "
            f"{type(strategy.distribute_strategy).__name__} ({strategy.num_stages} stage "
            f"slots); call it outside any "
            f"strategy scope or inside that one.")


def check_dict_for_one_input(x, what, built_shape):
    """A dict fed to hand-made stages built for one unnamed input."""
    if isinstance(x, dict) and built_shape is not None and not isinstance(built_shape, dict):
        raise ValueError(
            f"{what}: x is a dict (keys {sorted(x)}) but the pipeline takes one input "
            f"of shape {tuple(built_shape)}; pass the array, or use "
            f"PipelinedModel.from_model with keras.Inputs of those names.")


def check_replicated_inputs(x, what, num_replicas):
    """Refuses strings, SparseTensors and RaggedTensors with several replicas:
    Keras' reduction of the first distributed batch fails deep in TF on them."""
    if num_replicas == 1 or x is None:
        return
    if isinstance(x, tf.data.Dataset):
        leaves = tf.nest.flatten(x.element_spec)
    elif _iterated(x):
        return
    else:
        leaves = tf.nest.flatten(x)
    for leaf in leaves:
        kind = None
        if isinstance(leaf, (tf.SparseTensor, tf.SparseTensorSpec)):
            kind = "a tf.SparseTensor"
        elif isinstance(leaf, (tf.RaggedTensor, tf.RaggedTensorSpec)):
            kind = "a tf.RaggedTensor"
        elif (leaf.dtype.kind in "OSU" if isinstance(leaf, np.ndarray)
              else isinstance(leaf, (tf.Tensor, tf.TensorSpec)) and leaf.dtype == tf.string):
            kind = "strings"
        if kind:
            raise ValueError(
                f"{what}: an input is {kind}, which Keras cannot split over the "
                f"strategy's num_replicas={num_replicas} "
                f"data-parallel replicas. Use one replica (num_replicas=1), or turn "
                f"it into a dense numeric tensor in the input pipeline (e.g. "
                f"tf.data .map with the preprocessing layer, tf.sparse.to_dense, "
                f"RaggedTensor.to_tensor).")


def input_spec(x):
    """(shapes, dtype) to build from for arrays or a Dataset; None for iterated inputs."""
    if x is None or _iterated(x):
        return None
    if isinstance(x, tf.data.Dataset):
        spec = x.element_spec
        features = spec[0] if isinstance(spec, tuple) else spec
        leaves = tf.nest.flatten(features)
        shapes = tf.nest.map_structure(lambda s: tuple(s.shape), features)
    else:
        leaves = tf.nest.flatten(x)
        shapes = tf.nest.map_structure(lambda a: (None,) + tuple(np.shape(a))[1:], x)
    dtype = keras.backend.standardize_dtype(leaves[0].dtype) if leaves else None
    return shapes, dtype


def validation_inputs(validation_data):
    """The inputs of `fit`'s `validation_data` (a dataset, or (x, y[, w]))."""
    if validation_data is None or isinstance(validation_data, tf.data.Dataset):
        return validation_data
    return validation_data[0]
