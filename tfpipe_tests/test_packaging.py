"""Packaging and start-up: what `pip install` brings, and a quiet trainer start.

- `pip install .` installs the package `tfpipe` and nothing else: no generic
  top-level `models`, `launch` or `benchmarks` in site-packages. Its own
  requirements are TensorFlow, Keras and absl-py; the trainer's (its plots
  included) and the tests' needs are the extras `[train]` and `[test]`.
- Every `tfpipe` module imports without the extras' packages (the Gantt chart,
  which needs matplotlib, is the trainer's: `launch/timeline_chart.py`).
- TensorFlow's C++ start-up messages (the oneDNN banner, twice) do not reach a
  `launch.train` run's stderr unless TF_CPP_MIN_LOG_LEVEL asks for them.

Subprocesses run from the repository root with a time limit; the wheel is
built from a copy of the repository, offline (no index, no build isolation).
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

import tfpipe
from launch import quiet as quiet_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 300  # seconds; a subprocess that imports TensorFlow takes 5-10 s here
EXTRAS_PACKAGES = ("sklearn", "tensorflow_datasets", "matplotlib", "tensorboard",
                   "importlib_resources")


def _python(args, env=None, timeout=TIMEOUT):
    """Runs `python ARGS` in the repository root, TF_CPP_MIN_LOG_LEVEL unset unless `env`
    sets it; returns the CompletedProcess."""
    environ = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env={**environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout, check=False)


# -- the wheel -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel `pip install .` would install, built from a copy of the repository (a
    build writes build/ and *.egg-info next to setup.py)."""
    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(REPO, tmp / "src", ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "--wheel-dir", str(tmp / "dist"), str(tmp / "src")],
        capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path, = (tmp / "dist").glob("tfpipe-*.whl")
    return zipfile.ZipFile(path)


def _requirements(wheel_file):
    """{extra or None: [requirement, ...]} from the wheel's METADATA."""
    meta = next(n for n in wheel_file.namelist() if n.endswith(".dist-info/METADATA"))
    out = {}
    for line in wheel_file.read(meta).decode().splitlines():
        if line.startswith("Provides-Extra: "):
            out.setdefault(line.split(": ", 1)[1], [])
        elif line.startswith("Requires-Dist: "):
            requirement, _, marker = line.split(": ", 1)[1].partition(";")
            extra = marker.split("==")[1].strip().strip("'\"") if marker else None
            out.setdefault(extra, []).append(requirement.strip())
    return out


def test_the_wheel_installs_only_the_tfpipe_package(wheel):
    top_level = {name.split("/")[0] for name in wheel.namelist()}
    assert top_level == {"tfpipe", f"tfpipe-{tfpipe.__version__}.dist-info"}
    assert "tfpipe/__init__.py" in wheel.namelist()
    assert not [n for n in wheel.namelist() if n.startswith("tfpipe_tests/")]


TRAIN = ["tensorboard", "tensorflow-datasets", "importlib-resources", "scikit-learn",
         "matplotlib"]


@pytest.mark.parametrize("extra, requirements", [
    # TensorFlow comes with the extra for the machine, never two side by side.
    (None, ["keras<4,>=3.15", "absl-py"]),
    ("cpu", ["tensorflow-cpu==2.21.*"]),
    ("and-cuda", ["tensorflow[and-cuda]==2.21.*"]),
    ("tpu", ["tensorflow-tpu==2.21.*"]),
    ("train", TRAIN),  # launch/ and benchmarks/, from the repository
    ("test", [*TRAIN, "pytest", "pytest-xdist", "regex", "rich", "kagglehub", "tokenizers",
              "sentencepiece"]),
], ids=["library", "cpu", "and-cuda", "tpu", "train", "test"])
def test_what_each_extra_installs(wheel, extra, requirements):
    found = _requirements(wheel)
    assert set(found) == {None, "cpu", "and-cuda", "tpu", "train", "test"}
    assert found[extra] == requirements


# -- the library without the extras ----------------------------------------------------

# Imports every tfpipe module with the extras' packages unimportable (a meta path
# finder raises ImportError for them); prints a JSON report.
_WITHOUT_EXTRAS = """
import importlib, json, pkgutil, sys
BLOCKED = set(sys.argv[1].split(","))
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, Block())
import tfpipe
report = {}
for info in pkgutil.walk_packages(tfpipe.__path__, "tfpipe."):
    try:
        importlib.import_module(info.name)
        report[info.name] = "ok"
    except Exception as err:
        report[info.name] = f"{type(err).__name__}: {err}"
report["loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps(report))
"""


