"""tfpipe: GPipe-style pipeline-parallel training for TensorFlow 2 / Keras 3.

What installs what (TensorFlow comes with the extra that fits the machine, as
JAX's `jax[cpu]` / `jax[cuda12]` do, so no machine gets a TensorFlow beside
another):

    pip install '.[cpu]'      the library `tfpipe` with tensorflow-cpu, Keras, absl-py
    pip install '.[and-cuda]' the same with tensorflow[and-cuda] (NVIDIA GPUs)
    pip install '.[tpu]'      the same with tensorflow-tpu (a Cloud TPU VM; add
                              -f https://storage.googleapis.com/libtpu-releases/index.html)
    pip install .             Keras and absl-py only: for a TensorFlow installed first
    pip install '.[train]'   + what `launch/` (the trainer) and `benchmarks/` import:
                             TensorBoard, TensorFlow Datasets, scikit-learn, matplotlib
    pip install '.[test]'    [train] + pytest, pytest-xdist + keras-hub's small dependencies

Only the package `tfpipe` is installed. `models/`, `launch/` and `benchmarks/`
are folders of the repository, run from its root (`python -m launch.train`);
they are not installed, so no generic top-level `models` or `launch` lands in
site-packages.

The README's commands install '.[cpu,test]'; BUILD.md has the GPU and TPU ones.
"""

import os

from setuptools import find_packages, setup

TF_VERSION = "2.21.*"
TENSORFLOW = {  # extra -> the TensorFlow package for that machine
    "cpu": f"tensorflow-cpu=={TF_VERSION}",
    "and-cuda": f"tensorflow[and-cuda]=={TF_VERSION}",
    "tpu": f"tensorflow-tpu=={TF_VERSION}",
}

TRAIN = [
    "tensorboard",  # TensorBoard logs of launch.train
    "tensorflow-datasets",  # --dataset=tfds:NAME
    "importlib_resources",  # tensorflow-datasets 4.9.10 imports it without listing it
    "scikit-learn",  # ships the digits data set the default training run uses
    "matplotlib",  # the loss curve (loss.png) and the timeline chart of launch.train
]
# keras-hub itself (and tensorflow-text, which would pull the full `tensorflow`
# package beside tensorflow-cpu) install with --no-deps; these are their small
# dependencies. See README / .ci/run.
KERAS_HUB_DEPS = ["regex", "rich", "kagglehub", "tokenizers", "sentencepiece"]

setup(
    name="tfpipe",
    version="0.1.0",
    description="GPipe-style pipeline-parallel training for TensorFlow 2 / Keras 3",
    long_description=open(os.path.join(os.path.dirname(__file__), "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tfpipe", "tfpipe.*"]),  # not models/, launch/, benchmarks/
    python_requires=">=3.10",
    install_requires=["keras>=3.15,<4", "absl-py"],
    extras_require={
        **{extra: [package] for extra, package in TENSORFLOW.items()},
        "train": TRAIN,
        "test": [*TRAIN, "pytest", "pytest-xdist", *KERAS_HUB_DEPS],
    },
)
