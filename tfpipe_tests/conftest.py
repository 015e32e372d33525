"""Test setup: 4 logical CPU devices, made before TensorFlow initialises."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfpipe  # noqa: E402
from tfpipe_tests import sharding  # noqa: E402

# `--shard=I/N` (CI's two slow-test processes): pytest finds hooks by name here.
pytest_addoption = sharding.pytest_addoption
pytest_configure = sharding.pytest_configure
pytest_collection_modifyitems = sharding.pytest_collection_modifyitems

NUM_DEVICES = 4
tfpipe.testing.use_logical_cpus(NUM_DEVICES)
# Initialise now, so every test sees the same 4 devices whatever runs first.
assert len(tfpipe.placement.available_devices("CPU")) == NUM_DEVICES
