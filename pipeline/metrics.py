"""The run's metrics: every committed manifest's metrics, one line per round and stage.

Manifests are the source of truth; ``metrics.jsonl`` is rebuilt from them after each stage (appending
is not atomic on object stores, rebuilding is idempotent).
"""

from __future__ import annotations

import json

from gndpo.storage.records import STAGES


def committed_rounds(run) -> int:
    """How many rounds have at least one committed stage."""
    r = 0
    while any(run.records(r, s).manifest() is not None for s in STAGES):
        r += 1
    return r


def collect_metrics(run) -> list[dict]:
    rows = []
    for r in range(committed_rounds(run)):
        for stage in STAGES:
            m = run.records(r, stage).manifest()
            if m is not None:
                rows.append({"round": r, "stage": stage, **m["metrics"]})
    return rows


def write_metrics_jsonl(run) -> None:
    lines = "".join(json.dumps(row, sort_keys=True) + "\n" for row in collect_metrics(run))
    run.fs.write_new("metrics.jsonl", lines.encode())
