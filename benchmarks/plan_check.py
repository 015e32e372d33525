"""The planner's predictions against measured steps: `python -m benchmarks.plan_check`.

Does `tfpipe.plan` recommend a configuration that is among the fastest when
run? On K logical CPUs (one intra-op thread each and `serialize_ops`, as
`benchmarks.speedup` runs):

1. One child runs `tfpipe.plan` on the plain model (`--model`, the sizes of
   `benchmarks.speedup`) at its batch: one unit measurement, then every
   configuration the recommendation compares, each with a predicted step.
2. Each grid row (`--microbatches` x `--schedules`, recompute "never", the
   balance the planner predicts fastest for it) and the planner's
   recommendation are run by `benchmarks.speedup`'s child, one fresh process
   each, with tfpipe's default execution for them, against plain Keras.

Rows are compared by step / plain Keras' step in the same child, so that
drift between children cancels. The summary: the recommendation's
step / plain over the best row's ("recommended / best", at most 1.10 is
"within 10%"), and the fraction of row pairs that the prediction and the
measurement put in the same order.

    python -m benchmarks.plan_check                      # the MLP, ~10 min on 2 cores
    python -m benchmarks.plan_check --model=transformer  # ~12 min
"""

import itertools

from benchmarks import common
from benchmarks import speedup

MEASURED = ("execution", "plain_ms", "step_ms", "speedup", "ideal", "trace_ratio")
WITHIN = 1.10  # the recommendation's step at most 10% over the best measured


# -- in the child ---------------------------------------------------------------------


def predict(num_devices, num_microbatches, model, layers, width, batch, heads, seq_len,
            max_microbatches, repeats=2):
    """`tfpipe.plan` of the plain model here (K logical CPUs); returns its
    recommendation and every configuration it tried (JSON values)."""
    import keras  # pylint: disable=import-outside-toplevel
    import tfpipe  # pylint: disable=import-outside-toplevel
    from models import transformer_lm  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(0)
    balance = None
    if model == "transformer":
        plain = transformer_lm.transformer_lm(num_layers=layers, width=width,
                                              num_heads=heads, seq_len=seq_len)
        balance = transformer_lm.stage_balance(plain, num_devices)
    else:
        plain = keras.Sequential([keras.Input((width,))] + common.mlp_layers(layers, width))
    plan = tfpipe.plan(plain, batch, num_microbatches, num_stages=num_devices,
                       devices=[f"/CPU:{i}" for i in range(num_devices)], schedule="gpipe",
                       recompute="never", balance=balance, optimizer="adam", repeats=repeats,
                       max_microbatches=max_microbatches)
    rec = plan.recommendation
    return {"tried": rec.tried, "plan_s": plan.measured["seconds"],
            "recommended": {"num_microbatches": rec.num_microbatches,
                            "schedule": rec.schedule, "recompute": rec.recompute,
                            "balance": rec.balance, "step_time_s": rec.step_time_s}}


# -- in the parent ------------------------------------------------------------------------


def _key(config):
    return (config["num_microbatches"], config["schedule"], config["recompute"],
            tuple(config["balance"]))


def grid_configs(tried, microbatches, schedules):
    """Per (M, schedule) of the grid, the "never" configuration the planner
    predicts fastest (it tried each balance it considers); missing cells are
    ones the planner does not run (e.g. M below the schedule's minimum)."""
    out = []
    for m, name in itertools.product(microbatches, schedules):
        cell = [t for t in tried if (t["num_microbatches"], t["schedule"], t["recompute"])
                == (m, name, "never")]
        if cell:
            out.append(min(cell, key=lambda t: t["step_time_s"]))
    return out


def pairs_agree(rows):
    """The fraction of row pairs whose predicted and measured orders agree."""
    pairs = list(itertools.combinations(rows, 2))
    same = sum((a["predicted_ms"] < b["predicted_ms"]) == (a["step_vs_plain"] < b["step_vs_plain"])
               for a, b in pairs)
    return same / len(pairs) if pairs else None


def summarize(rows):
    """The recommendation's step / plain over the best row's, and `pairs_agree`."""
    good = [r for r in rows if "error" not in r]
    best = min(good, key=lambda r: r["step_vs_plain"])
    rec = next(r for r in rows if r["recommended"])
    ratio = rec["step_vs_plain"] / best["step_vs_plain"] if "error" not in rec else None
    return {"best": {k: best[k] for k in ("num_microbatches", "schedule", "recompute",
                                          "balance", "step_vs_plain")},
            "recommended_vs_best": ratio,
            "within_10_percent": ratio is not None and ratio <= WITHIN,
            "pairs_agree": pairs_agree(good)}


