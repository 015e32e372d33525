"""What a `launch.train` run writes in --model_dir, and nothing else.

    checkpoints/ckpt-N.*            the files ckpt-N.manifest.json names, and it
    checkpoints/checkpoint          TensorFlow's state file, naming only those
    checkpoints/skipped/ckpt-N.*    damaged checkpoints a resume set aside
    checkpoints/history/steps-N.json  the history, a segment per save (`launch.segments`)
    history.json, loss.png          the history's copy and its plot
    tensorboard/{steps,train,validation,pipeline}/events.out.tfevents.*
    timeline/timeline_epochE.{json,png}

A fresh run into a directory holding any of them is refused (`--resume`
continues it); `--overwrite` removes exactly `find(model_dir)`: a file the
run did not write (checkpoints/resnet50_best.h5, a user's notes) is never
deleted, nor a checkpoint no manifest names. Pure Python: the checks run
before TensorFlow starts.
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

# The directories a run makes: each must be a directory if it exists.
DIRECTORIES = (CHECKPOINT_DIR, TENSORBOARD_DIR, TIMELINE_DIR)
# The files a run rewrites: each must be a regular file if it exists.
FILES = (HISTORY_FILE, LOSS_PLOT)

CHECKPOINT_FILE = re.compile(r"ckpt-([0-9]+)(\..+)$")
_MANIFEST_FILE = re.compile(r"ckpt-([0-9]+)" + re.escape(MANIFEST))
_TIMELINE_FILE = re.compile(r"timeline_epoch[0-9]+\.(json|png)")
_SEGMENT_FILE = re.compile(r"steps-[0-9]+\.json")
_STATE_ENTRY = re.compile(r'^(?:all_)?model_checkpoint_paths?: "(ckpt-[0-9]+)"$')


def path_problems(model_dir):
    """Why the run's outputs cannot be written in `model_dir` (one line each;
    empty: fine): an output name taken by the wrong kind of file, or a
    directory that is itself a run's checkpoints/ folder."""
    model_dir = pathlib.Path(model_dir)
    out = []
    for name in DIRECTORIES:
        path = model_dir / name
        if path.exists() and not path.is_dir():
            out.append(f"{path} is a file, but the run writes a directory of that name. "
                       f"Move it, or pass another --model_dir.")
    for name in FILES:
        path = model_dir / name
        if path.exists() and not path.is_file():
            out.append(f"{path} is a directory, but the run writes a file of that name. "
                       f"Move it, or pass another --model_dir.")
    if model_dir.is_dir() and any(_MANIFEST_FILE.fullmatch(p.name)
                                  for p in entries(model_dir)):
        out.append(f"{model_dir} holds checkpoints itself: it looks like the "
                   f"{CHECKPOINT_DIR}/ folder of a run. Pass the run's directory: "
                   f"--model_dir={model_dir.parent}.")
    return out


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


def find(model_dir):
    """Every file in `model_dir` this trainer wrote (see the module docstring),
    as paths, checkpoints first."""
    model_dir = pathlib.Path(model_dir)
    ckpt = model_dir / CHECKPOINT_DIR
    found, ours = [], set()
    for entry in sorted(entries(ckpt)):
        if _MANIFEST_FILE.fullmatch(entry.name) and entry.is_file():
            for name in _manifest_files(entry):
                if CHECKPOINT_FILE.fullmatch(name) and (ckpt / name).is_file():
                    ours.add(name)
                    found.append(ckpt / name)
            ours.add(entry.name)
            found.append(entry)
    state = ckpt / STATE_FILE
    if state.is_file() and _state_names_only(state, ours):
        found.append(state)
    found += [p for p in sorted(entries(ckpt / SKIPPED_DIR))
              if p.is_file() and CHECKPOINT_FILE.fullmatch(p.name)]
    found += [p for p in sorted(entries(ckpt / HISTORY_SEGMENTS))
              if p.is_file() and _SEGMENT_FILE.fullmatch(p.name)]
    history = model_dir / HISTORY_FILE
    if history.is_file() and _is_history(history):
        found.append(history)
    plot = model_dir / LOSS_PLOT
    if plot.is_file():
        found.append(plot)
    for run in TENSORBOARD_RUNS:
        found += [p for p in sorted(entries(model_dir / TENSORBOARD_DIR / run))
                  if p.is_file() and p.name.startswith("events.out.tfevents.")]
    found += [p for p in sorted(entries(model_dir / TIMELINE_DIR))
              if p.is_file() and _TIMELINE_FILE.fullmatch(p.name)]
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
    """Deletes `find(model_dir)` (checkpoints' manifests first, so a half-removed
    checkpoint is never committed), then the run's directories left empty.
    Returns the paths deleted."""
    model_dir = pathlib.Path(model_dir)
    paths = sorted(find(model_dir), key=lambda p: not p.name.endswith(MANIFEST))
    for path in paths:
        path.unlink(missing_ok=True)
    empty = [model_dir / CHECKPOINT_DIR / SKIPPED_DIR,
             model_dir / CHECKPOINT_DIR / HISTORY_SEGMENTS, model_dir / CHECKPOINT_DIR,
             *[model_dir / TENSORBOARD_DIR / r for r in TENSORBOARD_RUNS],
             model_dir / TENSORBOARD_DIR, model_dir / TIMELINE_DIR]
    for directory in empty:
        if directory.is_dir() and not any(directory.iterdir()):
            os.rmdir(directory)
    return paths
