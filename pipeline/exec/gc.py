"""`gndpo gc`: remove attempt folders that no commit record references.

An attempt folder is garbage when its unit is committed by another attempt, or when its lease is
stale and it never committed (a crashed worker's partial output). Folders of live leases are kept:
their worker may still commit them.
"""

from __future__ import annotations

import time

from gndpo.pipeline.observe.metrics import committed_rounds
from gndpo.pipeline.exec.units import lease_state
from gndpo.storage.records import STAGES


def collect_garbage(run, dry_run: bool = False) -> list[str]:
    """Remove (or, with ``dry_run``, only list) unreferenced attempt folders; returns their paths."""
    removed, now = [], time.time()
    for r in range(committed_rounds(run) + 1):
        for stage in STAGES:
            rec = run.records(r, stage)
            for unit in run.fs.listdir(f"{rec.prefix}/data"):
                done = rec.done(unit)
                for name in run.fs.listdir(f"{rec.prefix}/data/{unit}"):
                    attempt = int(name[1:]) if name.startswith("a") and name[1:].isdigit() else None
                    if attempt is None:
                        continue
                    if done is not None:
                        garbage = done["attempt"] != attempt
                    else:
                        garbage = attempt != max(rec.attempts(unit), default=0) or lease_state(rec, unit, now) == "stale"
                    if garbage:
                        path = rec.attempt_dir(unit, attempt)
                        removed.append(path)
                        if not dry_run:
                            run.fs.rm(path)
    return removed
