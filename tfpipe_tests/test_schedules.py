"""Schedules as data: tables, validation and simulation, without running a model."""

import pytest

from tfpipe import actions
from tfpipe import schedules
from tfpipe import simulation
from tfpipe.actions import Action

GRID = [(1, 1), (1, 4), (4, 4), (8, 2), (5, 3), (16, 4), (3, 8)]


def _all_schedules(m, d):
    out = [schedules.GPipe(), schedules.OneFOneB()]
    out += [schedules.Interleaved(v) for v in (2, 3) if m % d == 0]
    return out


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


# -- split backward (I and W) and the zero-bubble schedules ---------------------

ZB_GRID = [(d, m) for d in (2, 3, 4) for m in sorted({d, 2 * d, 8, 16})]


def _idle(sim, d):
    return d * sim.makespan - sum(e - s for row in sim.timeline for _, s, e in row)


def test_doctests_in_schedules():
    import doctest
    result = doctest.testmod(schedules)
    assert result.attempted >= 10 and result.failed == 0


@pytest.mark.parametrize("text, action", [
    ("I2.5", Action("I", 2, 5)), ("w0.1", Action("W", 0, 1)), ("i 3 : 4", Action("I", 3, 4)),
    (("w", 1, 2), Action("W", 1, 2)), ("b1.0", Action("B", 1, 0)),
])
def test_parse_split_backward_actions(text, action):
    assert Action.parse(text) == action


def test_unreadable_action_lists_all_four_kinds():
    with pytest.raises(ValueError, match=r"Cannot read action 'X1\.0'.*'F<stage>.*'B<stage>.*"
                                         r"'I<stage>.*'W<stage>"):
        Action.parse("X1.0")


@pytest.mark.parametrize("kind, memory, cost", [
    ("F", 1, "forward"), ("B", -1, "backward"), ("I", 0, "input"), ("W", -1, "weight")])
def test_kinds_table(kind, memory, cost):
    assert actions.KINDS[kind].memory == memory
    assert actions.KINDS[kind].cost == cost


@pytest.mark.parametrize("action, table, deps", [
    ("F1.2", (), ["F0.2"]),
    ("F0.2", (), []),
    ("B1.2", (), ["F1.2", "B2.2"]),
    ("B1.2", {Action("I", 2, 2)}, ["F1.2", "I2.2"]),
    ("I1.2", {Action("I", 2, 2)}, ["F1.2", "I2.2"]),
    ("I2.2", {Action("I", 2, 2)}, ["F2.2"]),  # last stage: only its forward
    ("W1.2", (), ["I1.2"]),
])
def test_kind_dependencies(action, table, deps):
    a = Action.parse(action)
    assert [str(x) for x in actions.KINDS[a.kind].dependencies(a, 3, table)] == deps


@pytest.mark.parametrize("d, m", ZB_GRID)
def test_zbh1_idle_is_one_third_of_1f1b(d, m):
    zb = schedules.simulate(schedules.ZeroBubbleH1(), m, d, 1.0, 2.0, weight_cost=1.0)
    one = schedules.simulate(schedules.OneFOneB(), m, d, 1.0, 2.0)
    assert _idle(one, d) == pytest.approx(3 * d * (d - 1))
    assert _idle(zb, d) == pytest.approx(_idle(one, d) / 3)
    assert zb.makespan == pytest.approx(3 * m + d - 1)
    # Same pipeline peak as 1F1B (its first device); see the docstring for d > 0.
    assert zb.peak_activations == [min(m, d)] * d
    assert max(zb.peak_activations) == max(one.peak_activations)


@pytest.mark.parametrize("d, m", ZB_GRID)
def test_zbv_bubble_near_zero_at_1f1b_memory(d, m):
    sim = schedules.simulate(schedules.ZeroBubbleV(), m, d, 1.0, 2.0, weight_cost=1.0)
    assert sim.bubble_fraction == pytest.approx((d - 1) / (6 * m + d - 1))
    if m >= 2 * d:
        assert sim.bubble_fraction < 0.06
    one = schedules.simulate(schedules.OneFOneB(), m, d, 1.0, 2.0)
    assert _idle(sim, d) == pytest.approx(_idle(one, d) / 6)
    # Counted in stages, each half a device's share: at most 1F1B's 2 * D halves.
    assert sim.peak_activations == [2 * min(m, d)] * d
    assert max(sim.peak_activations) <= 2 * max(one.peak_activations)


