"""Soak test of the trainer: `python -m benchmarks.soak` (not part of the test suite).

Runs `launch.train.train` for many steps (default 5,000: the digits MLP in 2
stages on 2 logical CPUs, M=2, batch 32, epochs of 500 steps, a checkpoint
every 500 steps, validation after every epoch) and samples, every
`--sample_every` steps, the process' resident memory (VmRSS) and the number
of times TensorFlow traced the training and evaluation functions.

Goals: RSS grows by less than 2% from the first sample after the first epoch
to the end of the run (the first epoch holds every one-off allocation:
tracing, the optimizer slots, the first checkpoint and validation); no trace
after the first epoch (each function traced once, whatever the step or a
short last batch). What grows by design is small and reported: the run's history (one
entry per step, a few hundred kB at 5,000 steps) and TensorBoard's files.

    python -m benchmarks.soak                      # 5,000 steps, about 2 min on 2 cores
    python -m benchmarks.soak --steps=1000 --out=/tmp/soak.json
"""

import json
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads: quieter logs

import argparse  # noqa: E402


def _arguments(argv=None):
    # argparse, not absl flags: launch.train's flags live in the same process.
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5000, help="training steps in all")
    parser.add_argument("--steps_per_epoch", type=int, default=500,
                        help="steps per epoch (validation and a checkpoint after each)")
    parser.add_argument("--sample_every", type=int, default=100,
                        help="sample RSS and trace counts every this many steps")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent /
                                             "results" / "soak.json"),
                        help="where to write the samples and the summary (JSON)")
    args = parser.parse_args(argv)
    for name in ("steps", "steps_per_epoch", "sample_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive integer")
    return args


def rss_mib():
    """Resident set size of this process (VmRSS), MiB."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


def tracing_count(function):
    """Traces of every `tf.function` reachable from `function`'s closures.

    Keras' `model.train_function` is a Python closure over the `tf.function`s
    it calls; each of those counts its own traces
    (`experimental_get_tracing_count`).
    """
    total, seen, todo = 0, set(), [function]
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if hasattr(obj, "experimental_get_tracing_count"):
            total += obj.experimental_get_tracing_count()
            continue
        todo.extend(cell.cell_contents for cell in (getattr(obj, "__closure__", None) or ())
                    if _has_contents(cell))
        todo.append(getattr(obj, "__wrapped__", None))
    return total


def _has_contents(cell):
    try:
        cell.cell_contents  # pylint: disable=pointless-statement
    except ValueError:  # an empty cell
        return False
    return True


def soak(steps=5000, steps_per_epoch=500, sample_every=100, model_dir=None, logical_cpus=2):
    """Trains `steps` steps and returns the samples and the summary (a dict)."""
    import keras  # pylint: disable=import-outside-toplevel

    from launch import train as train_lib  # pylint: disable=import-outside-toplevel

    samples = []

    class Sampler(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.step = 0
            self.start = time.perf_counter()

        def _sample(self):
            model = self.model
            samples.append({
                "step": self.step,
                "seconds": round(time.perf_counter() - self.start, 2),
                "rss_mib": round(rss_mib(), 2),
                "train_traces": tracing_count(model.train_function),
                "test_traces": tracing_count(model.test_function),
            })

        def on_train_batch_end(self, batch, logs=None):
            self.step += 1
            if self.step % sample_every == 0:
                self._sample()

    epochs = -(-steps // steps_per_epoch)
    with tempfile.TemporaryDirectory() as tmp:
        config = train_lib.TrainConfig(
            model="mlp", stages=2, microbatches=2, batch_size=32, logical_cpus=logical_cpus,
            epochs=epochs, steps_per_epoch=steps_per_epoch,
            checkpoint_every=steps_per_epoch, timeline=False, verbose=0,
            model_dir=model_dir or os.path.join(tmp, "run"))
        started = time.perf_counter()
        result = train_lib.train(config, callbacks=[Sampler()])
        seconds = time.perf_counter() - started
    # The baseline: the first sample after the first epoch's validation.
    after_first = [s for s in samples if s["step"] > steps_per_epoch]
    base, last = after_first[0], samples[-1]
    summary = {
        "steps": result["steps"],
        "seconds": round(seconds, 1),
        "step_time_ms": round(result["step_time_ms"], 2),
        "rss_mib_first_sample": samples[0]["rss_mib"],
        "rss_mib_after_first_epoch": base["rss_mib"],
        "rss_mib_last": last["rss_mib"],
        "rss_growth_after_first_epoch": round((last["rss_mib"] - base["rss_mib"])
                                              / base["rss_mib"], 4),
        "rss_max_after_first_epoch": max(s["rss_mib"] for s in after_first),
        "train_traces_after_first_epoch": base["train_traces"],
        "train_traces_last": last["train_traces"],
        "test_traces_after_first_epoch": base["test_traces"],
        "test_traces_last": last["test_traces"],
        "retraces_after_first_epoch": (last["train_traces"] - base["train_traces"]
                                       + last["test_traces"] - base["test_traces"]),
        "final_val_accuracy": round(result["val_accuracy"], 4),
    }
    return {"summary": summary, "samples": samples}


def main(argv=None):
    args = _arguments(argv)
    import tfpipe  # pylint: disable=import-outside-toplevel

    tfpipe.testing.use_logical_cpus(2)
    from benchmarks import common  # pylint: disable=import-outside-toplevel

    out = soak(args.steps, args.steps_per_epoch, args.sample_every)
    out["machine"] = common.machine()
    out["command"] = " ".join(["python -m benchmarks.soak", *sys.argv[1:]])
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for key, value in out["summary"].items():
        print(f"{key:32s} {value}")
    print(f"samples and machine in {args.out}")


if __name__ == "__main__":
    main()
