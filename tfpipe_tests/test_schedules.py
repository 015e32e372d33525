"""Schedules as data: tables, validation and simulation, without running a model."""

import pytest

from tfpipe import schedules
from tfpipe.schedules import Action

GRID = [(1, 1), (1, 4), (4, 4), (8, 2), (5, 3), (16, 4), (3, 8)]


def _all_schedules(m, d):
    out = [schedules.GPipe(), schedules.OneFOneB()]
    out += [schedules.Interleaved(v) for v in (2, 3) if m % d == 0]
    return out


def test_clock_cycles_small_table():
    assert schedules.clock_cycles(3, 2) == [
        [(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]


@pytest.mark.parametrize("m, d", GRID)
def test_every_action_once_on_its_device_and_after_its_inputs(m, d):
    for schedule in _all_schedules(m, d):
        table = schedule.actions(m, d)
        k = schedule.num_stages(d)
        flat = [(dev, a) for dev, row in enumerate(table) for a in row]
        assert sorted(a for _, a in flat) == sorted(
            Action(kind, s, mb) for kind in "FB" for s in range(k) for mb in range(m))
        for dev, a in flat:
            assert schedule.stage_device(a.stage, d) == dev
        # The validated run order respects every dependency.
        position = {a: i for i, (_, a) in enumerate(schedules.validate(schedule, m, d))}
        for a in position:
            if a.kind == "F" and a.stage:
                assert position[Action("F", a.stage - 1, a.microbatch)] < position[a]
            if a.kind == "B":
                assert position[Action("F", a.stage, a.microbatch)] < position[a]
                if a.stage < k - 1:
                    assert position[Action("B", a.stage + 1, a.microbatch)] < position[a]


def test_known_tables():
    assert schedules.GPipe().format(2, 2) == (
        "device 0: F0.0 F0.1 B0.1 B0.0\ndevice 1: F1.0 F1.1 B1.1 B1.0")
    assert schedules.OneFOneB().format(3, 2) == (
        "device 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2\ndevice 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2")
    assert schedules.Interleaved(2).actions(2, 2)[1] == [
        Action.parse(a) for a in "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 B1.0 B1.1".split()]


@pytest.mark.parametrize("m, d", [(1, 2), (4, 4), (8, 2), (8, 4), (16, 4), (3, 5)])
@pytest.mark.parametrize("schedule", [schedules.GPipe(), schedules.OneFOneB()])
def test_gpipe_and_1f1b_bubble_is_k_minus_1_over_m_plus_k_minus_1(schedule, m, d):
    sim = schedules.simulate(schedule, m, d, forward_cost=1.0, backward_cost=2.0)
    assert sim.bubble_fraction == pytest.approx((d - 1) / (m + d - 1))
    assert sim.bubble_fraction == pytest.approx(schedules.bubble_fraction(m, d))
    assert sim.makespan == pytest.approx(3.0 * (m + d - 1))


@pytest.mark.parametrize("m, d", [(4, 4), (8, 4), (16, 4), (8, 2), (3, 5)])
def test_peak_activations_gpipe_m_and_1f1b_at_most_k(m, d):
    assert schedules.simulate(schedules.GPipe(), m, d).peak_activations == [m] * d
    peaks = schedules.simulate(schedules.OneFOneB(), m, d).peak_activations
    assert peaks == [min(m, d - i) for i in range(d)]
    assert max(peaks) <= d


@pytest.mark.parametrize("v", [2, 4])
@pytest.mark.parametrize("m, d", [(4, 2), (8, 4), (16, 4), (4, 4)])
def test_interleaved_bubble_is_smaller_by_v(v, m, d):
    gpipe = schedules.simulate(schedules.GPipe(), m, d).bubble_fraction
    sim = schedules.simulate(schedules.Interleaved(v), m, d)
    # The fill and drain shrink v-fold: (D - 1) / (v M + D - 1).
    assert sim.bubble_fraction == pytest.approx((d - 1) / (v * m + d - 1))
    assert sim.bubble_fraction < gpipe
    # Idle time itself (not the fraction) is divided by v.
    idle = lambda s: s.bubble_fraction * s.makespan * d  # noqa: E731
    assert idle(sim) == pytest.approx(idle(schedules.simulate(schedules.GPipe(), m, d)) / v)


def test_costs_per_stage_and_ticks():
    sim = schedules.simulate(schedules.GPipe(), 2, 2, forward_cost=[1.0, 3.0],
                             backward_cost=[2.0, 6.0])
    # Device 1 is the bottleneck: F1.0 starts at 1, then F1.1, B1.1, B1.0 back to back.
    assert sim.makespan == pytest.approx(1 + 3 + 3 + 6 + 6 + 2)
    ticks = schedules.clock_ticks(schedules.OneFOneB(), 3, 2)
    assert len(ticks) == 2 * (3 + 2 - 1)
    assert [str(a) if a else "-" for a in ticks[2]] == ["-", "B1.0"]
    assert len(schedules.clock_ticks(schedules.GPipe(), 4, 3, forward_only=True)) == 4 + 3 - 1


def test_user_table_is_accepted_and_simulated():
    # A hand-written 1F1B for M=2, D=2, as strings.
    table = schedules.Table([["F0.0", "F0.1", "B0.0", "B0.1"],
                             ["F1.0", "B1.0", "F1.1", "B1.1"]], name="mine")
    assert schedules.simulate(table, 2, 2).peak_activations == [2, 1]
    assert schedules.get(table) is table


@pytest.mark.parametrize("rows, m, message", [
    ([["F0.0", "B0.0"], ["B1.0", "F1.0"]], 1,
     r"deadlock: device 0 waits at B0\.0 for B1\.0; device 1 waits at B1\.0 for F1\.0"),
    ([["F0.0", "B0.0", "F0.1", "B0.1"], ["F1.0", "F1.1", "B1.1", "B1.0"]], 2,
     r"device 0 waits at B0\.0 for B1\.0; device 1 waits at F1\.1 for F0\.1"),
    ([["B0.0", "F0.0"], ["F1.0", "B1.0"]], 1, r"device 0 waits at B0\.0 for F0\.0"),
    ([["F0.0", "B0.0"], ["F1.0"]], 1, r"missing 1 action\(s\): B1\.0"),
    ([["F0.0", "F0.0", "B0.0"], ["F1.0", "B1.0"]], 1, r"F0\.0 appears twice"),
])
def test_malformed_tables_are_rejected_with_the_action_named(rows, m, message):
    with pytest.raises(ValueError, match=message):
        schedules.validate(schedules.Table(rows), m, 2)


def test_subclassed_schedule_is_validated():
    class Extra(schedules.GPipe):
        def actions(self, num_microbatches, num_devices):
            table = super().actions(num_microbatches, num_devices)
            table[0].append(Action("F", 5, 0))
            return table

    with pytest.raises(ValueError, match=r"F5\.0 on device 0 is out of range: stages are 0\.\.1"):
        schedules.simulate(Extra(), 2, 2)

    class Swapped(schedules.GPipe):
        def actions(self, num_microbatches, num_devices):
            return super().actions(num_microbatches, num_devices)[::-1]

    with pytest.raises(ValueError, match=r"F1\.0 is on device 0, but stage 1 lives on device 1"):
        schedules.validate(Swapped(), 2, 2)


def test_unreadable_action_is_rejected():
    with pytest.raises(ValueError, match=r"Cannot read action 'X1\.0'"):
        schedules.Table([["F0.0", "B0.0"], ["F1.0", "B1.0", "X1.0"]])


def test_stage_on_two_devices_is_rejected():
    with pytest.raises(ValueError, match="stage 0 on devices 0 and 1"):
        schedules.Table([["F0.0", "B0.0"], ["F0.0"]])


def test_table_for_another_shape_names_the_fix():
    table = schedules.Table([["F0.0", "B0.0"], ["F1.0", "B1.0"]])
    with pytest.raises(ValueError, match="set num_microbatches=1"):
        schedules.validate(table, 4, 2)


def test_interleaved_needs_m_multiple_of_devices():
    with pytest.raises(ValueError, match="Use num_microbatches=8"):
        schedules.Interleaved(2).actions(6, 4)
    with pytest.raises(ValueError, match="positive integer"):
        schedules.Interleaved(0)


def test_get_resolves_names_and_rejects_others():
    assert isinstance(schedules.get("GPipe"), schedules.GPipe)
    assert isinstance(schedules.get("1F1B"), schedules.OneFOneB)
    assert schedules.get("interleaved") == schedules.Interleaved(2)
    assert schedules.get("interleaved:4") == schedules.Interleaved(4)
    with pytest.raises(ValueError, match="Unknown schedule 'zb'"):
        schedules.get("zb")
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer"):
        schedules.GPipe().actions(0, 2)