def test_every_tfpipe_module_imports_without_the_extras():
    proc = _python(["-c", _WITHOUT_EXTRAS, ",".join(EXTRAS_PACKAGES)],
                   env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    modules = {name for name in report if name.startswith("tfpipe.")}
    assert {"tfpipe.model", "tfpipe.timeline", "tfpipe.schedules"} <= modules
    assert {name: report[name] for name in modules} == {name: "ok" for name in modules}
    assert report["loaded"] == []


# `pip install .` without a TensorFlow extra: the pure-Python modules work, the rest
# says which extra to install.
_WITHOUT_TENSORFLOW = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tensorflow":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
import tfpipe, tfpipe.config, tfpipe.schedules
tfpipe.schedules.simulate("1f1b", 4, 2)
try:
    tfpipe.PipelinedModel
except ModuleNotFoundError as err:
    print(err)
"""


def test_without_tensorflow_the_error_names_the_extra_to_install():
    proc = _python(["-c", _WITHOUT_TENSORFLOW])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "tfpipe needs TensorFlow, which is not installed. Install the extra for this "
        "machine: pip install 'tfpipe[cpu]' (CPU), 'tfpipe[and-cuda]' (NVIDIA GPU) or "
        "'tfpipe[tpu]' (Cloud TPU VM)."]


# -- TensorFlow's start-up messages ----------------------------------------------------

_NOTICE = ("WARNING: All log messages before absl::InitializeLog() is called are written "
           "to STDERR\n")
_BANNER = ("I0000 00:00:1796305424.900836   26955 port.cc:153] oneDNN custom operations are "
           "on. You may see slightly different numerical results ...\n")
_WARNING = "W0000 00:00:1796305424.900901   26955 cpu_info.cc:80] a warning\n"
_ERROR = ("E0000 00:00:1796305424.901002   26955 cuda_dnn.cc:8579] Unable to register "
          "cuDNN factory\n")
_FATAL = "F1205 14:44:05.123456    4242 env.cc:9] Check failed: ok\n"
_PYTHON = "Traceback (most recent call last):\n  File \"<string>\", line 1\n"
_C_LOG_LINE = re.compile(r"[IWEF]\d{4} |\d{4}-\d\d-\d\d [\d:.]+: [IWEF] ")  # C++ log records
_TF_OWN = "2025-09-17 14:44:05.157831: I external/cudart_stub.cc:32] no cuda drivers\n"


@pytest.mark.parametrize("captured, level, kept", [
    # What `import tensorflow` prints on this machine: dropped at levels 1-3.
    (_NOTICE + _BANNER + _NOTICE + _BANNER, 2, ""),
    (_NOTICE + _BANNER + _NOTICE + _BANNER, 1, ""),
    (_NOTICE + _BANNER + _NOTICE + _BANNER, 0, _NOTICE + _BANNER + _NOTICE + _BANNER),
    # Errors stay (with absl's notice, which says where they come from) up to level 2.
    (_NOTICE + _BANNER + _WARNING + _ERROR, 2, _NOTICE + _ERROR),
    (_NOTICE + _BANNER + _WARNING + _ERROR, 1, _NOTICE + _WARNING + _ERROR),
    (_NOTICE + _BANNER + _WARNING + _ERROR, 3, ""),
    (_NOTICE + _ERROR + _FATAL, 3, _NOTICE + _FATAL),  # FATAL always
    # Anything that is not an absl record is kept, in order.
    (_NOTICE + _BANNER + _PYTHON + _TF_OWN, 2, _PYTHON + _TF_OWN),
    (_PYTHON, 5, _PYTHON),
], ids=["banner-2", "banner-1", "banner-0", "error-2", "warning-1", "error-3", "fatal-3",
        "python-and-tsl-lines", "level-above-3"])
def test_start_up_log_filter(captured, level, kept):
    assert quiet_lib.filter_start_up_log(captured, level) == kept


# `with launch.train.quiet_start_up(): import tensorflow`, as launch.train does.
_QUIET_IMPORT = ("import sys; from launch import train\n"
                 "with train.quiet_start_up():\n"
                 "    import tensorflow\n"
                 "sys.stderr.write('imported\\n')\n")


_PLAIN_IMPORT = "import sys\nimport tensorflow\nsys.stderr.write('imported\\n')\n"
_BANNERS = ("oneDNN custom operations are on", "absl::InitializeLog()")


@pytest.mark.slow
@pytest.mark.parametrize("env, quiet", [
    ({}, True),  # launch.train sets TF_CPP_MIN_LOG_LEVEL=2
    ({"TF_CPP_MIN_LOG_LEVEL": "1"}, True),
    # Asked for everything: what TensorFlow itself prints on this machine (the
    # oneDNN banner only where TF turns oneDNN on by default: an Intel Xeon, not
    # the AMD EPYC of 2026-12-05).
    ({"TF_CPP_MIN_LOG_LEVEL": "0"}, False),
], ids=["unset", "1", "0"])
def test_tensorflow_starts_quietly_under_launch_train(env, quiet):
    proc = _python(["-c", _QUIET_IMPORT], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = {banner: 0 for banner in _BANNERS}
    if not quiet:
        plain = _python(["-c", _PLAIN_IMPORT], env=env)
        assert plain.returncode == 0, plain.stderr[-3000:]
        expected = {banner: plain.stderr.count(banner) for banner in _BANNERS}
        assert expected["absl::InitializeLog()"] >= 1  # TF did print at level 0
    assert {banner: proc.stderr.count(banner) for banner in _BANNERS} == expected
    assert proc.stderr.endswith("imported\n")


@pytest.mark.slow
def test_a_training_run_has_a_clean_stderr(tmp_path):
    # The default run (the digits MLP in 4 stages with its timeline), shortened.
    proc = _python(["-m", "launch.train", f"--model_dir={tmp_path}", "--epochs=1",
                    "--steps_per_epoch=2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    noise = [line for line in proc.stderr.splitlines()
             if _C_LOG_LINE.match(line) or "absl::InitializeLog" in line or "oneDNN" in line]
    assert noise == []  # no oneDNN banner, no grappler `E0000 ... layout failed` lines
    assert "final val accuracy" in proc.stdout