def run(num_devices, num_microbatches, microbatches, schedules, max_microbatches, sizes,
        timing, log=print, timeout=1800):
    """The plan child, then one measuring child per row; (rows, summary, plan)."""
    kwargs = dict(sizes)
    planned = common.run_child(
        "benchmarks.plan_check:predict",
        dict(num_devices=num_devices, num_microbatches=num_microbatches,
             max_microbatches=max_microbatches, **kwargs),
        intra_op=1, inter_op=num_devices, devices=num_devices, timeout=timeout)
    if "error" in planned:
        raise RuntimeError(f"the plan child failed: {common.error_line(planned)}\n"
                           f"{planned.get('stderr_tail')}")
    recommended = planned["recommended"]
    configs = grid_configs(planned["tried"], microbatches, schedules)
    if _key(recommended) not in {_key(c) for c in configs}:
        configs.append({**recommended, "step_time_s": recommended["step_time_s"]})
    rows = []
    for config in configs:
        result = common.run_child(
            "benchmarks.speedup:measure",
            dict(num_devices=num_devices, num_microbatches=config["num_microbatches"],
                 schedule=config["schedule"], recompute=config["recompute"],
                 balance=config["balance"], **kwargs, **timing),
            intra_op=1, inter_op=num_devices, devices=num_devices, timeout=timeout)
        row = {k: config[k] for k in ("num_microbatches", "schedule", "recompute", "balance")}
        row["recommended"] = _key(config) == _key(recommended)
        row["predicted_ms"] = 1e3 * config["step_time_s"]
        if "error" in result:
            row.update(error=common.error_line(result), stderr_tail=result.get("stderr_tail"))
        else:
            row.update({f: result.get(f) for f in MEASURED})
            row["step_vs_plain"] = row["step_ms"] / row["plain_ms"]
            row["measured_vs_predicted"] = row["step_ms"] / row["predicted_ms"]
        rows.append(row)
        log(f"M={row['num_microbatches']:<3} {row['schedule']:<11} {row['recompute']:<11} "
            f"{str(row['balance']):<14} "
            + (f"ERROR {row['error']}" if "error" in row else
               f"predicted {row['predicted_ms']:8.1f} ms  measured {row['step_ms']:8.1f} ms  "
               f"step/plain {row['step_vs_plain']:.3f}")
            + ("  (recommended)" if row["recommended"] else ""))
    return rows, summarize(rows), planned


def table(rows):
    cols = [("M", "num_microbatches", 0), ("schedule", "schedule", 0),
            ("recompute", "recompute", 0), ("balance", "balance", 0),
            ("execution", "execution", 0), ("predicted ms", "predicted_ms", 1),
            ("measured ms", "step_ms", 1), ("plain ms", "plain_ms", 1),
            ("step / plain", "step_vs_plain", 3), ("measured / predicted",
                                                    "measured_vs_predicted", 2),
            ("speed-up / ideal", "of_ideal", 2), ("first call / plain's", "trace_ratio", 2)]
    shown = [{**r, "schedule": r["schedule"] + (" (recommended)" if r["recommended"] else ""),
              "balance": str(r["balance"]),
              "of_ideal": r["speedup"] / r["ideal"] if r.get("ideal") else None} for r in rows]
    return common.markdown_table(cols, shown)


def main(argv):
    from absl import flags  # pylint: disable=import-outside-toplevel
    f = flags.FLAGS
    info, start = common.begin(argv)
    sizes = speedup.model_sizes(f)
    sizes.setdefault("heads", speedup.TRANSFORMER["heads"])  # predict takes them for either
    sizes.setdefault("seq_len", speedup.TRANSFORMER["seq_len"])
    timing = {"warmup": f.warmup, "repeats": f.repeats, "steps": f.steps}
    rows, summary, planned = run(
        f.devices, f.plan_microbatches, [int(m) for m in f.microbatches], f.schedules,
        f.max_microbatches, sizes, timing)
    ratio = summary["recommended_vs_best"]
    caption = (f"{f.model} {sizes}, K={f.devices}: the recommendation's step / plain is "
               f"{common.fmt(ratio, 3)} of the best row's "
               f"({'within' if summary['within_10_percent'] else 'NOT within'} 10%); "
               f"prediction and measurement order {common.fmt(summary['pairs_agree'])} of "
               f"row pairs alike; the plan took {planned['plan_s']:.1f} s")
    common.finish(f.out, info, start, rows, caption, table(rows), model=sizes, timing=timing,
                  summary=summary, plan_s=planned["plan_s"],
                  recommended=planned["recommended"])


def _define_flags():
    from absl import flags  # pylint: disable=import-outside-toplevel
    flags.DEFINE_integer("devices", 2, "Pipeline devices K.", lower_bound=1)
    flags.DEFINE_integer("plan_microbatches", 4, "M of the configuration planned (the "
                         "recommendation tries every M dividing the batch).", lower_bound=1)
    flags.DEFINE_integer("max_microbatches", 16, "The largest M the recommendation tries.",
                         lower_bound=1)
    flags.DEFINE_list("microbatches", ["4", "8"], "The grid's micro-batch counts M.")
    flags.DEFINE_list("schedules", list(speedup.SCHEDULES), "The grid's schedules.")
    flags.DEFINE_enum("model", "mlp", speedup.MODELS, "The model (as benchmarks.speedup).")
    flags.DEFINE_integer("layers", None, "Dense layers or transformer blocks (default: "
                         "benchmarks.speedup's).", lower_bound=1)
    flags.DEFINE_integer("width", None, "Dense or transformer width.", lower_bound=1)
    flags.DEFINE_integer("batch", None, "Rows (sequences) per step.", lower_bound=1)
    flags.DEFINE_integer("heads", None, "Transformer attention heads.", lower_bound=1)
    flags.DEFINE_integer("seq_len", None, "Transformer tokens per sequence.", lower_bound=1)
    flags.DEFINE_integer("warmup", speedup.TIMING["warmup"], "Untimed calls per model.",
                         lower_bound=1)
    flags.DEFINE_integer("repeats", speedup.TIMING["repeats"], "Timed runs per model.",
                         lower_bound=1)
    flags.DEFINE_integer("steps", speedup.TIMING["steps"], "Steps per timed run.",
                         lower_bound=1)
    flags.DEFINE_string("out", str(common.RESULTS_DIR / "plan_check.json"), "JSON output.")
    common.positive_ints("microbatches")
    common.one_of("schedules", speedup.SCHEDULES)


if __name__ == "__main__":
    from absl import app as _app
    _define_flags()
    _app.run(main)
