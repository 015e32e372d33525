"""`--shard=I/N`: one of N pytest processes that together run each selected test once.

CI runs the slow tests as two processes at once (`.ci/run`), because most tests keep
one core busy tracing. Splitting by file left the two processes 38 and 52 minutes
apart on a 2-core AMD EPYC; dealing the selected tests out in collection order
(test 0 to shard 0, test 1 to shard 1, ...) interleaves each file's neighbouring,
similar-cost rows instead, so the shards stay even as tests are added.

The deal runs after pytest's own `-m`/`-k` deselection (`trylast`), so the shards
split exactly the tests that would otherwise run. Plain pytest; no plugin to install.
"""

import re

import pytest

_SHARD = re.compile(r"(\d+)/(\d+)")


def parse_shard(text):
    """"I/N" -> (I, N) with 0 <= I < N; raises pytest.UsageError naming the fix."""
    match = _SHARD.fullmatch(text.strip())
    if not match or not int(match[1]) < int(match[2]):
        raise pytest.UsageError(
            f"--shard={text!r}: expected I/N with 0 <= I < N (this process's shard, "
            "counted from 0, of N), e.g. --shard=0/2 and --shard=1/2 for two processes.")
    return int(match[1]), int(match[2])


def pytest_addoption(parser):
    parser.addoption(
        "--shard", default=None, metavar="I/N",
        help="run only the selected tests at positions I, I+N, I+2N, ... of the "
             "collection order (0 <= I < N); N processes with I = 0..N-1 run each "
             "selected test exactly once.")


def pytest_configure(config):
    shard = config.getoption("--shard")
    if shard is not None:
        parse_shard(shard)  # a bad value stops the run before collection


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if shard is None:
        return
    index, count = parse_shard(shard)
    kept = [item for position, item in enumerate(items) if position % count == index]
    dropped = [item for position, item in enumerate(items) if position % count != index]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
