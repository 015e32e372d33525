"""`StepWatchdog`: a frozen worker ends the run, naming the task, instead of hanging it.

A frozen worker (SIGSTOP, a hung host, a partition) makes TensorFlow wait
forever. Once `fit`'s hooks show no progress for `timeout_s`, a watch thread
probes every task's port (`tfpipe.probe`); a task that fails two
probes is named on stderr and the process ends with `os._exit` (the main
thread is blocked inside TensorFlow); else the step is slow, and it waits on.
"""

import os
import sys
import threading
import time

import keras

from tfpipe import cluster as cluster_lib
from tfpipe import probe

EXIT_CODE = 4  # launch.train's exit code for a lost worker, too


class StepWatchdog(keras.callbacks.Callback):
    """Ends the process when a step stalls because a worker froze or died.

    Args:
      timeout_s: seconds without a batch or epoch hook before the tasks are
        probed: more than the slowest step, the first (tracing) one included.
      cluster: what `tfpipe.cluster.cluster_spec` takes; None: the cluster of
        the last `tfpipe.cluster.connect()`.
      probe_timeout_s: seconds a task has to answer each of its two probes.
      exit_code, poll_s: the exit status, and how often the thread looks.
      on_end: fn(message) called, on the watch thread, just before the
        process ends (the default prints the message); e.g. to release a
        lock and say where the last checkpoint is.
    Raises:
      ValueError: a bad number, or no cluster given nor connected.
    """

    def __init__(self, timeout_s, cluster=None, probe_timeout_s=2.0, exit_code=EXIT_CODE,
                 poll_s=0.5, on_end=None):
        super().__init__()
        for name, value in (("timeout_s", timeout_s), ("probe_timeout_s", probe_timeout_s),
                            ("poll_s", poll_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"StepWatchdog({name}=...) must be a number of seconds > 0, "
                                 f"got {value!r}.")
        cluster = cluster if cluster is not None else cluster_lib.connected_spec()
        if cluster is None:
            raise ValueError(
                "StepWatchdog(cluster=None) watches the cluster of tfpipe.cluster.connect(), "
                "but this process has not connected. Connect first, or pass cluster= (a "
                "launch.local_cluster.LocalCluster, a tf.train.ClusterSpec or a resolver).")
        self.addresses = cluster_lib.task_addresses(cluster)
        self.timeout_s, self.probe_timeout_s = float(timeout_s), float(probe_timeout_s)
        self.poll_s, self.exit_code = float(poll_s), exit_code
        self.on_end = on_end or (lambda message: print(message, file=sys.stderr, flush=True))
        self._progress_lock = threading.Lock()
        self._last = time.monotonic()
        self._where = "the start of training"
        self._stop = threading.Event()
        self._thread = None

    def _progress(self, where):
        with self._progress_lock:
            self._last, self._where = time.monotonic(), where

    def start(self, where):
        """Watches from now on: `where` (e.g. "the start-up rendezvous") must
        show progress within `timeout_s`; `fit` starts and stops it itself."""
        self.stop()
        self._progress(where)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="tfpipe-step-watchdog",
                                        daemon=True)
        self._thread.start()

    def stop(self):
        """Stops watching."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.poll_s + 1.0)
            self._thread = None

    def on_train_begin(self, logs=None):
        self.start("the first training step")

    def on_train_end(self, logs=None):
        self.stop()

    def on_epoch_begin(self, epoch, logs=None):
        self._progress(f"epoch {epoch + 1}")

    def on_epoch_end(self, epoch, logs=None):
        self._progress(f"the end of epoch {epoch + 1} (callbacks, checkpoints)")

    def on_train_batch_begin(self, batch, logs=None):
        self._progress(f"training step {batch + 1}")

    def on_train_batch_end(self, batch, logs=None):
        self._progress(f"the callbacks after training step {batch + 1}")

    def on_test_batch_begin(self, batch, logs=None):
        self._progress(f"validation step {batch + 1}")

    def on_test_batch_end(self, batch, logs=None):
        self._progress(f"the callbacks after validation step {batch + 1}")

    def _watch(self):
        warned_at = None  # the progress mark of the stall already reported as slow
        next_probe = 0.0
        while not self._stop.wait(self.poll_s):
            with self._progress_lock:
                last, where = self._last, self._where
            now = time.monotonic()
            if now - last < self.timeout_s or now < next_probe:
                continue
            lost = self._lost_tasks()
            if lost and not self._stop.is_set():
                self._end(where, time.monotonic() - last, lost)
            next_probe = time.monotonic() + self.timeout_s  # slow, not stuck: look again later
            if warned_at != last and not self._stop.is_set():
                warned_at = last
                print(f"tfpipe.StepWatchdog: {where} has run for {now - last:.1f} s (timeout "
                      f"{self.timeout_s:g} s), but every task answers "
                      f"({', '.join(self.addresses)}); still waiting.",
                      file=sys.stderr, flush=True)

    def _lost_tasks(self):
        """{task: "silent" | "dead"} of the tasks that fail two probes in a row."""
        first = probe.probe_tasks(self.addresses, self.probe_timeout_s)
        suspects = {t: self.addresses[t] for t, s in first.items() if s != "ok"}
        if not suspects:
            return {}
        second = probe.probe_tasks(suspects, self.probe_timeout_s)
        return {t: s for t, s in second.items() if s != "ok"}

    def _end(self, where, stalled, lost):
        named = "; ".join(f"{task} ({self.addresses[task]}) {probe.MEANING[state]}"
                          for task, state in lost.items())
        sys.stdout.flush()
        self.on_end(f"tfpipe.StepWatchdog: {where} has not finished after {stalled:.1f} s "
                    f"(timeout {self.timeout_s:g} s): {named}. Ending this process (exit code "
                    f"{self.exit_code}). Restart the worker, then continue from the last "
                    f"checkpoint (launch.train: --resume).")
        os._exit(self.exit_code)  # the main thread is blocked inside TensorFlow
