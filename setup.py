"""tfpipe: GPipe-style pipeline-parallel training for TensorFlow 2 / Keras 3.

TensorFlow is declared as `tensorflow-cpu` (what CI and the CPU machines use).
On a GPU or TPU machine install `tensorflow` (or `tensorflow[and-cuda]`) first,
then `pip install --no-deps -e .` — see BUILD.md.
"""

import os

from setuptools import find_packages, setup

TF = os.environ.get("TFPIPE_TENSORFLOW", "tensorflow-cpu==2.21.*")

setup(
    name="tfpipe",
    version="0.1.0",
    description="GPipe-style pipeline-parallel training for TensorFlow 2 / Keras 3",
    long_description=open(os.path.join(os.path.dirname(__file__), "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tfpipe", "tfpipe.*", "models", "models.*",
                                    "launch", "launch.*", "benchmarks", "benchmarks.*"]),
    python_requires=">=3.10",
    install_requires=[
        TF,
        "keras>=3.15,<4",
        "absl-py",
        "tensorboard",  # TensorBoard logs from the training entry point
        "tensorflow-datasets",
        "importlib_resources",  # tensorflow-datasets 4.9.10 imports it without listing it
        "scikit-learn",  # ships the digits data set the default training run uses
        "matplotlib",  # the loss curve (loss.png) of launch.train
    ],
    extras_require={
        # keras-hub itself (and tensorflow-text, which would pull the full
        # `tensorflow` package beside tensorflow-cpu) install with --no-deps;
        # these are their small dependencies. See README / .ci/run.
        "test": ["pytest", "regex", "rich", "kagglehub", "tokenizers", "sentencepiece"],
    },
)
