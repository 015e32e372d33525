"""Writing files so that a crash leaves the old version or the new, never half."""

import contextlib
import hashlib
import json
import os
import pathlib
import secrets
import shutil


def atomic_write(path, data, record=None):
    """Writes `data` (str or bytes) to `path`: all of it, or nothing.

    The bytes go to a uniquely named temporary file in the same directory
    (`.NAME.RANDOM.tmp`), which is fsynced and renamed over `path`; then the
    directory is fsynced. A crash leaves the old file or the new one, plus at
    most a temporary file (`remove_temporary_files` clears those). `record`
    (a `launch.outputs.Record`): both names are recorded before they exist.
    A link at `path` is replaced, never written through.
    """
    path = pathlib.Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    if record is not None:
        record.add(tmp)
        record.add(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory):
    """fsyncs `directory` itself (its entries: a rename is durable after it)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_temporary_files(directory, record):
    """Deletes what interrupted writes of this trainer left in `directory`:
    `.NAME.*.tmp` files (`atomic_write`) and `.ckpt-N.tmp-*` files and
    directories (checkpoint saves), those `record` (a
    `launch.outputs.Record`) names. Call it only while holding the run's lock."""
    directory = pathlib.Path(directory)
    if not directory.is_dir() or directory.is_symlink():
        return
    for entry in directory.iterdir():
        if (entry.name.startswith(".") and (entry.name.endswith(".tmp") or ".tmp-" in entry.name)
                and record.owns(entry)):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def canonical(body):
    return json.dumps(body, sort_keys=True, separators=(",", ":"))
