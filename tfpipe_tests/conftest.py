"""Test setup: 4 logical CPU devices, made before TensorFlow initialises.

Each pytest-xdist worker (`-n 2`) is its own process and runs this file, so
every worker has its own 4 devices."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfpipe  # noqa: E402

NUM_DEVICES = 4
tfpipe.testing.use_logical_cpus(NUM_DEVICES)
# Initialise now, so every test sees the same 4 devices whatever runs first.
assert len(tfpipe.placement.available_devices("CPU")) == NUM_DEVICES