@pytest.mark.parametrize("m, d", [(4, 4), (8, 4), (16, 4), (8, 2), (3, 5), (1, 3)])
@pytest.mark.parametrize("schedule, peaks", [
    (schedules.GPipe(), lambda m, d: [m] * d),
    (schedules.OneFOneB(), lambda m, d: [min(m, d - i) for i in range(d)]),
    (schedules.ZeroBubbleH1(), lambda m, d: [min(m, d)] * d),
    (schedules.ZeroBubbleV(), lambda m, d: [2 * min(m, d)] * d),
])
def test_peak_activations_per_device(schedule, peaks, m, d):
    assert schedules.simulate(schedule, m, d).peak_activations == peaks(m, d)


@pytest.mark.parametrize("m, d", GRID)
@pytest.mark.parametrize("schedule", [schedules.ZeroBubbleH1(), schedules.ZeroBubbleV()])
def test_zero_bubble_tables_are_complete_and_placed(schedule, m, d):
    table = schedule.actions(m, d)
    k = schedule.num_stages(d)
    assert sorted(a for row in table for a in row) == sorted(
        Action(kind, s, mb) for kind in "FIW" for s in range(k) for mb in range(m))
    for dev, row in enumerate(table):
        assert all(schedule.stage_device(a.stage, d) == dev for a in row)
    schedules.validate(schedule, m, d)
    # The same rows as a literal Table: placement (a V for ZB-V) is inferred.
    literal = schedules.Table([[str(a) for a in row] for row in table])
    assert [literal.stage_device(s, d) for s in range(k)] == [
        schedule.stage_device(s, d) for s in range(k)]
    assert (schedules.simulate(literal, m, d).makespan
            == schedules.simulate(schedule, m, d).makespan)


def test_zbv_is_a_v():
    zbv = schedules.ZeroBubbleV()
    assert zbv.num_stages(3) == 6
    assert [zbv.stage_device(s, 3) for s in range(6)] == [0, 1, 2, 2, 1, 0]


@pytest.mark.parametrize("name, cls", [("zbh1", schedules.ZeroBubbleH1),
                                       ("ZBV", schedules.ZeroBubbleV)])
def test_zero_bubble_names_and_config(name, cls):
    schedule = schedules.get(name)
    assert type(schedule) is cls and name.lower() in schedules.SCHEDULE_NAMES
    assert schedules.from_config(schedules.to_config(schedule)) == schedule
    table = schedules.Table(schedule.actions(2, 2))
    assert schedules.from_config(schedules.to_config(table)).table == table.table


@pytest.mark.parametrize("schedule", [schedules.ZeroBubbleH1(), schedules.ZeroBubbleV(),
                                      schedules.Table([["F0.0", "I0.0", "W0.0"],
                                                       ["F1.0", "B1.0"]])])
def test_weight_cost_defaults_to_half_the_backward(schedule):
    m, d = (1, 2) if isinstance(schedule, schedules.Table) else (8, 2)
    default = schedules.simulate(schedule, m, d, 1.0, 3.0)
    explicit = schedules.simulate(schedule, m, d, 1.0, 3.0, weight_cost=1.5)
    assert default.timeline == explicit.timeline
    # I costs the rest of the backward.
    costs = {a.kind: e - s for row in default.timeline for a, s, e in row}
    v = schedule.virtual_stages
    assert costs["I"] == costs["W"] == pytest.approx(1.5 / v)


def test_per_stage_weight_costs_and_bad_weight_cost():
    table = schedules.Table([["F0.0", "I0.0", "W0.0"], ["F1.0", "I1.0", "W1.0"]])
    sim = schedules.simulate(table, 1, 2, [1.0, 1.0], [2.0, 4.0], weight_cost=[0.5, 1.0])
    # F0, F1, I1 (3), I0 (1.5), W0 (0.5).
    assert sim.makespan == pytest.approx(1 + 1 + 3 + 1.5 + 0.5)
    with pytest.raises(ValueError, match=r"weight_cost must be between 0 and backward_cost"):
        schedules.simulate(table, 1, 2, 1.0, 2.0, weight_cost=3.0)


