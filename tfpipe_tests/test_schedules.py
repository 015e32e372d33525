"""The GPipe schedule as data: checked without running a model."""

import pytest

from tfpipe import schedules


def test_clock_cycles_small_table():
    assert schedules.clock_cycles(3, 2) == [
        [(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]


@pytest.mark.parametrize("m, k", [(1, 1), (1, 4), (4, 4), (8, 2), (5, 3)])
def test_every_action_once_and_after_its_input(m, k):
    ticks = schedules.clock_cycles(m, k)
    assert len(ticks) == m + k - 1
    when = {}
    for t, tick in enumerate(ticks):
        stages = [s for _, s in tick]
        assert len(stages) == len(set(stages))  # one action per device per tick
        for action in tick:
            assert action not in when
            when[action] = t
    assert set(when) == {(mb, s) for mb in range(m) for s in range(k)}
    for (mb, s), t in when.items():
        if s > 0:
            assert when[(mb, s - 1)] < t  # stage s-1 of the same micro-batch came first
        if mb > 0:
            assert when[(mb - 1, s)] < t  # a device runs micro-batches in order


def test_backward_is_the_reversed_forward():
    gpipe = schedules.GPipe()
    assert gpipe.backward_order(4, 3) == gpipe.forward_order(4, 3)[::-1]
    assert gpipe.backward_order(4, 3)[0] == (3, 2)  # last micro-batch, last stage


@pytest.mark.parametrize("m, k, expected", [(1, 1, 0.0), (4, 4, 3 / 7), (8, 4, 3 / 11),
                                            (32, 2, 1 / 33)])
def test_bubble_fraction(m, k, expected):
    assert schedules.bubble_fraction(m, k) == pytest.approx(expected)


def test_get_resolves_names_and_rejects_others():
    assert isinstance(schedules.get("GPipe"), schedules.GPipe)
    with pytest.raises(ValueError, match="Unknown schedule"):
        schedules.get("1f1b")
    with pytest.raises(ValueError, match="num_microbatches >= 1"):
        schedules.clock_cycles(0, 2)
