"""What `gndpo status` shows: per round and stage, its state (committed, running, stopped), units planned /
claimed / done / stale, rows, tokens, time and throughput, read from plans, claims, commit records and
manifests."""

from __future__ import annotations

import time

from gndpo.pipeline.observe.metrics import committed_rounds
from gndpo.pipeline.exec.units import lease_state
from gndpo.storage.records import STAGES


def stage_state(committed: bool, leases: list[str | None]) -> str:
    """committed; running (a live worker holds a unit); or stopped: planned, nobody working on it now
    (stopped by a signal, crashed, or between workers), resumed by rerunning the stage."""
    if committed:
        return "committed"
    return "running" if "claimed" in leases else "stopped"


def stage_rows(run) -> list[dict]:
    rows, now = [], time.time()
    for r in range(committed_rounds(run) + 1):
        for stage in STAGES:
            rec = run.records(r, stage)
            plan = rec.plan()
            if plan is None:
                continue
            units = [u["unit"] for u in plan["units"]]
            done = rec.done_units()
            leases = [lease_state(rec, u, now) for u in units if u not in done]
            commits = [rec.done(u) for u in units if u in done]
            tokens = sum(c.get("tokens", 0) for c in commits)
            seconds = sum(c.get("seconds", 0.0) for c in commits)
            rows.append(
                {
                    "round": r,
                    "stage": stage,
                    "state": stage_state(rec.manifest() is not None, leases),
                    "planned": len(units),
                    "claimed": leases.count("claimed"),
                    "stale": leases.count("stale"),
                    "done": len(done & set(units)),
                    "rows": sum(c["rows"] for c in commits),
                    "tokens": tokens,
                    "seconds": round(seconds, 1),
                    "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
                }
            )
    return rows
