"""The run's history inside its checkpoints, as a chain of segment files.

Each checkpoint save writes only what the history gained since the previous
save, to MODEL_DIR/checkpoints/history/steps-N.json (N: the checkpoint's
step), with the name and SHA-256 of the segment before it; the checkpoint's
manifest names the newest segment. A save so costs O(steps since the last
save), not O(run length) (the whole history in every manifest was 26 MiB a
save at 300k steps). Reading a checkpoint's history walks its chain back to
step 0 and verifies every segment: once, at a resume.

Segments are never rotated with the checkpoints (every later checkpoint's
chain runs through them); a resume deletes those past its step, which only
checkpoints it skipped could name. Pure Python.
"""

import hashlib
import json
import pathlib
import re

from launch.files import atomic_write, canonical

FORMAT = 1
KEYS = ("steps", "epochs", "changes")  # the history's lists a segment extends
_SEGMENT_FILE = re.compile(r"steps-([0-9]+)\.json")


class BrokenChain(ValueError):
    """A segment is missing, damaged or out of order; the message says which."""


def name(step):
    return f"steps-{int(step):010d}.json"


def write(directory, step, tail, previous, record):
    """Writes the segment of checkpoint `step`: `tail` (a dict of the lists in
    `KEYS`, what the history gained since `previous`, the newest segment's
    reference or None), recorded in `record` (`launch.outputs.Record`).
    Returns this segment's reference {name, sha256}."""
    directory = pathlib.Path(directory)
    record.make_dir(directory)
    body = {"format": FORMAT, "step": int(step), "previous": previous,
            **{k: list(tail[k]) for k in KEYS}}
    text = canonical(body)
    atomic_write(directory / name(step), text, record)
    return {"name": name(step), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def read(directory, ref):
    """The lists in `KEYS`, from step 0 to the segment `ref` names, each
    segment verified. Raises `BrokenChain` naming the first bad one."""
    directory = pathlib.Path(directory)
    chain = []
    while ref is not None:
        if not isinstance(ref, dict) or not _SEGMENT_FILE.fullmatch(str(ref.get("name"))):
            raise BrokenChain(f"a history segment reference is unreadable ({ref!r})")
        path = directory / ref["name"]
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise BrokenChain(f"its history segment {path.name} is missing") from None
        except (OSError, UnicodeDecodeError) as err:
            raise BrokenChain(f"its history segment {path.name} is unreadable ({err})") from None
        if hashlib.sha256(text.encode()).hexdigest() != ref.get("sha256"):
            raise BrokenChain(f"its history segment {path.name} does not match its checksum "
                              f"(damaged)")
        body = json.loads(text)
        chain.append(body)
        ref = body.get("previous")
    out = {k: [] for k in KEYS}
    for body in reversed(chain):
        for k in KEYS:
            out[k] += body[k]
    return out


def prune_after(directory, step, record):
    """Deletes the segments of steps after `step` (of checkpoints a resume
    skipped) that `record` names."""
    directory = pathlib.Path(directory)
    if not directory.is_dir() or directory.is_symlink():
        return
    for entry in directory.iterdir():
        match = _SEGMENT_FILE.fullmatch(entry.name)
        if match and int(match.group(1)) > step and record.owns(entry):
            entry.unlink(missing_ok=True)
