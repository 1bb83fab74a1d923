"""`gndpo gc`: remove attempt folders that no commit record references, and on request old rounds'
policies and optimizer state.

An attempt folder is garbage when its unit is committed by another attempt, or when its lease is
stale and it never committed (a crashed worker's partial output). Folders of live leases are kept:
their worker may still commit them. A committed attempt's checkpoint folder is garbage too: train's
in-round engine states (every ``train.checkpoint_every`` steps, each the size of the model and its
optimizer state) exist to resume an uncommitted round, and no commit references them.

Every round's train stage exports the student (and its EMA, with ``self_teacher.weights: ema``) and,
with ``train.carry_optimizer_state``, the optimizer state: at 135M parameters about 2 GB a round, most
of it the optimizer state. Resuming needs only the newest round's; rollouts, scores and metrics (what
``report`` and ``sql`` read) are small and always kept. :func:`prune_rounds` removes the exported
files of every trained round but the newest ``keep``, after marking each round pruned, so that
``eval``, ``fork`` and a resumed stage name what was removed instead of failing on a missing file.
"""

from __future__ import annotations

import time

from gndpo.errors import GndpoError
from gndpo.pipeline.exec.units import lease_state, working_dir
from gndpo.pipeline.observe.metrics import committed_rounds
from gndpo.pipeline.run.products import POLICY, CarriedState, TrainNumbers, carried_state
from gndpo.storage.products import Commit


def collect_garbage(run, dry_run: bool = False) -> list[str]:
    """Remove (or, with ``dry_run``, only list) unreferenced attempt folders; returns their paths."""
    removed, now = [], time.time()
    for r in range(committed_rounds(run) + 1):
        for stage in run.round_stages(r):
            rec = run.records(r, stage)
            for unit in run.fs.listdir(f"{rec.prefix}/data"):
                done = rec.done(unit)
                for name in run.fs.listdir(f"{rec.prefix}/data/{unit}"):
                    attempt = int(name[1:]) if name.startswith("a") and name[1:].isdigit() else None
                    if attempt is None:
                        continue
                    if done is not None:
                        garbage = done.attempt != attempt
                    else:
                        garbage = attempt != max(rec.attempts(unit), default=0) or lease_state(rec, unit, now) == "stale"
                    if garbage:
                        path = rec.attempt_dir(unit, attempt)  # listed just now: it exists
                    elif done is not None:  # a committed attempt's working folder (train's in-round checkpoints)
                        path = working_dir(rec, unit, attempt)
                        if not run.fs.exists(path):
                            continue
                    else:
                        continue
                    removed.append(path)
                    if not dry_run:
                        run.fs.rm(path)
    return removed


def check_keep_rounds(keep: int) -> None:
    if keep < 1:
        raise GndpoError("--keep-rounds must be at least 1: the next round trains from the newest round's policy")


def prune_rounds(run, keep: int, dry_run: bool = False) -> list[dict]:
    """Remove (or, with ``dry_run``, only list) the exported policy, EMA and optimizer state of every
    trained round but the newest ``keep`` (at least 1: the next round starts from the newest); returns
    one ``{"round", "folders", "bytes"}`` per round pruned, its sizes from the commit records. A round
    an earlier prune marked but did not finish (it was stopped) has what is left of it removed."""
    check_keep_rounds(keep)
    trained = [r for r in range(committed_rounds(run)) if run.records(r, POLICY).manifest() is not None]
    pruned = []
    for r in trained[:-keep]:
        rec = run.records(r, POLICY)
        if run.inherits(r, POLICY.stage):  # a fork never removes its parent's files
            continue
        update = rec.require_manifest().only()
        state = carried_state(rec)
        folders = exported_folders(update, state)
        marked = rec.pruned() is not None
        if marked:
            folders = [f for f in folders if run.fs.exists(f)]
            if not folders:
                continue
        files = update.files + [f for f in (state.file_records() if state else []) if f not in update.files]
        size = sum(f.bytes for f in files if any(f.under(d) for d in folders))
        pruned.append({"round": r, "folders": folders, "bytes": size})
        if not dry_run:
            if not marked:
                rec.mark_pruned({"folders": folders, "bytes": size, "pruned_at": time.time()})
            for folder in folders:
                run.fs.rm(folder)
    return pruned


def exported_folders(update: Commit[TrainNumbers], state: CarriedState | None) -> list[str]:
    """The run-relative folders a train commit exported: the model, its EMA, the optimizer ``state``
    (:func:`carried_state`; a deferred one's record with it, so that no record outlives its files)."""
    exported = update.numbers
    folders = [exported.model_dir, *([exported.ema_dir] if exported.ema_dir else [])]
    folders += sorted({f.path.rsplit("/", 1)[0] for f in (state.file_records() if state else [])})
    pending = exported.optimizer_state.pending if exported.optimizer_state else None
    return folders + ([pending] if state is not None and pending else [])
