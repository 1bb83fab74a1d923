"""A round's committed statistics, as normalize wrote them and train and the tests read them.

Normalize stores them as one long-format shard (round, scope, name, value; :data:`gndpo.storage.shards.STATS`)
whose commit record is in its manifest; scope "global", a prompt_id for group statistics, or
``teacher:<name>`` for one teacher's tokens. Reading them needs only the run's records, so it sits
here, below every stage, and no stage imports another to get them.
"""

from __future__ import annotations

from gndpo.pipeline.methods.base import Stats
from gndpo.pipeline.run.run import Run
from gndpo.storage.shards import read_shards


def round_stats(run: Run, round_idx: int) -> Stats:
    """The committed statistics of a round (global and per prompt), read from its stats shard."""
    table = read_shards(run.fs, run.records(round_idx, "normalize").require_manifest().files())
    stats = Stats()
    for r in table.to_pylist():
        target = stats.round_wide if r["scope"] == "global" else stats.groups.setdefault(r["scope"], {})
        target[r["name"]] = r["value"]
    return stats
