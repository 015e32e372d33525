"""Benchmarks (`python -m benchmarks.overhead`)."""
