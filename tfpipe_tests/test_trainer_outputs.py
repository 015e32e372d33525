"""launch.train never touches what it did not write: a record of every path
it created (`launch.outputs.Record`) is what `--overwrite` deletes, and no
symbolic link is ever followed, to write or to delete.

Real `python -m launch.train` processes on real files. Every test plants an
outside tree (files and folders that links point to) and hashes it before
and after: nothing outside --model_dir may change.
"""

import hashlib
import os
import pathlib
import shutil

import pytest

from launch import outputs
from tfpipe_tests import helpers
from tfpipe_tests import trainer_runs as runs
from tfpipe_tests.test_trainer_flags import _MAIN_REPORTING_TF


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return runs.make_reference(tmp_path_factory)


def _outside(tmp_path):
    """A tree beside --model_dir, the target of every planted link."""
    outside = tmp_path / "outside"
    (outside / "folder").mkdir(parents=True)
    (outside / "file.bin").write_bytes(b"outside bytes")
    for name in ("timeline_epoch2.json", "ckpt-3.index", "steps-3.json",
                 "events.out.tfevents.1.host.1.0.from-0000000001.v2", "history.json"):
        (outside / "folder" / name).write_bytes(f"outside {name}".encode())
    return outside


def _hashes(directory):
    """{relative path: sha256 or link target} of everything under `directory`,
    links themselves included (never followed)."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = pathlib.Path(root) / name
            rel = str(path.relative_to(directory))
            if path.is_symlink():
                out[rel] = "-> " + os.readlink(path)
            elif path.is_file():
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _train(model_dir, *flags, timeout=runs.CHILD_TIMEOUT):
    return helpers.run_child(["-c", _MAIN_REPORTING_TF, f"--model_dir={model_dir}",
                              *runs.FLAGS, *flags], timeout=timeout)


# Links to a file and to a folder outside, in every folder the trainer uses
# (names it does not write), and foreign files named like its own outputs.
PLANTED_LINKS = [f"{folder}{name}" for folder in (
    "", "checkpoints/", "checkpoints/history/", "tensorboard/", "tensorboard/steps/",
    "tensorboard/train/", "tensorboard/validation/") for name in ("to_file", "to_folder")]
FOREIGN = {
    # A Keras TensorBoard callback's event file, where the trainer writes its own.
    "tensorboard/train/events.out.tfevents.1765000000.host.4242.0.v2": b"keras' own",
    "tensorboard/steps/events.out.tfevents.1765000001.host.4242.0.from-0000000001.v2": b"x",
    "checkpoints/ckpt-3.h5": b"a user's weights",
    "checkpoints/history/steps-99.json": b"{}",
    "checkpoints/skipped/ckpt-1.index": b"not from this run",
    "notes.txt": b"my notes",
}
# Of those, the names a directory without a record can only read as the trainer's.
NAMED_LIKE_OURS = {
    "tensorboard/steps/events.out.tfevents.1765000001.host.4242.0.from-0000000001.v2",
    "checkpoints/history/steps-99.json", "checkpoints/skipped/ckpt-1.index"}


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "written_before_records"])
def test_overwrite_deletes_exactly_the_recorded_files_never_through_a_link(tmp_path,
                                                                          reference, recorded):
    """A previous run, with links to outside files and folders in every folder
    the trainer uses and foreign files named like its outputs: `--overwrite`
    deletes the previous run's files and nothing else, and the new run equals
    the reference run. A directory written before records existed is read by
    its checkpoint manifests, never through a link; there files named exactly
    like the trainer's own (an event file with its `.from-` suffix, a history
    segment, a set-aside checkpoint) cannot be told apart and go too."""
    outside = _outside(tmp_path)
    model_dir = tmp_path / "run"
    shutil.copytree(reference["dir"], model_dir)
    if not recorded:
        (model_dir / outputs.RECORD_FILE).unlink()
    for rel in PLANTED_LINKS:
        target = outside / ("file.bin" if rel.endswith("to_file") else "folder")
        (model_dir / rel).symlink_to(target)
    for rel, data in FOREIGN.items():
        (model_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (model_dir / rel).write_bytes(data)
    previous = set(outputs.find(model_dir))
    outside_before, before = _hashes(outside), _hashes(model_dir)
    proc = _train(model_dir, "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"--overwrite: removed the {len(previous)} file(s)" in proc.stdout
    assert _hashes(outside) == outside_before
    after = _hashes(model_dir)
    for rel in PLANTED_LINKS + list(FOREIGN):
        if not recorded and rel in NAMED_LIKE_OURS:
            continue
        assert after[rel] == before[rel], rel  # the link, or the foreign bytes
    # The new run's files replaced the old ones: its final checkpoint equals the reference's.
    new = runs.checkpoint_tensors(str(model_dir / "checkpoints" / "ckpt-10"))
    old = runs.checkpoint_tensors(str(reference["dir"] / "checkpoints" / "ckpt-10"))
    assert new.keys() == old.keys() and all((new[k] == old[k]).all() for k in new)
    assert not any(p.exists() and p not in set(outputs.find(model_dir)) for p in previous
                   if p.name.startswith("events.")), "an old event file survived"


# A folder the trainer writes in, or a file name it writes, taken by a link:
# refused before TensorFlow starts, one line, nothing changed (with or
# without --overwrite, and at --resume).
_FOLDER_OR_NAME = "{link} is a symbolic link (to {target}): launch.train writes only inside " \
                  "--model_dir, never through a link."
_OUTPUT_FILE = "{link} is a symbolic link, but the run writes a file of that name."


@pytest.mark.parametrize("rel, target, flag, message", [
    ("timeline", "folder", "--overwrite", _FOLDER_OR_NAME),
    ("tensorboard/train", "folder", "--overwrite", _FOLDER_OR_NAME),
    ("checkpoints/skipped", "folder", "--resume", _FOLDER_OR_NAME),
    ("checkpoints", "folder", "", _FOLDER_OR_NAME),
    ("loss.png", "file.bin", "--overwrite", _FOLDER_OR_NAME),
    ("timeline/timeline_epoch2.json", "folder/timeline_epoch2.json", "--overwrite",
     _OUTPUT_FILE),
    ("checkpoints/ckpt-3.index", "folder/ckpt-3.index", "--resume", _OUTPUT_FILE),
])
def test_an_output_name_taken_by_a_link_is_refused_before_tensorflow(tmp_path, reference, rel,
                                                                     target, flag, message):
    outside = _outside(tmp_path)
    model_dir = tmp_path / "run"
    shutil.copytree(reference["dir"], model_dir)
    link = model_dir / rel
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(outside / target)
    outside_before, before = _hashes(outside), _hashes(model_dir)
    proc = _train(model_dir, *([flag] if flag else []), timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert message.format(link=link, target=outside / target) in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == "tensorflow imported: False"
    assert _hashes(outside) == outside_before
    assert {k: v for k, v in _hashes(model_dir).items() if k != ".lock"} == \
        {k: v for k, v in before.items() if k != ".lock"}


# A file size limit on the process: TensorFlow's checkpoint write fails as on a
# full disk (its own error, inside its C++ writer).
_MAIN_WITH_FILE_SIZE_LIMIT = (
    "import resource, runpy, signal, sys\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails, the process lives\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))\n"
    "sys.argv = ['launch.train'] + sys.argv[1:]\n"
    "runpy.run_module('launch.train', run_name='__main__', alter_sys=True)\n")


def test_a_full_disk_inside_tensorflows_checkpoint_write_is_one_line(tmp_path, reference):
    """The checkpoint (300 kB of data and more) cannot be written: one line
    naming it and what was kept, exit 1; the resume equals the reference run."""
    model_dir = tmp_path / "run"
    proc = helpers.run_child(["-c", _MAIN_WITH_FILE_SIZE_LIMIT, f"--model_dir={model_dir}",
                              *runs.FLAGS], runs.CHILD_TIMEOUT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("launch.train:")]
    assert lines == [
        f"launch.train: error: could not write checkpoint ckpt-3 in {model_dir}/checkpoints: "
        f"File too large (OutOfRangeError). Nothing after the newest committed checkpoint "
        f"(none yet) was saved; make room on the file system, then --resume."], proc.stderr
    assert "Traceback" not in proc.stderr
    logs = runs.EpochLogs()
    result = runs.train_lib.train(runs.config(model_dir, resume=True), callbacks=[logs])
    assert result["start_step"] == 0
    runs.assert_same_as_reference(model_dir, result, logs, reference, first_epoch=0)


def test_a_batch_that_does_not_fit_in_memory_is_one_line(tmp_path):
    model_dir = tmp_path / "run"
    proc = _train(model_dir, "--batch_size=1000000000", timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.splitlines()[-2]  # before the helper's "tensorflow imported"
    assert last.startswith("launch.train: error: out of memory (Unable to allocate ") and \
        last.endswith("with --batch_size=1000000000. Use a smaller --batch_size (or --stages, "
                      "--microbatches to spread it). Nothing after the newest committed "
                      "checkpoint was saved."), proc.stderr
    assert "Traceback" not in proc.stderr
