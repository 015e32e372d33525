"""What a `launch.train` run writes in --model_dir, and the record of it.

    checkpoints/ckpt-N.*            the files ckpt-N.manifest.json names
    checkpoints/checkpoint          TensorFlow's state file
    checkpoints/skipped/ckpt-N.*    damaged checkpoints a resume set aside
    checkpoints/history/steps-N.json  the history, a segment per save (`launch.segments`)
    history.json, loss.png          the history's copy and its plot
    tensorboard/{steps,train,validation,pipeline}/events.out.tfevents.*
    timeline/timeline_epochE.{json,png}
    .launch-train.written           the record: every file and folder above that
                                    the trainer created, one JSON line each

The record (`Record`) is the one account of what the trainer wrote: a path
is added before the trainer creates it (or, where TensorFlow names a file,
right after), and the trainer deletes, moves or truncates only recorded
paths. A fresh run into a directory whose record names existing paths is
refused (`--resume` continues it); `--overwrite` deletes exactly those
(`remove`), never following a symbolic link: a recorded path that is now a
link is left, and said. A file the run did not write (a user's notes, a
Keras TensorBoard event file in tensorboard/train/, a file named like a
checkpoint) is never touched. A directory written before the record existed
is recognised by its checkpoint manifests (`legacy_files`), without
descending through links. Before TensorFlow starts, `path_problems` refuses
output names taken by the wrong kind of file or by a link, so nothing is
ever written outside --model_dir. Pure Python.
"""

import json
import os
import pathlib
import re

CHECKPOINT_DIR = "checkpoints"
STATE_FILE = "checkpoint"  # TensorFlow's CheckpointManager state file name
SKIPPED_DIR = "skipped"
HISTORY_SEGMENTS = "history"  # under checkpoints/
MANIFEST = ".manifest.json"
HISTORY_FILE = "history.json"
LOSS_PLOT = "loss.png"
TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_RUNS = ("steps", "train", "validation", "pipeline")
TIMELINE_DIR = "timeline"
RECORD_FILE = ".launch-train.written"

# The directories a run makes: each must be a directory (not a link) if it exists.
DIRECTORIES = (CHECKPOINT_DIR, TENSORBOARD_DIR, TIMELINE_DIR)
SUBDIRECTORIES = (f"{CHECKPOINT_DIR}/{HISTORY_SEGMENTS}", f"{CHECKPOINT_DIR}/{SKIPPED_DIR}",
                  *(f"{TENSORBOARD_DIR}/{run}" for run in TENSORBOARD_RUNS))
# The files a run rewrites: each must be a regular file (not a link) if it exists.
FILES = (HISTORY_FILE, LOSS_PLOT, RECORD_FILE, f"{CHECKPOINT_DIR}/{STATE_FILE}")

CHECKPOINT_FILE = re.compile(r"ckpt-([0-9]+)(\..+)$")
_MANIFEST_FILE = re.compile(r"ckpt-([0-9]+)" + re.escape(MANIFEST))
_TIMELINE_FILE = re.compile(r"timeline_epoch[0-9]+\.(json|png)")
_SEGMENT_FILE = re.compile(r"steps-[0-9]+\.json")
_STATE_ENTRY = re.compile(r'^(?:all_)?model_checkpoint_paths?: "(ckpt-[0-9]+)"$')


def path_problems(model_dir):
    """Why the run's outputs cannot be written in `model_dir` (one line each;
    empty: fine): an output name taken by the wrong kind of file or by a
    symbolic link (the run would write, or --overwrite delete, through it),
    or a directory that is itself a run's checkpoints/ folder."""
    model_dir = pathlib.Path(model_dir)
    out = []
    for name in (*DIRECTORIES, *SUBDIRECTORIES, *FILES):
        path = model_dir / name
        if path.is_symlink():
            out.append(f"{path} is a symbolic link (to {os.readlink(path)}): launch.train "
                       f"writes only inside --model_dir, never through a link. Replace it "
                       f"with a {'folder' if name not in FILES else 'file'}, or pass another "
                       f"--model_dir.")
        elif name not in FILES and path.exists() and not path.is_dir():
            out.append(f"{path} is a file, but the run writes a directory of that name. "
                       f"Move it, or pass another --model_dir.")
        elif name in FILES and path.exists() and not path.is_file():
            out.append(f"{path} is a directory, but the run writes a file of that name. "
                       f"Move it, or pass another --model_dir.")
    for folder, pattern in ((CHECKPOINT_DIR, CHECKPOINT_FILE),
                            (f"{CHECKPOINT_DIR}/{HISTORY_SEGMENTS}", _SEGMENT_FILE),
                            (TIMELINE_DIR, _TIMELINE_FILE)):
        if (model_dir / folder).is_symlink():
            continue  # said above
        for entry in entries(model_dir / folder):
            if pattern.fullmatch(entry.name) and (entry.is_symlink() or not entry.is_file()):
                kind = "a symbolic link" if entry.is_symlink() else "a directory"
                out.append(f"{entry} is {kind}, but the run writes a file of that name. "
                           f"Move it, or pass another --model_dir.")
    if model_dir.is_dir() and any(_MANIFEST_FILE.fullmatch(p.name)
                                  for p in entries(model_dir)):
        out.append(f"{model_dir} holds checkpoints itself: it looks like the "
                   f"{CHECKPOINT_DIR}/ folder of a run. Pass the run's directory: "
                   f"--model_dir={model_dir.parent}.")
    return out


