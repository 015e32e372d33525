"""The action interpreter alone, in pure Python: fake stages and a fake store.

`tfpipe.runtime.Interpreter` only dispatches; the stages and the store do the
TensorFlow work. Here each stage is a scalar linear map y = w_k * x and the
loss is the sum of the last stage's outputs, so every gradient is known in
closed form: a schedule walked by the interpreter must deliver exactly those
gradients, whichever way it runs a split backward (as PyTorch tests its
schedules, with no model).
"""

import math

import pytest

from tfpipe import actions
from tfpipe import runtime
from tfpipe import schedules


class FakeStage:
    """y = w * x on one float; remembers what each micro-batch's backward needs."""

    def __init__(self, k, w, calls):
        self.k, self.w, self.indices = k, w, [k]
        self.calls = calls
        self.held = {}

    def forward(self, m, x):
        self.calls.append(("F", self.k, m))
        y = self.w * x
        return _Forward(out=y, extra=None, parts=[(y, None, None)], moments=[], kept=x,
                        produced=[y])

    def backward(self, m, kept, g_out, weight_sum, want_inputs=True, want_weights=True):
        self.calls.append(("B" if want_inputs and want_weights
                           else "I" if want_inputs else "W", self.k, m))
        (g,) = g_out
        return ([g * self.w] if want_inputs else [], [g * kept] if want_weights else [],
                [False] * want_weights)

    def backward_input(self, m, kept, g_out):
        self.calls.append(("I+held", self.k, m))
        (g,) = g_out
        self.held[m] = [g * kept]
        return [g * self.w], ["held-op"]

    def backward_weight(self, m):
        self.calls.append(("W-released", self.k, m))
        return self.held.pop(m), ["held-op"]


class _Forward:
    def __init__(self, **fields):
        self.__dict__.update(fields)


class FakeStore:
    """The `tfpipe.runtime.Store` protocol on Python floats."""

    def __init__(self, inputs, num_stages):
        self.inputs, self.num_stages = inputs, num_stages
        self.acts, self.kept, self.out_grads, self.grads = {}, {}, {}, {}
        self.released = []

    def begin(self, d, structure, release=()):
        self.released += list(release)
        return structure

    def forward_input(self, d, k, m):
        return self.inputs[m] if k == 0 else self.acts.pop((k, m))

    def put_forward(self, d, k, m, result):
        if k < self.num_stages - 1:
            self.acts[(k + 1, m)] = result.out
        self.kept[(k, m)] = result.kept

    def take_kept(self, k, m):
        return self.kept[(k, m)]

    def loss_seeds(self, plan, scale):
        return [1.0]  # d(sum of outputs) / d output

    def output_gradients(self, k, m):
        return self.out_grads[(k, m)]  # read by I and again by W when they replay

    def put_input_gradients(self, k, m, grads):
        self.out_grads[(k - 1, m)] = grads
        return grads

    def add_weight_gradients(self, d, k, m, grads):
        for i, grad, is_sum in grads:
            self.grads[i] = grad if is_sum else self.grads.get(i, 0.0) + grad
        return [grad for _, grad, _ in grads]

    def weight_sum(self, i):
        return self.grads.get(i)

    def gradients(self):
        return [self.grads.get(i) for i in range(self.num_stages)]

    def loss_sums(self):
        return [], [], []

    def bn_sites(self):
        return []

    def merged_outputs(self):
        return None


def _expected_gradients(weights, inputs):
    """d/dw_k of sum over micro-batches of prod(w) * x."""
    total = sum(inputs)
    return [total * math.prod(w for j, w in enumerate(weights) if j != k)
            for k in range(len(weights))]


def _walk(schedule, m_count, d_count, holds_ops, merge=False):
    schedule = schedules.get(schedule)
    k_count = schedule.num_stages(d_count)
    weights = [1.5 + 0.25 * k for k in range(k_count)]
    inputs = [1.0 + m for m in range(m_count)]
    calls = []
    stages = [FakeStage(k, w, calls) for k, w in enumerate(weights)]
    interpreter = runtime.Interpreter(
        stages, [schedule.stage_device(k, d_count) for k in range(k_count)], holds_ops, True)
    store = FakeStore(inputs, k_count)
    order = schedules.validate(schedule, m_count, d_count)
    if merge:
        order = actions.merge_split_backward(order)
    for d, action in order:
        interpreter.run(store, d, action)
    return store, calls, _expected_gradients(weights, inputs)


@pytest.mark.parametrize("schedule, devices", [
    ("gpipe", 3), ("1f1b", 3), ("interleaved", 2), ("zbh1", 3), ("zbv", 2),
    ("1f1b/segments=2", 2)])
@pytest.mark.parametrize("how", ["hold ops", "replay halves", "merged into B"])
def test_every_schedule_delivers_the_exact_gradients(schedule, devices, how):
    store, calls, expected = _walk(schedule, 4, devices, holds_ops=how == "hold ops",
                                   merge=how == "merged into B")
    assert store.gradients() == pytest.approx(expected, rel=1e-12)
    assert not store.acts  # every stage input was consumed


@pytest.mark.parametrize("holds_ops, merge, kinds", [
    (True, False, {"F", "I+held", "W-released"}),
    (False, False, {"F", "I", "W"}),
    (False, True, {"F", "B"}),
])
def test_a_split_backward_runs_as_the_execution_can(holds_ops, merge, kinds):
    store, calls, _ = _walk("zbh1", 4, 2, holds_ops, merge)
    assert {kind for kind, _, _ in calls} == kinds
    if holds_ops:  # W releases exactly what its I held back
        assert store.released == ["held-op"] * 8
    if not holds_ops and not merge:  # stage 0 has no input gradient: its I does nothing
        assert ("I", 0, 0) not in calls and ("W", 0, 0) in calls


def test_merging_puts_b_where_i_was_and_drops_w():
    order = schedules.validate("zbh1", 3, 2)
    merged = actions.merge_split_backward(order)
    assert [a for _, a in merged if a.kind in "IW"] == []
    expect = [(d, actions.Action("B", a.stage, a.microbatch) if a.kind == "I" else a)
              for d, a in order if a.kind != "W"]
    assert merged == expect
    schedules.simulation.validate(schedules.Table(
        [[a for d, a in merged if d == dev] for dev in range(2)]), 3, 2)