@pytest.mark.parametrize("schedule, m, d, makespans", [
    # (never, except_last, always); F=1, B=2. Keeping the last micro-batch
    # saves one forward per stage on the tail's critical path, not per step.
    ("gpipe", 8, 2, (27.0, 35.0, 36.0)),
    ("1f1b", 8, 2, (27.0, 34.0, 36.0)),
    ("1f1b", 8, 4, (33.0, 42.0, 44.0)),
    ("zbh1", 8, 2, (25.0, 33.0, 34.0)),
    ("gpipe", 1, 2, (6.0, 6.0, 8.0)),  # M=1: except_last keeps everything
])
def test_recompute_prices_the_replayed_forward(schedule, m, d, makespans):
    got = tuple(schedules.simulate(schedule, m, d, recompute=mode).makespan
                for mode in ("never", "except_last", "always"))
    assert got == makespans


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1", "zbv"])
def test_the_replay_goes_to_the_action_that_needs_the_activations(schedule):
    sim = schedules.simulate(schedule, 4, 2, 1.0, 2.0, recompute="except_last")
    v = schedules.get(schedule).virtual_stages
    for row in sim.timeline:
        for action, start, end in row:
            replayed = action.kind in ("B", "I") and action.microbatch != 3
            own = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}[action.kind]
            assert end - start == pytest.approx((own + replayed) / v), action
    # Without split backwards, "always" is a backward of forward + backward.
    if schedule in ("gpipe", "1f1b"):
        assert (schedules.simulate(schedule, 4, 2, recompute="always").timeline
                == schedules.simulate(schedule, 4, 2, 1.0, 3.0).timeline)


def test_unknown_recompute_mode_is_named():
    with pytest.raises(ValueError, match=r"Unknown recompute mode 'sometimes'.*'always'"):
        schedules.simulate("gpipe", 4, 2, recompute="sometimes")


@pytest.mark.parametrize("rows, message", [
    ([["F0.0", "B0.0", "I0.0", "W0.0"], ["F1.0", "B1.0"]],
     r"has both B0\.0 and I0\.0 and W0\.0: the backward of stage 0 on micro-batch 0 is "
     r"either one B or one I"),
    ([["F0.0", "B0.0", "W0.0"], ["F1.0", "B1.0"]], r"has both B0\.0 and W0\.0"),
    ([["F0.0", "W0.0"], ["F1.0", "B1.0"]], r"missing 1 action\(s\): I0\.0\..*one I and one W"),
    ([["F0.0", "I0.0"], ["F1.0", "B1.0"]], r"missing 1 action\(s\): W0\.0"),
    ([["F0.0", "W0.0", "I0.0"], ["F1.0", "B1.0"]],
     r"deadlock: device 0 waits at W0\.0 for I0\.0\..*W\(s,m\) needs I\(s,m\)"),
    ([["F0.0", "I0.0", "W0.0"], ["F1.0", "W1.0", "I1.0"]],
     r"device 0 waits at I0\.0 for I1\.0; device 1 waits at W1\.0 for I1\.0"),
    ([["F0.0", "B0.0"], ["I1.0", "F1.0", "W1.0"]],
     r"device 1 waits at I1\.0 for F1\.0.*I\(s,m\) need F\(s,m\) and the input gradient"),
])
def test_split_backward_errors_name_the_actions(rows, message):
    with pytest.raises(ValueError, match=message):
        schedules.validate(schedules.Table(rows), 1, 2)


def test_mixed_b_and_split_table_runs():
    # Stage 1 splits, stage 0 does not: B0.0 takes its gradient from I1.0.
    table = schedules.Table([["F0.0", "B0.0"], ["F1.0", "I1.0", "W1.0"]])
    order = [str(a) for _, a in schedules.validate(table, 1, 2)]
    assert order.index("I1.0") < order.index("B0.0")
    assert actions.input_gradient_action({Action("I", 1, 0)}, 1, 0) == Action("I", 1, 0)
    assert actions.input_gradient_action((), 1, 0) == Action("B", 1, 0)


def _check_ticks(ticks, schedule, m, d, forward_only=False):
    k = schedule.num_stages(d)
    at = {a: t for t, tick in enumerate(ticks) for a in tick if a is not None}
    rows = [[a for a in row if a.kind == "F" or not forward_only]
            for row in schedule.actions(m, d)]
    assert [[a for tick in ticks for a in tick[dev:dev + 1] if a is not None]
            for dev in range(d)] == rows
    for a, t in at.items():
        for dep in actions.KINDS[a.kind].dependencies(a, k, at):
            assert at[dep] < t, (a, dep)


@pytest.mark.parametrize("schedule, m, d, costs", [
    (schedules.OneFOneB(), 8, 4, (1.0, 3.0)),
    (schedules.GPipe(), 5, 3, (1.0, 2.0, None)),
    (schedules.Interleaved(2), 8, 4, (1.0, 3.0)),
    (schedules.ZeroBubbleH1(), 8, 4, (1.0, 2.0, 1.0)),
    (schedules.ZeroBubbleV(), 6, 3, (1.0, 3.0, 0.5)),
    (schedules.ZeroBubbleH1(), 4, 2, (1.0, 2.0, 0.0)),  # zero-cost W
])
def test_clock_ticks_from_costs_follow_the_simulation(schedule, m, d, costs):
    ticks = schedules.clock_ticks(schedule, m, d, costs=costs)
    _check_ticks(ticks, schedule, m, d)
    _check_ticks(schedules.clock_ticks(schedule, m, d), schedule, m, d)
    forward = schedules.clock_ticks(schedule, m, d, forward_only=True, costs=costs)
    _check_ticks(forward, schedule, m, d, forward_only=True)
    if costs[2:] != (0.0,):
        # Each action sits at the tick of its simulated start time.
        sim = schedules.simulate(schedule, m, d, *costs)
        starts = sorted({s for row in sim.timeline for _, s, _ in row})
        begins = {a: s for row in sim.timeline for a, s, _ in row}
        assert {a: starts[t] for t, tick in enumerate(ticks) for a in tick if a} == begins


