"""Command-line entry points (`python -m launch.train`)."""
