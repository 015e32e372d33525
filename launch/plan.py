"""Prints `tfpipe.plan` for a zoo model before any training: `python -m launch.plan`.

    python -m launch.plan --model=mlp --stages=4 --microbatches=4
    python -m launch.plan --model=transformer --stages=2 --microbatches=8 --batch_size=32
    python -m launch.plan --model=unet --stages=4 --microbatches=2 --device_memory_mib=64
    python -m launch.plan --model=resnet --json        # the plan as JSON

The model is built exactly as `launch.train` builds it (`launch.trainer`:
the same builders, data shapes and `PipelineStrategy`), but nothing is
trained and nothing is written. The table has one row per stage
(parameters, parameter / optimizer-state / gradient bytes, activation bytes
per micro-batch and at their peak, predicted peak memory, forward and
backward milliseconds per micro-batch, each layer timed alone), the totals,
the step time relative to other plans (not to a run's) and the bubble, and
a recommended M, balance, schedule and recompute mode for the devices at
hand. `tfpipe/planner.py` says what is measured and what is
predicted.

Flags are checked before TensorFlow starts (`launch.config`): a bad one is
one line and exit code 1.
"""

import dataclasses
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads: quieter logs

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from launch import config as config_lib  # noqa: E402
from launch.config import TrainConfig  # noqa: E402
from launch.errors import RunError  # noqa: E402

_DEFAULTS = TrainConfig()
FLAGS = flags.FLAGS


def define_flags():
    """Defines the flags; only when run as a program, so that importing
    `plan_run` beside `launch.train` (which defines the same names) is fine."""
    flags.DEFINE_enum("model", _DEFAULTS.model, sorted(config_lib.MODEL_DATA), "Model to plan.")
    flags.DEFINE_integer("depth", _DEFAULTS.depth, "As launch.train's --depth.")
    flags.DEFINE_string("dataset", _DEFAULTS.dataset,
                        "As launch.train's --dataset: it fixes the model's input and output "
                        "shapes.")
    flags.DEFINE_integer("stages", _DEFAULTS.stages, "Pipeline stages K.")
    flags.DEFINE_integer("microbatches", _DEFAULTS.microbatches, "Micro-batches M per step.")
    flags.DEFINE_integer("batch_size", _DEFAULTS.batch_size, "Rows per training step.")
    flags.DEFINE_string("schedule", _DEFAULTS.schedule,
                        "auto (tfpipe's choice), gpipe, 1f1b, interleaved[:v], zbh1, zbv or "
                        "NAME/segments=N.")
    flags.DEFINE_enum("recompute", _DEFAULTS.recompute, list(config_lib.RECOMPUTE_MODES),
                      "always, except_last, never, or auto (tfpipe's default).")
    flags.DEFINE_enum("execution", _DEFAULTS.execution, list(config_lib.EXECUTIONS),
                      "auto (tfpipe's choice), unrolled, stage_functions or loop (loop "
                      "recomputes always).")
    flags.DEFINE_integer("logical_cpus", _DEFAULTS.logical_cpus,
                         "Logical CPU devices when there is no GPU.")
    flags.DEFINE_string("optimizer", "adam",
                        "Optimizer whose state is counted: adam, sgd, sgd+momentum, rmsprop, ...")
    flags.DEFINE_float("device_memory_mib", 0.0,
                       "Memory of each device in MiB; the recommendation then only takes "
                       "configurations that fit (0: no limit).")
    flags.DEFINE_integer("repeats", 2, "Timed runs per unit (the fastest counts).")
    flags.DEFINE_bool("json", False, "Print plan.to_dict() as JSON instead of the table.")



def config_from_flags():
    return TrainConfig(**{field.name: FLAGS[field.name].value
                          for field in dataclasses.fields(TrainConfig)
                          if field.name in FLAGS})


def plan_run(config, optimizer="adam", device_memory_bytes=None, repeats=2):
    """The `tfpipe.Plan` of the pipeline `launch.train` would build for `config`."""
    config_lib.check(config)
    from launch import data as data_lib  # pylint: disable=import-outside-toplevel
    from launch.quiet import quiet_start_up  # pylint: disable=import-outside-toplevel
    with quiet_start_up():
        from launch import model_specs  # pylint: disable=import-outside-toplevel  (imports TF)
        from launch import run_devices  # pylint: disable=import-outside-toplevel
        import tfpipe  # pylint: disable=import-outside-toplevel

    tfpipe.testing.use_logical_cpus(config.logical_cpus)
    spec = model_specs.MODELS[config.model]
    dataset = spec.default_dataset if config.dataset == "auto" else config.dataset
    try:
        data = data_lib.load(dataset, seed=config.seed, data_dir=config.data_dir,
                             max_examples=config.max_examples)
    except ValueError as err:
        raise RunError(str(err)) from None
    with run_devices.pipeline_strategy(config).scope():
        model = spec.build(config, data, **run_devices.model_settings(config))
    try:
        return tfpipe.plan(model, config.batch_size, config.microbatches, optimizer=optimizer,
                           device_memory_bytes=device_memory_bytes, repeats=repeats)
    except ValueError as err:
        raise RunError(str(err)) from None


def main(argv):
    if len(argv) > 1:
        print(f"launch.plan: error: unexpected arguments {argv[1:]} (flags take the form "
              f"--name=value; --helpfull lists them)", file=sys.stderr)
        return 1
    config = config_from_flags()
    problems = config_lib.problems(config)
    if FLAGS.device_memory_mib < 0:
        problems.append(f"--device_memory_mib={FLAGS.device_memory_mib}: must be >= 0 "
                        f"(0: no limit)")
    if problems:
        print(f"launch.plan: error: {problems[0]}", file=sys.stderr)
        return 1
    limit = FLAGS.device_memory_mib * 2**20 if FLAGS.device_memory_mib else None
    try:
        result = plan_run(config, FLAGS.optimizer, limit, FLAGS.repeats)
    except RunError as err:
        print(f"launch.plan: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    except ValueError as err:  # e.g. an unknown --optimizer
        print(f"launch.plan: error: {err}", file=sys.stderr, flush=True)
        return 1
    print(json.dumps(result.to_dict(), indent=2) if FLAGS.json else result)
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
