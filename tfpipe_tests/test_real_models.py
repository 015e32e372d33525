"""Models tfpipe did not write train to the same weights as plain Keras.

One table over the patterns of `tfpipe_tests.patterns` (softmax and sigmoid
heads with Keras' default losses, masks across cuts, ignore_class, wrappers
and nested models in every stage position, adapted preprocessing layers,
Lambda, a custom layer without get_config, shared layers, several outputs
with dict losses, dict inputs, stage losses, sample weights under every
reduction, sparse and ragged inputs) and the setups below (M = 1 and M = 4,
the schedules, zero-bubble included, and the executions).

The rows are chosen, not multiplied out: a pattern runs under several setups
only where it meets code that depends on the setup (`CROSSES`, each entry
says which); every other pattern, each crossentropy variant (the loss split is
one code path for all of them) and each further cut of a pattern (`balances`
after the first: a mask, wrapper or shared layer crossing another cut) runs
once, the setups taking turns. The default suite runs every pattern and every
setup at least once (checked below, at collection); `-m slow` runs the rest.

Each row trains the pipeline and a plain Keras twin (same initial weights)
for one epoch of 3 Adam steps (the last batch ragged) and asserts: every
weight within 2e-5, the same history keys, the same history values and
`evaluate` results (rtol 1e-5). The plain twin does not depend on the setup
or the cut, so it is trained once per pattern and test process
(`helpers.plain_reference`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe_tests import helpers
from tfpipe_tests import patterns

WEIGHT_TOL = 2e-5
SETUPS = {
    "M1": dict(num_microbatches=1),
    "M4-gpipe": dict(num_microbatches=4, schedule="gpipe", recompute="except_last"),
    "M4-1f1b-always": dict(num_microbatches=4, schedule="1f1b", recompute="always"),
    "M4-loop": dict(num_microbatches=4, execution="loop"),
    # Zero-bubble: a split backward (I then W) in the graph, and replayed in the loop.
    "M4-zbh1": dict(num_microbatches=4, schedule="zbh1", recompute="never"),
    "M4-zbv-loop": dict(num_microbatches=4, schedule="zbv", execution="loop"),
    # Each stage traced once as a tf.function, called per micro-batch.
    "M4-1f1b-functions": dict(num_microbatches=4, schedule="1f1b", recompute="except_last",
                              execution="stage_functions"),
}

# Patterns that meet setup-specific code, under each setup that has it (on the
# pattern's first balance). The first setup of each is its default-suite row.
CROSSES = {
    # A masked per-token loss: its divisor (the count of real tokens) is seeded
    # before the first backward differently by GPipe, 1F1B and ZB-H1. Its
    # Embedding's sparse (IndexedSlices) gradients are summed over the
    # micro-batches in the loop and across stage functions.
    "masked_sequence": ("M4-1f1b-always", "M4-gpipe", "M4-zbh1", "M4-loop",
                        "M4-1f1b-functions"),
    # The other counted loss (ignored tokens drop out of the divisor).
    "ignore_class": ("M4-zbh1", "M4-gpipe", "M4-1f1b-always"),
    # Embeddings behind adapted lookups (sparse gradients) and string inputs.
    "preprocessing": ("M4-loop", "M4-1f1b-functions"),
    # A tf.SparseTensor input: sparse tensors across the loop and stage functions.
    "sparse_input": ("M4-1f1b-functions", "M4-loop"),
    # Control flow in a stage (LSTM/GRU while loops): ZB-H1 unrolled holds the
    # weight-gradient ops of the loop apart until W; stage functions trace
    # them once; the loop form runs them inside its own while loop.
    "wrappers": ("M4-1f1b-functions", "M4-zbh1", "M4-loop"),
    # Several loss terms (dict and list losses, loss_weights, per-output
    # metrics) on the last stage while 1F1B interleaves backwards.
    "multi_output_dict": ("M4-1f1b-always",),
    "multi_output_list": ("M4-1f1b-always",),
    # Call losses (regularisers, add_loss) gathered per stage in the loop and
    # in stage functions.
    "stage_losses": ("M4-loop", "M4-1f1b-functions"),
}
# Three crossentropy variants run by default; the other 11 are slow rows.
DEFAULT_XENT = ("sparse_categorical_crossentropy-softmax", "binary_crossentropy-sigmoid",
                "categorical_focal-logits")


def _valid(setup, balance):
    """ZB-V runs 2 stages per device: an even number of stages, given explicitly."""
    return "zbv" not in setup or (balance is not None and len(balance) % 2 == 0)


class _Turns:
    """The setups taking turns: each row gets the setup whose turn is longest
    past among those that can run its balance (so ZB-V, which needs an even
    cut, takes the next even cut when its turn came on another) and, where
    one can, that the pattern has not run yet."""

    def __init__(self, start=0):
        names = list(SETUPS)
        self.queue = names[start:] + names[:start]

    def next(self, balance, used=()):
        valid = [s for s in self.queue if _valid(s, balance)]
        setup = next((s for s in valid if s not in used), valid[0])
        self.queue.remove(setup)
        self.queue.append(setup)
        return setup


def _rows():
    """[(pattern, setup, balance, in the default suite)]."""
    xent = {p.name for p in patterns.crossentropy_patterns()}
    default_turns, slow_turns = _Turns(), _Turns(start=3)
    rows = []
    for pattern in patterns.all_patterns():
        first = pattern.balances[0]
        if pattern.name in CROSSES:
            mine = [(pattern, s, first, i == 0) for i, s in enumerate(CROSSES[pattern.name])]
        elif pattern.name not in xent or pattern.name in DEFAULT_XENT:
            mine = [(pattern, default_turns.next(first), first, True)]
        else:
            mine = [(pattern, slow_turns.next(first), first, False)]
        for balance in pattern.balances[1:]:
            used = {setup for _, setup, _, _ in mine}
            mine.append((pattern, slow_turns.next(balance, used), balance, False))
        rows += mine
    return rows


def _check_default_suite(rows):
    """Every setup and every pattern (of the crossentropy variants, DEFAULT_XENT)
    runs in the default suite."""
    default = [(p.name, s) for p, s, _, d in rows if d]
    assert {s for _, s in default} == set(SETUPS), sorted({s for _, s in default})
    xent = {p.name for p in patterns.crossentropy_patterns()}
    assert {p for p, _ in default} == (
        {p.name for p in patterns.all_patterns()} - xent) | set(DEFAULT_XENT)
    for pattern, setup, balance, _ in rows:
        assert _valid(setup, balance), (pattern.name, setup, balance)


ROWS = _rows()
_check_default_suite(ROWS)


def _plain(pattern, seed=0):
    """The plain-Keras twin's initial weights, and after one epoch its
    weights, history and `evaluate` results (trained once per process)."""
    def train():
        keras.utils.set_random_seed(seed)
        plain = pattern.build()
        initial = plain.get_weights()
        x, y, sample_weight = pattern.data()
        plain.compile(optimizer="adam", **pattern.compile)
        history = plain.fit(x, **_fit_kwargs(pattern, x, y, sample_weight)).history
        evaluate = plain.evaluate(x, **_evaluate_kwargs(pattern, x, y, sample_weight))
        return dict(initial=initial, weights=plain.get_weights(), history=history,
                    evaluate=evaluate)
    return helpers.plain_reference(("real_models", pattern.name, seed), train)


def _fit_kwargs(pattern, x, y, sample_weight):
    fit = dict(epochs=1, shuffle=False, verbose=0)
    if not isinstance(x, tf.data.Dataset):
        fit.update(y=y, sample_weight=sample_weight, batch_size=pattern.batch_size)
    return fit


def _evaluate_kwargs(pattern, x, y, sample_weight):
    evaluate = dict(verbose=0, return_dict=True)
    if not isinstance(x, tf.data.Dataset):
        evaluate.update(y=y, sample_weight=sample_weight, batch_size=pattern.batch_size)
    return evaluate


def train_pipelined(pattern, setup, balance, initial, seed=0):
    """(pipelined model, its history, data), from the plain twin's initial weights."""
    keras.utils.set_random_seed(seed)
    source = pattern.build()
    source.set_weights(initial)
    x, y, sample_weight = pattern.data()
    with tfpipe.PipelineStrategy(**SETUPS[setup]).scope():
        pipelined = tfpipe.PipelinedModel.from_model(source, balance=balance)
        pipelined.compile(optimizer="adam", **pattern.compile)
    history = pipelined.fit(x, **_fit_kwargs(pattern, x, y, sample_weight)).history
    return pipelined, history, (x, y, sample_weight)


def assert_same_weights(plain_weights, pipelined, tol=WEIGHT_TOL):
    source = pipelined.source_model
    assert len(plain_weights) == len(source.weights)
    worst = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(plain_weights, source.get_weights()))
    assert worst < tol, worst


@pytest.mark.parametrize("pattern, setup, balance", [
    pytest.param(p, s, b, id=f"{p.name}-{s}-{b}", marks=() if d else pytest.mark.slow)
    for p, s, b, d in ROWS])
def test_pipelined_training_matches_plain_keras(pattern, setup, balance):
    plain = _plain(pattern)
    pipelined, h_pipe, (x, y, sample_weight) = train_pipelined(
        pattern, setup, balance, plain["initial"])
    if balance is not None:
        assert pipelined.balance == balance
    assert_same_weights(plain["weights"], pipelined)
    h_plain = plain["history"]
    assert sorted(h_pipe) == sorted(h_plain)
    for key in h_plain:
        np.testing.assert_allclose(h_pipe[key], h_plain[key], rtol=1e-5, atol=1e-6, err_msg=key)
    got = pipelined.evaluate(x, **_evaluate_kwargs(pattern, x, y, sample_weight))
    want = plain["evaluate"]
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
