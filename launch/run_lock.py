"""One run per --model_dir: an exclusive lock, held for the whole run.

`RunLock(model_dir)` takes an exclusive `flock` on MODEL_DIR/.lock and writes
its pid, host and start time into it. A second run on the same directory
(another process, or another `train()` in this one) fails at once with
`ModelDirBusy`, naming the holder's pid; it never touches the directory.

The kernel drops a `flock` when its process dies, kill -9 included, so a lock
can never outlive its run: a later run takes the lock over and says whose it
was. The file itself is never deleted (deleting a lock file another process
has opened lets two processes hold "the" lock); a clean exit empties it, so a
non-empty file that no one holds means the previous run did not end cleanly.

Linux and macOS (`fcntl.flock`); on a file system without `flock` (some NFS
mounts) taking the lock fails with a `RunError` that says so.
"""

import datetime
import errno
import fcntl
import os
import socket
import time

from launch.errors import ModelDirBusy, RunError

LOCK_FILE = ".lock"


class RunLock:
    """An exclusive lock on a run directory; a context manager.

    Attributes:
      path: the lock file.
      previous: what the lock file said when this run took it over from a run
        that ended without releasing it (e.g. "pid 123 on host, since ..."),
        else None.
    """

    def __init__(self, model_dir):
        self.model_dir = str(model_dir)
        self.path = os.path.join(self.model_dir, LOCK_FILE)
        self.previous = None
        self._fd = None

    def acquire(self):
        try:
            os.makedirs(self.model_dir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunError(f"cannot use --model_dir={self.model_dir}: {err.strerror} "
                           f"({err.filename}).") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read(fd, tries=20)
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunError(f"cannot lock --model_dir={self.model_dir} ({self.path}): "
                               f"{err.strerror}; its file system may not support "
                               f"flock.") from None
            pid = holder.split()[1] if holder.startswith("pid ") else None
            raise ModelDirBusy(
                f"--model_dir={self.model_dir} is in use by another run "
                f"({holder or 'pid not yet written'}); two runs in one directory would mix "
                f"their checkpoints. Wait for it to end"
                f"{f', stop it (kill {pid})' if pid else ''}, or pass another "
                f"--model_dir.") from None
        try:
            self.previous = _read(fd, tries=1) or None
            started = datetime.datetime.now().isoformat(timespec="seconds")
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n"
                      .encode(), 0)
            os.fsync(fd)
            self._fd = fd
        except BaseException:  # a signal's `Interrupted` too: never left half taken
            os.ftruncate(fd, 0)
            os.close(fd)
            raise
        return self

    def check(self):
        """Raises `RunError` if the lock file was deleted or replaced while
        this run held it: a later run may then hold a lock of its own on the
        new file and write here too. `launch.train` checks before each save."""
        if self._fd is None:
            return
        mine = os.fstat(self._fd)
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            now = None
        if now is None or (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev):
            raise RunError(
                f"--model_dir={self.model_dir}: its lock file {self.path} was deleted or "
                f"replaced during this run, so another run may be writing there too. "
                f"Stopped before saving; the newest committed checkpoint is intact. Make "
                f"sure one run uses the directory, then --resume.")

    def release(self):
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # a clean end: an empty, unlocked file
        os.close(self._fd)  # closing the last descriptor drops the flock
        self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _read(fd, tries):
    """The holder line of the lock file; a busy lock's is retried for up to 0.2 s,
    as a new holder writes it just after it takes the lock."""
    for attempt in range(tries):
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if text or attempt == tries - 1:
            return text
        time.sleep(0.01)
    return ""