def test_event_order_beats_lock_step_1f1b_58_vs_44():
    # The numbers: 1F1B, F=1, B=3, M=8, D=4.
    lock_step = schedules.clock_ticks(schedules.OneFOneB(), 8, 4)
    assert simulation.tick_makespan(lock_step, 1.0, 3.0) == 58.0
    assert schedules.simulate(schedules.OneFOneB(), 8, 4, 1.0, 3.0).makespan == 44.0
    # Event ticks start where the simulation starts each action: the run they
    # describe (no barrier) ends at 44, no longer than the lock-step 58.
    events = schedules.clock_ticks(schedules.OneFOneB(), 8, 4, costs=(1.0, 3.0))
    sim = schedules.simulate(schedules.OneFOneB(), 8, 4, 1.0, 3.0)
    ends = {a: e for row in sim.timeline for a, _, e in row}
    assert max(ends[a] for tick in events for a in tick if a) == 44.0 <= 58.0
    # With equal costs the two clocks agree.
    for schedule in (schedules.GPipe(), schedules.OneFOneB(), schedules.Interleaved(2)):
        assert (schedules.clock_ticks(schedule, 8, 4, costs=(1.0, 1.0))
                == schedules.clock_ticks(schedule, 8, 4))


def test_lock_step_ticks_handle_split_backward():
    ticks = schedules.clock_ticks(schedules.ZeroBubbleH1(), 3, 2)
    assert [" ".join(str(a) if a else "-" for a in tick) for tick in ticks[:4]] == [
        "F0.0 -", "F0.1 F1.0", "- I1.0", "I0.0 F1.1"]
    assert simulation.tick_makespan(ticks, 1.0, 2.0) == len(ticks)  # F = I = W = 1
    assert simulation.tick_makespan(schedules.clock_ticks(schedules.ZeroBubbleV(), 4, 2), 1.0, 2.0,
                                   virtual_stages=2) == pytest.approx(
        schedules.simulate(schedules.ZeroBubbleV(), 4, 2).makespan)


@pytest.mark.parametrize("base", [schedules.GPipe(), schedules.OneFOneB(),
                                  schedules.ZeroBubbleH1(), schedules.ZeroBubbleV()])
@pytest.mark.parametrize("segments", [2, 3])
def test_segmented_keeps_the_base_schedule_and_splits_each_stage(base, segments):
    # Recompute granularity: the same devices, order and bubble; each stage
    # becomes `segments` sub-stages on its device, run back to back.
    seg = schedules.Segmented(base, segments)
    m, d = 4, 2
    k = base.num_stages(d)
    assert seg.num_stages(d) == k * segments
    assert [seg.stage_device(s, d) for s in range(k * segments)] == [
        base.stage_device(s // segments, d) for s in range(k * segments)]
    # 1/segments of the cost per sub-stage: the simulated bubble is the base's.
    assert schedules.simulate(seg, m, d).bubble_fraction == pytest.approx(
        schedules.simulate(base, m, d).bubble_fraction)
    for row, base_row in zip(seg.actions(m, d), base.actions(m, d)):
        assert len(row) == segments * len(base_row)
        for i, a in enumerate(base_row):
            pieces = row[i * segments:(i + 1) * segments]
            assert {(p.kind, p.microbatch, p.stage // segments) for p in pieces} == {
                (a.kind, a.microbatch, a.stage)}
            order = [p.stage for p in pieces]
            assert order == (sorted(order) if a.kind == "F" else sorted(order, reverse=True))
    assert schedules.from_config(schedules.to_config(seg)) == seg
    assert schedules.get(f"{base.name}/segments={segments}") == seg


def test_segmented_rejects_a_bad_count_and_nests():
    with pytest.raises(ValueError, match=r"Segmented\(segments=...\) must be a positive "
                                         r"integer, got 0"):
        schedules.Segmented("gpipe", 0)
    assert schedules.Segmented(schedules.Segmented("1f1b", 2), 3) == schedules.Segmented(
        "1f1b", 6)
