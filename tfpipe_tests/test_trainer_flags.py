"""launch.train's bad input: a bad flag is one line and exit code 1 before
TensorFlow starts; a bad setting given to `train()` is a `RunError` naming it.

The flag checks are `launch/config.py`'s, which asks the library's own rules
(`tfpipe.schedules`, `tfpipe.config`, pure Python) in the flags' words.
"""

import time

import pytest

from launch import config as config_lib
from launch import errors
from launch import data as data_lib
from launch import train as train_lib
from tfpipe import actions
from tfpipe_tests import helpers
from tfpipe_tests.trainer_runs import config as _config


# Runs `python -m launch.train ARGS` and says at exit whether TensorFlow was imported.
_MAIN_REPORTING_TF = (
    "import atexit, runpy, sys\n"
    "atexit.register(lambda: sys.stderr.write("
    "'tensorflow imported: %s\\n' % ('tensorflow' in sys.modules)))\n"
    "sys.argv = ['launch.train'] + sys.argv[1:]\n"
    "runpy.run_module('launch.train', run_name='__main__', alter_sys=True)\n")

BAD_FLAGS = [
    ("--batch_size=0", "flag --batch_size=0: must be a positive integer (rows per training "
                       "step), got 0"),
    ("--batch_size=x", "flag --batch_size=x: invalid literal for int() with base 10: 'x'"),
    ("--epochs=-1", "flag --epochs=-1: must be a positive integer (training epochs), got -1"),
    ("--epochs=0", "flag --epochs=0: must be a positive integer (training epochs), got 0"),
    ("--steps_per_epoch=-3", "flag --steps_per_epoch=-3: must be an integer >= 0 (0: one pass "
                             "over the training data), got -3"),
    ("--stages=0", "flag --stages=0: must be a positive integer (pipeline stages), got 0"),
    ("--microbatches=0", "flag --microbatches=0: must be a positive integer (micro-batches per "
                         "training batch), got 0"),
    ("--depth=-1", "flag --depth=-1: must be an integer >= 0 (0: 4), got -1"),
    ("--max_examples=-1", "flag --max_examples=-1: must be an integer >= 0 (0: all), got -1"),
    ("--logical_cpus=0", "flag --logical_cpus=0: must be a positive integer (logical CPU "
                         "devices), got 0"),
    ("--checkpoint_every=-1", "flag --checkpoint_every=-1: must be an integer >= 0 (steps; 0: "
                              "only at epoch ends and the end), got -1"),
    ("--learning_rate=0", "flag --learning_rate=0.0: must be a finite number > 0, got 0.0"),
    ("--learning_rate=nan", "flag --learning_rate=nan: must be a finite number > 0, got nan"),
    ("--seed=-1", "flag --seed=-1: must be an integer from 0 to 2**32 - 1, got -1"),
    ("--model=vgg", "flag --model=vgg: value should be one of <mlp|resnet|transformer|unet>"),
    ("--recompute=sometimes", "flag --recompute=sometimes: value should be one of "
                              "<auto|always|except_last|never>"),
    ("--execution=graph", "flag --execution=graph: value should be one of "
                          "<auto|unrolled|stage_functions|loop>"),
    ("--schedule=gpipee", "flag --schedule=gpipee: unknown schedule 'gpipee'; valid choices: "
                          "auto, gpipe, 1f1b, interleaved (2 stages per device), interleaved:V (V "
                          "stages per device, V >= 1), zbh1, zbv (2 stages per device, in a "
                          "V), or NAME/segments=N (each stage recomputed in N pieces)"),
    ("--schedule=interleaved:0", "flag --schedule=interleaved:0: interleaved:V needs V >= 1 "
                                 "stages per device, got 'interleaved:0'"),
    ("--dataset=mnist", "flag --dataset=mnist: unknown dataset 'mnist'; valid choices: auto, "
                        "digits, digits_masks, pydoc_topics, or tfds:NAME (a TensorFlow "
                        "Datasets data set prepared under --data_dir)"),
    ("--dataset=tfds:", "flag --dataset=tfds:: 'tfds:' needs a TFDS name, e.g. tfds:mnist"),
    ("--model_dir=/dev/null", "flag --model_dir=/dev/null: /dev/null exists and is not a "
                              "directory"),
    ("--microbatches=7 --batch_size=4",
     "flags microbatches=7, batch_size=4: --microbatches=7 is more than the training batch "
     "(--batch_size=4): 3 of the 7 micro-batches of every training step would be empty. Use "
     "--microbatches <= 4, or --batch_size >= 7."),
    ("--model=transformer --dataset=digits",
     "flags model=transformer, dataset=digits: --model=transformer trains on text data, but "
     "--dataset=digits is image data (models for it: mlp, resnet)."),
    ("--model=unet --dataset=pydoc_topics",
     "flags model=unet, dataset=pydoc_topics: --model=unet trains on segmentation data, but "
     "--dataset=pydoc_topics is text data (models for it: transformer)."),
    ("--stages=3 --schedule=interleaved",
     "flags stages=3, schedule=interleaved, microbatches=4: --schedule=interleaved puts 2 "
     "stages on each device, so --stages must be a multiple of 2; got --stages=3. Use "
     "--stages=4."),
    ("--stages=4 --schedule=interleaved --microbatches=3",
     "flags stages=4, schedule=interleaved, microbatches=3: --schedule=interleaved:2 needs "
     "--microbatches to be a multiple of its 2 devices; got --microbatches=3. Use "
     "--microbatches=4, or --schedule=1f1b."),
    ("--stages=3 --schedule=zbv",
     "flags stages=3, schedule=zbv, microbatches=4: --schedule=zbv puts 2 stages on each "
     "device, so --stages must be a multiple of 2; got --stages=3. Use --stages=4."),
    ("--execution=loop --recompute=never",
     "flags execution=loop, recompute=never: --execution=loop keeps only the stage inputs "
     "and recomputes every stage in the backward pass, so it needs --recompute=always (or "
     "auto); got --recompute=never. Use --execution=unrolled for 'never'."),
    ("--reshard --stages=2", "flags reshard=True, resume=False: --reshard changes the stage "
                             "layout of a resumed run; it needs --resume (a fresh run takes "
                             "any --stages without it)."),
    ("--replicas=0", "flag --replicas=0: unknown replicas '0'; valid choices: N >= 1 (N "
                     "data-parallel copies of the pipeline in this process, on N x the "
                     "pipeline's devices), or tf_config (this process is one replica of the "
                     "TF_CONFIG cluster; every worker runs the same command)"),
    ("--replicas=2 --cluster=local:2 --stages=2",
     "flags replicas=2, cluster=local:2: --replicas=2 with --cluster=local:2: data "
     "parallelism over stages on remote workers is not built. Use --cluster (one pipeline "
     "over the workers) or --replicas (pipelines here, or one per TF_CONFIG worker "
     "process), not both."),
    ("--replicas=tf_config",
     "flags replicas=tf_config, cluster=: --replicas=tf_config: every worker process runs "
     "this command with its own TF_CONFIG, which must name the cluster and this process's "
     "task, e.g. TF_CONFIG='{\"cluster\": {\"worker\": [\"host0:port\", \"host1:port\"]}, "
     "\"task\": {\"type\": \"worker\", \"index\": 0}}'."),
    ("--epochs=2 extra", "launch.train: error: unexpected arguments ['extra'] (flags take the "
                         "form --name=value; --helpfull lists them)"),
    ("--batch_size=99999999999999", "flag --batch_size=99999999999999: must be at most "
                                    "2**31 - 1 (rows per training step), got 99999999999999"),
    ("--tpu=local --cluster=local:2 --stages=2",
     "flags tpu=local, cluster=local:2, replicas=1, microbatches=4, batch_size=64: --tpu=local "
     "with --cluster=local:2: a TPU's replicas are its own cores, placed by TPUStrategy. Use "
     "--tpu alone (--replicas=N for N pipelines on the TPU's cores), or --cluster=local:2 "
     "without --tpu."),
    ("--tpu=my_tpu --replicas=2 --batch_size=12",
     "flags tpu=my_tpu, cluster=, replicas=2, microbatches=4, batch_size=12: --tpu=my_tpu "
     "compiles one program per replica, so every micro-batch has one static size: "
     "--batch_size=12 must be a multiple of --microbatches x --replicas = 4 x 2 = 8."),
    ("--stages=8", "flags stages=8, schedule=auto, replicas=1, logical_cpus=4, cluster=, tpu=: "
                   "--stages=8 with --schedule=auto needs 8 devices, but --logical_cpus=4 "
                   "(and there is no GPU). Use --logical_cpus=8."),
]


