"""Where a run continues from: the checkpoint `--resume` takes, and the one a
diverged run names. Both read the checkpoints and the history only."""

import sys

from launch import checkpoints
from launch import history as history_lib
from launch.errors import RunError

# Run settings that change how the same model is computed (the stage layout,
# the micro-batches, their order): --reshard may change them; the result
# then matches the new settings, not bit for bit the old.
LAYOUT_SETTINGS = ("stages", "microbatches", "schedule", "execution", "recompute")


def warn(message):
    print(f"launch.train: warning: {message}", file=sys.stderr, flush=True)


def resume_point(store, run, model_dir, reshard=False):
    """What `--resume` restores: (step, manifest) or (None, None); prints what it skips.

    Raises:
      RunError: checkpoint files exist but none is intact (nothing is changed),
        or the intact one belongs to a run with other settings.
    """
    found = store.find()
    for note in found.notes:
        warn(note)
    if found.step is None:
        if found.any_files:
            reasons = "; ".join(f"{name}: {why}" for name, why in found.skipped)
            raise RunError(
                f"--resume: no checkpoint in {store.dir} is intact, so there is nothing "
                f"to resume from ({reasons}). Nothing was changed. Start afresh with "
                f"--overwrite instead of --resume, or pass another --model_dir.")
        for name, why in found.skipped:  # a state file naming checkpoints now gone
            warn(f"skipped {name}: {why}.")
        print(f"--resume: no checkpoint in {store.dir}; starting from step 0.")
        return None, None
    recorded = history_lib.RunHistory.from_json(model_dir / history_lib.HISTORY_FILE,
                                                found.manifest["history"])
    diff = recorded.mismatches(run)
    if reshard:  # the layout may change; what fixes the variables and data may not
        diff = {k: v for k, v in diff.items() if k not in LAYOUT_SETTINGS}
    if diff:
        layout = [k for k in diff if k in LAYOUT_SETTINGS]
        raise RunError(
            f"--resume: {model_dir} holds a run with other settings "
            f"({'; '.join(f'{k}: {a!r} then, {b!r} now' for k, (a, b) in diff.items())}"
            f"). Use the same settings"
            + (f" (or add --reshard to continue at the new {', '.join(layout)}: the run "
               f"then follows them from here)" if layout and len(layout) == len(diff) else "")
            + ", or another --model_dir without --resume.")
    for name, why in found.skipped:
        warn(f"skipped {name}: {why}.")
    aside = [name for name, _ in found.skipped
             if int(name.split("-")[1]) in store.files_by_step()]
    if aside and store.record is not None:  # not another process's (a cluster's chief's)
        store.set_aside(aside)
        warn(f"moved the files of {', '.join(aside)} to "
              f"{store.dir / checkpoints.SKIPPED_DIR}.")
    return found.step, found.manifest


def divergence_advice(store, checkpointer, history, step):
    """Where to restart a run that diverged at `step`, and at which rate: the
    newest checkpoint from before the loss climbed (`Checkpointer.restart_point`;
    the newer ones, whose weights already led to the failure, are set aside so
    that --resume takes it), at the rate that trained it or a tenth of the
    rate that failed, whichever is lower; or, with no such checkpoint, a fresh
    start at a tenth of the rate."""
    failed = history.learning_rate(step)
    best = checkpointer.restart_point()
    newer = [s for s in store.committed_steps() if best is None or s > best[0]]
    if newer:
        store.set_aside([f"ckpt-{s}" for s in newer])
    names = ", ".join(f"ckpt-{s}" for s in newer)
    aside = (f" The {len(newer)} checkpoint(s) saved {'after it' if best else 'in the run'} "
             f"({names}), whose weights led there, were set aside in "
             f"{store.dir / checkpoints.SKIPPED_DIR}." if newer else "")
    if best is None:
        return (f"No checkpoint from before the loss climbed is left (the next step after each "
                f"one saved was already non-finite, or none was saved).{aside} Start again with "
                f"a lower learning rate: --overwrite --learning_rate={failed / 10:g}.")
    k, loss = best
    lower = min(failed / 10, history.learning_rate(k))
    return (f"The newest checkpoint from before the loss climbed is {store.path(k)} (the "
            f"loss was {loss:.4g} at step {k + 1}); --resume continues from it.{aside} "
            f"Resume with a lower learning rate than the {failed:g} that failed: --resume "
            f"--learning_rate={lower:g}.")
