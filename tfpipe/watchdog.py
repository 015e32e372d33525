"""`StepWatchdog`: a frozen worker ends the run, naming the task, instead of hanging it.

When a worker of a connected cluster dies, the client's next step raises
`UnavailableError` at once. When one freezes (SIGSTOP, a hung host, a network
partition), TensorFlow waits for it forever: `operation_timeout_in_ms`, async
execution and the coordination service do not bound the wait, gRPC
keepalives kill healthy idle connections, and `context.check_alive` on a
frozen task blocks too. So the watchdog asks the kernel instead:

    main thread:   fit -> callback hooks mark progress (every batch/epoch hook)
    watch thread:  every `poll_s`: no progress for `timeout_s`?
                     -> probe every task's port (HTTP/2 preface, expect the
                        server's SETTINGS frame within `probe_timeout_s`)
                     -> a task is "silent" (accepts, never answers: frozen) or
                        "dead" (refuses: gone): print which to stderr and
                        os._exit(exit_code) (the main thread is blocked inside
                        TensorFlow; nothing else would stop it)
                     -> every task answers: the step is slow, not stuck; say so
                        once and wait another `timeout_s`

A run ends within `timeout_s` + `poll_s` + 2 probes of the freeze (measured in
BUILD.md, "Several hosts"). Checkpoints are never left half-committed by the
exit: a checkpoint counts only once its manifest is written, last.
"""

import os
import socket
import sys
import threading
import time

import keras

EXIT_CODE = 4  # launch.train's exit code for a lost worker, too

# RFC 9113 section 3.4: the client's connection preface, then its (empty)
# SETTINGS frame. A live HTTP/2 server (gRPC) must answer with a SETTINGS frame.
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_SETTINGS = 0x4  # frame type, byte 3 of the 9-byte frame header


def probe_task(address, timeout_s=2.0):
    """Whether the gRPC server at `address` ("host:port") answers now.

    Returns:
      "ok": it sent an HTTP/2 SETTINGS frame within `timeout_s` seconds;
      "silent": the connection was accepted (by the kernel) but nothing came
        back in time: the process is stopped or its host hung;
      "dead": the connection was refused or failed: nothing listens there.
    """
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except socket.timeout:
        return "silent"  # a partitioned host: the SYN is never answered
    except OSError:
        return "dead"
    with sock:
        try:
            sock.sendall(_PREFACE)
            header = b""
            while len(header) < 9:
                left = deadline - time.monotonic()
                if left <= 0:
                    return "silent"
                sock.settimeout(left)
                chunk = sock.recv(9 - len(header))
                if not chunk:
                    return "dead"  # closed without a frame
                header += chunk
        except socket.timeout:
            return "silent"
        except OSError:
            return "dead"
    return "ok" if header[3] == _SETTINGS else "dead"


def probe_tasks(addresses, timeout_s=2.0):
    """{task: probe_task(address)} for {task: address}, probed in parallel
    (the whole probe takes at most `timeout_s` + a thread start)."""
    states = {}

    def run(task, address):
        states[task] = probe_task(address, timeout_s)

    threads = [threading.Thread(target=run, args=item, daemon=True)
               for item in addresses.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5.0)
    return {task: states.get(task, "silent") for task in addresses}


# What a probe's answer means, as the messages say it.
MEANING = {"silent": "accepts connections but does not answer: the process is stopped "
                      "or its host is hung",
            "dead": "refuses connections: the process is gone"}


class StepWatchdog(keras.callbacks.Callback):
    """Ends the process when a step stalls because a worker froze or died.

    Args:
      timeout_s: seconds without progress (no batch or epoch hook of `fit`,
        `evaluate` or `predict`) before the tasks are probed. More than the
        slowest step, the first (tracing) one included.
      cluster: what `tfpipe.cluster.cluster_spec` takes (a LocalCluster, a
        ClusterSpec, a resolver, ...); None: the cluster of the last
        `tfpipe.cluster.connect()`.
      probe_timeout_s: seconds a task has to answer its probe. A task must
        fail two probes in a row.
      exit_code: the process's exit status when it ends it (default 4).
      poll_s: how often the watch thread looks, in seconds.

    Raises:
      ValueError: a bad number, or no cluster given nor connected.
    """

    def __init__(self, timeout_s, cluster=None, probe_timeout_s=2.0, exit_code=EXIT_CODE,
                 poll_s=0.5):
        super().__init__()
        for name, value in (("timeout_s", timeout_s), ("probe_timeout_s", probe_timeout_s),
                            ("poll_s", poll_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"StepWatchdog({name}=...) must be a number of seconds > 0, "
                                 f"got {value!r}.")
        from tfpipe import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
        cluster = cluster if cluster is not None else cluster_lib.connected_spec()
        if cluster is None:
            raise ValueError(
                "StepWatchdog(cluster=None) watches the cluster of tfpipe.cluster.connect(), "
                "but this process has not connected. Connect first, or pass cluster= (a "
                "tfpipe.cluster.LocalCluster, a tf.train.ClusterSpec or a resolver).")
        self.addresses = cluster_lib.task_addresses(cluster)
        self.timeout_s, self.probe_timeout_s = float(timeout_s), float(probe_timeout_s)
        self.poll_s, self.exit_code = float(poll_s), exit_code
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._where = "the start of training"
        self._stop = threading.Event()
        self._thread = None

    # -- progress: every hook of the main thread ------------------------------------

    def _progress(self, where):
        with self._lock:
            self._last, self._where = time.monotonic(), where

    def on_train_begin(self, logs=None):
        self._progress("the first training step")
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="tfpipe-step-watchdog",
                                        daemon=True)
        self._thread.start()

    def on_train_end(self, logs=None):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.poll_s + 1.0)

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

    # -- the watch thread ---------------------------------------------------------------

    def _watch(self):
        warned_at = None  # the progress mark of the stall already reported as slow
        next_probe = 0.0
        while not self._stop.wait(self.poll_s):
            with self._lock:
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
        first = probe_tasks(self.addresses, self.probe_timeout_s)
        suspects = {t: self.addresses[t] for t, s in first.items() if s != "ok"}
        if not suspects:
            return {}
        second = probe_tasks(suspects, self.probe_timeout_s)
        return {t: s for t, s in second.items() if s != "ok"}

    def _end(self, where, stalled, lost):
        named = "; ".join(f"{task} ({self.addresses[task]}) {MEANING[state]}"
                          for task, state in lost.items())
        print(f"tfpipe.StepWatchdog: {where} has not finished after {stalled:.1f} s "
              f"(timeout {self.timeout_s:g} s): {named}. Ending this process (exit code "
              f"{self.exit_code}). Restart the worker, then continue from the last "
              f"checkpoint (launch.train: --resume).", file=sys.stderr, flush=True)
        sys.stdout.flush()
        from tfpipe import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
        cluster_lib.kill_local_workers()  # os._exit runs no atexit handler
        os._exit(self.exit_code)  # the main thread is blocked inside TensorFlow
