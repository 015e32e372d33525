"""What tfpipe's checks of a model's assumptions cost at the first step:
`python -m benchmarks.check_cost`.

Two checks run while a step is first traced (`tfpipe.assumptions`): reading
each stage's traced forward for variable writes (every model), and, for a
model whose layers add losses in their call, measuring on the first batch
that each is a mean over rows (an eager forward of two micro-batches per
stage up to the last such stage, and one more for that stage). In a fresh
child process on 2 logical CPUs, per model, the first `fit` of one step (at
M = `--microbatches`) is timed, and so is the time spent inside each check
(the check functions are timed where they are called, nothing else changes):

  first fit s      the first fit: trace, checks, one step
  writes s         reading the traced forwards for writes (all traces)
  call losses s    measuring the call losses on real rows (all traces)
  checks / fit     both over the first fit
  recompute        the recompute mode tfpipe chose (none is given), and
  choice s         the time choosing it took (`tfpipe.recompute_choice`: the
                   untimed unit measurement on the first micro-batch)
  choice / fit     that over the first fit

Models: the repo's transformer LM (`--layers` blocks, width 64; no call
losses), the same with an L2 activity regulariser on every block's output
(`transformer+activity`), and keras-hub's Mixtral (2 layers, 4 experts; its
router loss is refused at M > 1, so it runs with `call_losses="per_microbatch"`
and only the write check, and at M = 1 is not measured).

    python -m benchmarks.check_cost                  # ~1 min on 2 cores
"""

from benchmarks import common

MODELS = ("transformer", "transformer+activity", "mixtral")


def measure(model, layers, microbatches, batch):
    """One child: the first fit of `model` and the time inside each check."""
    import time  # pylint: disable=import-outside-toplevel

    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    import tfpipe  # pylint: disable=import-outside-toplevel
    from tfpipe import assumptions, boundary, runtime  # pylint: disable=import-outside-toplevel
    from tfpipe import model as model_lib  # pylint: disable=import-outside-toplevel
    from tfpipe import recompute_choice  # pylint: disable=import-outside-toplevel

    spent = {"writes": 0.0, "call_losses": 0.0, "choice": 0.0}

    def timed(module, name, key):
        function = getattr(module, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
        setattr(module, name, wrapper)

    # Where they are called from: the probe (writes) and the step (call losses).
    boundary.assumptions = _Proxy(assumptions)
    runtime.assumptions = _Proxy(assumptions)
    timed(boundary.assumptions, "variable_writes", "writes")
    timed(runtime.assumptions, "check_call_losses", "call_losses")
    model_lib.recompute_choice = _Proxy(recompute_choice)  # where the model calls it
    timed(model_lib.recompute_choice, "choose", "choice")

    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    settings = {}
    if model.startswith("transformer"):
        from models import transformer_lm  # pylint: disable=import-outside-toplevel
        net = transformer_lm.transformer_lm(num_layers=layers, width=64, num_heads=4,
                                            seq_len=64)
        if model.endswith("+activity"):
            for layer in net.layers:
                if "block" in layer.name:
                    layer.activity_regularizer = keras.regularizers.L2(1e-4)
        x = rng.integers(0, 256, (batch, 64)).astype("int32")
        y = rng.integers(0, 256, (batch, 64)).astype("int32")
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        import keras_hub  # pylint: disable=import-outside-toplevel
        net = keras_hub.models.MixtralBackbone(
            vocabulary_size=256, num_layers=2, num_query_heads=4, num_key_value_heads=2,
            hidden_dim=64, intermediate_dim=128, num_experts=4, top_k=2)
        net.token_embedding.reverse_embeddings.trainable = False
        x = {"token_ids": rng.integers(1, 256, (batch, 64)).astype("int32"),
             "padding_mask": np.ones((batch, 64), "int32")}
        y = rng.normal(size=(batch, 64, 64)).astype("float32")
        loss = "mse"
        settings["call_losses"] = "per_microbatch"
    with tfpipe.PipelineStrategy(num_microbatches=microbatches, **settings).scope():
        pipelined = tfpipe.PipelinedModel.from_model(net)
        pipelined.compile(optimizer="adam", loss=loss)
    start = time.perf_counter()
    pipelined.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    first = time.perf_counter() - start
    return {"model": model, "microbatches": microbatches, "first_fit_s": first,
            "writes_s": spent["writes"], "call_losses_s": spent["call_losses"],
            "checks_fraction": (spent["writes"] + spent["call_losses"]) / first,
            "recompute_used": pipelined.recompute, "choice_s": spent["choice"],
            "choice_fraction": spent["choice"] / first}


class _Proxy:
    """The module's attributes, with some replaced (only in this child)."""

    def __init__(self, module):
        self.__dict__.update(vars(module))


def table(rows):
    return common.markdown_table(
        [("model", "model", None), ("M", "microbatches", None),
         ("first fit s", "first_fit_s", 2), ("writes s", "writes_s", 3),
         ("call losses s", "call_losses_s", 3), ("checks / fit", "checks_fraction", ".1%"),
         ("recompute", "recompute_used", None), ("choice s", "choice_s", 3),
         ("choice / fit", "choice_fraction", ".1%")],
        rows)


def main(argv):
    from absl import flags  # pylint: disable=import-outside-toplevel
    f = flags.FLAGS
    info, start = common.begin(argv)
    rows = []
    for model in f.models:
        rows.append(common.run_child("benchmarks.check_cost:measure", dict(
            model=model, layers=f.layers, microbatches=f.microbatches, batch=f.batch),
            intra_op=2, inter_op=2, devices=2))
        print(rows[-1], flush=True)
    common.finish(f.out, info, start, rows,
                  f"first fit of one step, batch {f.batch}, M={f.microbatches}, 2 stages on 2 "
                  f"logical CPUs, Adam", table(rows),
                  config={"layers": f.layers, "microbatches": f.microbatches, "batch": f.batch})


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_list("models", list(MODELS), f"Rows, of {', '.join(MODELS)}.")
    flags.DEFINE_integer("layers", 4, "Transformer blocks.", lower_bound=1)
    flags.DEFINE_integer("microbatches", 4, "M.", lower_bound=2)
    flags.DEFINE_integer("batch", 32, "Rows of the batch.", lower_bound=2)
    flags.DEFINE_string("out", str(common.RESULTS_DIR / "check_cost.json"), "JSON output.")
    common.one_of("models", MODELS)


if __name__ == "__main__":
    from absl import app as _app
    _define_flags()
    _app.run(main)
