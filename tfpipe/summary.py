"""The stage table `PipelinedModel.summary()` prints after Keras' own."""

import keras
import numpy as np
import tensorflow as tf

from tfpipe import config as config_lib
from tfpipe import schedules


def stage_table(stages, stage_devices, outputs, config, num_devices, replica_devices,
                balance, balance_method):
    """A text table of stages: device (replica 0's), layer count, parameter
    count, output (`outputs`: each stage's symbolic output, or None)."""
    k = len(stages)
    sim = schedules.simulate(config.schedule, config.num_microbatches, num_devices)
    lines = [
        f"Pipeline: {k} stage(s) on {num_devices} device(s) x "
        f"{config.num_microbatches} micro-batch(es), schedule={config.schedule.name}"
        f"{_schedule_note(config)}, "
        f"recompute={config.recompute}{_recompute_note(config)}, execution={config.execution}"
        f"{' (tfpipe chose it)' if config.execution_chosen else ''}, "
        f"call_losses={config.call_losses}, "
        f"schedule's ideal bubble (F=1, B=2)={sim.bubble_fraction:.1%}, "
        f"peak live activations per device={sim.peak_activations}",
        f"{'stage':<7}{'name':<24}{'device':<46}{'layers':>7}{'params':>12}  output",
    ]
    outputs = outputs or [None] * k
    seen = set()
    for i, (stage, device) in enumerate(zip(stages, stage_devices)):
        n_layers = len(stage.layers) if hasattr(stage, "layers") else 1
        own = [v for v in stage.weights if id(v) not in seen]
        seen.update(id(v) for v in own)
        params = sum(int(np.prod(v.shape)) for v in own)
        shape = "" if outputs[i] is None else describe_shapes(outputs[i])
        lines.append(f"{i:<7}{stage.name:<24}{str(device):<46}{n_layers:>7}{params:>12,}  "
                     f"{shape}")
    if len(replica_devices) > 1:
        lines.append(
            f"Data parallel: {len(replica_devices)} replicas; the devices above "
            f"are replica 0's, replica r runs stage k on " + "; ".join(
                f"r={r}: {devices}" for r, devices in enumerate(replica_devices) if r))
    if balance is not None:
        how = ("as given to from_model" if balance_method == "explicit"
               else f"from_model, by {balance_method}")
        lines.append(f"Balance: {balance} units per stage ({how})")
    return "\n".join(lines)


def _schedule_note(config):
    if not config.schedule_chosen:
        return ""
    why = config.schedule_reason or config_lib.default_schedule_reason(
        config.num_microbatches, config.schedule.name)
    return f" (tfpipe chose it: {why})"


def _recompute_note(config):
    if not config.recompute_chosen:
        return ""
    if config.recompute_pending:
        return " (until the first training step, where tfpipe chooses it from memory)"
    return f" (tfpipe chose it: {config.recompute_reason})"


def describe_shapes(structure):
    """'(None, 16)' of a tensor, '[(None, 4), (None, 4)]' of a nest."""
    shapes = [tuple(t.shape) for t in tf.nest.flatten(structure) if t is not None]
    return str(shapes[0]) if len(shapes) == 1 else str(shapes)


def describe(structure):
    """'shape (None, 2, 2), float32' of a tensor, or of each leaf of a nest."""
    leaves = [t for t in tf.nest.flatten(structure) if t is not None]
    parts = [f"shape {tuple(t.shape)}, {keras.backend.standardize_dtype(t.dtype)}"
             for t in leaves]
    return parts[0] if len(parts) == 1 else "; ".join(parts)