def run_folders(timeline):
    """The folders a run writes in (relative, parents first); the timeline's
    with `timeline`. Skipped checkpoints' folder is made when first needed."""
    folders = [CHECKPOINT_DIR, f"{CHECKPOINT_DIR}/{HISTORY_SEGMENTS}", TENSORBOARD_DIR,
               *(f"{TENSORBOARD_DIR}/{run}" for run in TENSORBOARD_RUNS[:3])]
    if timeline:
        folders += [f"{TENSORBOARD_DIR}/{TENSORBOARD_RUNS[3]}", TIMELINE_DIR]
    return folders


def entries(directory):
    """The entries of `directory` as paths; [] if it is missing or a file."""
    try:
        return list(pathlib.Path(directory).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _manifest_files(path):
    """The files a committed checkpoint's manifest names, or [] if unreadable."""
    try:
        files = json.loads(path.read_text(encoding="utf-8")).get("files", {})
    except (OSError, ValueError, AttributeError):
        return []
    return [name for name in files if isinstance(name, str) and "/" not in name]


class Record:
    """The record of what this trainer created under `model_dir` (see the
    module docstring): RECORD_FILE, one JSON line per path, appended and
    fsynced. `add` before creating a path (its parents first), or a name
    prefix before TensorFlow writes files under it; `owns` before deleting,
    moving or truncating one. Reading it skips a torn last line."""

    def __init__(self, model_dir):
        self.model_dir = pathlib.Path(model_dir)
        self.path = self.model_dir / RECORD_FILE
        self._kinds = {}  # relative path -> "file", "dir" or "prefix", in the order added
        self._prefixes = {}  # relative parent -> the name prefixes recorded in it
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
            lines = []
        for line in lines:
            try:
                entry = json.loads(line)
                self._note(entry["path"], entry["kind"])
            except (ValueError, KeyError, TypeError):
                continue

    def _note(self, rel, kind):
        self._kinds.setdefault(rel, kind)
        if kind == "prefix":
            parent, _, name = rel.rpartition("/")
            self._prefixes.setdefault(parent, set()).add(name)

    @property
    def exists(self):
        return self.path.is_file() and not self.path.is_symlink()

    def _relative(self, path):
        return pathlib.Path(path).relative_to(self.model_dir).as_posix()

    def add(self, path, kind="file"):
        """Records `path` (under model_dir) as created by this trainer; kind
        "prefix": every file whose name starts with it."""
        rel = self._relative(path)
        if rel in self._kinds:
            return
        self._note(rel, kind)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, (json.dumps({"path": rel, "kind": kind}) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def make_dir(self, path):
        """Creates directory `path` and its missing parents under model_dir,
        recording each one it creates (a parent before its child)."""
        path = pathlib.Path(path)
        missing = []
        while path != self.model_dir and not os.path.lexists(path):
            missing.append(path)
            path = path.parent
        for directory in reversed(missing):
            self.add(directory, "dir")
            directory.mkdir()

    def add_new_files(self, directory, before):
        """Records the regular files in `directory` that are not in `before`
        (names TensorFlow chose: taken right after it made them)."""
        for entry in entries(directory):
            if entry.name not in before and entry.is_file() and not entry.is_symlink():
                self.add(entry)

    def owns(self, path):
        """Whether this trainer created `path` (and it is not a link now)."""
        try:
            rel = self._relative(path)
        except ValueError:
            return False
        if pathlib.Path(path).is_symlink():
            return False
        parent, _, name = rel.rpartition("/")
        return rel in self._kinds or name.startswith(tuple(self._prefixes.get(parent, ())))

    def paths(self):
        """(path, kind) of every recorded path, and of every file under a
        recorded prefix (as "file"), in the order recorded."""
        out = []
        for rel, kind in self._kinds.items():
            path = self.model_dir / rel
            if kind != "prefix":
                out.append((path, kind))
            elif _real_dir(path.parent):
                out += [(entry, "file") for entry in sorted(entries(path.parent))
                        if entry.name.startswith(path.name)]
        return out


def find(model_dir):
    """The regular files of a previous run in `model_dir`: those its record
    names (or, for a directory written before records, `legacy_files`),
    checkpoints first."""
    record = Record(model_dir)
    if not record.exists:
        return legacy_files(model_dir)
    found = [p for p, kind in record.paths() if kind == "file" and _is_file(p)]
    return sorted(found, key=lambda p: (CHECKPOINT_DIR not in p.relative_to(
        record.model_dir).parts[:1], str(p)))


def _is_file(path):
    return path.is_file() and not path.is_symlink()


def _real_dir(path):
    return path.is_dir() and not path.is_symlink()


def legacy_files(model_dir):
    """A directory written before the record: the files its checkpoint
    manifests name, their manifests and TF's state file naming only them,
    set-aside checkpoints, history segments, history.json, loss.png,
    TensorBoard event files and timelines, as paths; never through a link."""
    model_dir = pathlib.Path(model_dir)
    ckpt = model_dir / CHECKPOINT_DIR
    if not _real_dir(ckpt):
        return []
    found, ours = [], set()
    for entry in sorted(entries(ckpt)):
        if _MANIFEST_FILE.fullmatch(entry.name) and _is_file(entry):
            for name in _manifest_files(entry):
                if CHECKPOINT_FILE.fullmatch(name) and _is_file(ckpt / name):
                    ours.add(name)
                    found.append(ckpt / name)
            ours.add(entry.name)
            found.append(entry)
    if not ours:
        return []
    state = ckpt / STATE_FILE
    if _is_file(state) and _state_names_only(state, ours):
        found.append(state)
    for folder, pattern in ((ckpt / SKIPPED_DIR, CHECKPOINT_FILE),
                            (ckpt / HISTORY_SEGMENTS, _SEGMENT_FILE),
                            (model_dir / TIMELINE_DIR, _TIMELINE_FILE)):
        if _real_dir(folder):
            found += [p for p in sorted(entries(folder)) if _is_file(p)
                      and pattern.fullmatch(p.name)]
    history = model_dir / HISTORY_FILE
    if _is_file(history) and _is_history(history):
        found.append(history)
    if _is_file(model_dir / LOSS_PLOT):
        found.append(model_dir / LOSS_PLOT)
    for run in TENSORBOARD_RUNS:
        folder = model_dir / TENSORBOARD_DIR / run
        if _real_dir(model_dir / TENSORBOARD_DIR) and _real_dir(folder):
            found += [p for p in sorted(entries(folder)) if _is_file(p)
                      and p.name.startswith("events.out.tfevents.") and ".from-" in p.name]
    return found


def _state_names_only(state, ours):
    """Whether TF's state file names only checkpoints of ours (or ones now gone):
    then it is the one this trainer wrote, not another tool's."""
    try:
        lines = [l.strip() for l in state.read_text(encoding="utf-8").splitlines() if l.strip()]
    except (OSError, UnicodeDecodeError):
        return False
    for line in lines:
        match = _STATE_ENTRY.fullmatch(line)
        if match is None:
            return False
        name = match.group(1)
        if name + MANIFEST not in ours and (state.parent / (name + ".index")).exists():
            return False
    return True


def _is_history(path):
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(4096)
    except (OSError, UnicodeDecodeError):
        return False
    return head.startswith('{"run"')


def describe(paths, model_dir):
    """A short account of `find`'s paths: checkpoints by step, other names."""
    model_dir = pathlib.Path(model_dir)
    steps = sorted(int(_MANIFEST_FILE.fullmatch(p.name).group(1)) for p in paths
                   if _MANIFEST_FILE.fullmatch(p.name))
    parts = [f"{len(steps)} checkpoint(s), the newest at step {steps[-1]}"] if steps else []
    tops = []
    for p in paths:
        top = p.relative_to(model_dir).parts[0]
        if top != CHECKPOINT_DIR and top not in tops:
            tops.append(top)
    return ", ".join(parts + [t + ("/" if t in DIRECTORIES else "") for t in tops])


def remove(model_dir):
    """Deletes a previous run's files (`find`: checkpoints' manifests first,
    so a half-removed checkpoint is never committed), then the directories
    its record names that are left empty, then the record. Never follows a
    link: a recorded path that is now one is left. Returns (the paths
    deleted, notes on what was left)."""
    model_dir = pathlib.Path(model_dir)
    record = Record(model_dir)
    paths = sorted(find(model_dir), key=lambda p: not p.name.endswith(MANIFEST))
    for path in paths:
        path.unlink(missing_ok=True)
    notes = []
    if record.exists:
        recorded = record.paths()
        for path, kind in recorded:
            if path.is_symlink():
                notes.append(f"{path} is a symbolic link now, which launch.train did not make: "
                             f"left as it is")
        for path, kind in sorted((pk for pk in recorded if pk[1] == "dir"),
                                 key=lambda pk: -len(pk[0].parts)):
            if _real_dir(path) and not any(path.iterdir()):
                os.rmdir(path)
            elif _real_dir(path):
                notes.append(f"{path} holds files launch.train did not write: kept")
        record.path.unlink()
    else:  # a legacy directory: its folders, if the files removed left them empty
        for rel in (f"{CHECKPOINT_DIR}/{SKIPPED_DIR}", f"{CHECKPOINT_DIR}/{HISTORY_SEGMENTS}",
                    CHECKPOINT_DIR, *(f"{TENSORBOARD_DIR}/{r}" for r in TENSORBOARD_RUNS),
                    TENSORBOARD_DIR, TIMELINE_DIR):
            directory = model_dir / rel
            if _real_dir(directory) and not any(directory.iterdir()):
                os.rmdir(directory)
    return paths, notes