@pytest.mark.parametrize("flags_, line", [pytest.param(f, m, id=f) for f, m in BAD_FLAGS])
def test_a_bad_flag_is_one_line_before_tensorflow_starts(tmp_path, flags_, line):
    start = time.monotonic()
    proc = helpers.run_child(["-c", _MAIN_REPORTING_TF, f"--model_dir={tmp_path}/run",
                              *flags_.split()], timeout=60)
    elapsed = time.monotonic() - start
    expected = [line] if line.startswith("launch.train: error:") else [
        f"FATAL Flags parsing error: {line}",
        "Pass --helpshort or --helpfull to see help on flags."]
    assert proc.stderr.splitlines() == [*expected, "tensorflow imported: False"]
    assert proc.returncode == 1 and proc.stdout == ""
    assert elapsed < 5  # TensorFlow alone takes 5-8 s to import here
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("changes, message", [
    ({"batch_size": 0}, "batch_size=0: must be a positive integer (rows per training step), "
                        "got 0"),
    ({"model": "vgg"}, "model='vgg': unknown model 'vgg'; valid choices: mlp, resnet, "
                       "transformer, unet"),
    ({"verbose": 3}, "verbose=3: must be None, 0, 1 or 2, got 3"),
    ({"microbatches": 64, "batch_size": 32},
     "--microbatches=64 is more than the training batch (--batch_size=32): 32 of the 64 "
     "micro-batches of every training step would be empty. Use --microbatches <= 32, or "
     "--batch_size >= 64."),
    ({"max_examples": 1}, "--dataset=digits has 1 training example(s) (--max_examples=1), "
                          "fewer than --microbatches=2: every training batch would leave "
                          "micro-batches empty. Use more examples or fewer micro-batches."),
    ({"stages": 8}, "--stages=8 with --schedule=auto needs 8 devices, but --logical_cpus=4 "
                    "(and there is no GPU). Use --logical_cpus=8."),
    ({"stages": 2, "replicas": "4"},
     "--stages=2 with --schedule=auto and --replicas=4 needs 8 devices, but "
     "--logical_cpus=4 (and there is no GPU). Use --logical_cpus=8."),
    ({"dataset": "tfds:no_such_set_xyz", "data_dir": "/nonexistent/tfds"},
     "TensorFlow Datasets has no data set 'no_such_set_xyz': it is neither a registered TFDS "
     "name nor prepared under /nonexistent/tfds. Prepare it on a machine with network access "
     "(`tfds build no_such_set_xyz --data_dir=DIR`, or tfds.builder('no_such_set_xyz', "
     "data_dir=DIR).download_and_prepare()), copy DIR here and pass --data_dir=DIR."),
], ids=["batch_size_0", "unknown_model", "verbose_3", "microbatches_over_batch",
        "fewer_examples_than_microbatches", "more_devices_than_logical_cpus",
        "more_replicas_than_logical_cpus", "tfds_data_set_missing"])
def test_a_bad_train_config_raises_a_run_error(tmp_path, changes, message):
    with pytest.raises(errors.RunError) as err:
        train_lib.train(_config(tmp_path / "run", **changes))
    assert str(err.value) == message


def test_flag_choices_match_the_library():
    import tfpipe  # pylint: disable=import-outside-toplevel

    assert config_lib.RECOMPUTE_MODES[1:] == actions.RECOMPUTE_MODES
    assert config_lib.EXECUTIONS[1:] == tuple(tfpipe.config.EXECUTIONS)
    from launch import model_specs  # pylint: disable=import-outside-toplevel

    assert sorted(model_specs.MODELS) == train_lib.MODEL_NAMES
    assert set(data_lib.BUILTIN_KINDS) == set(data_lib.BUILTIN)
    for name, kind in data_lib.BUILTIN_KINDS.items():  # what the flag check assumes
        assert data_lib.load(name, max_examples=2).kind == kind
