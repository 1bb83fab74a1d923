"""A round's committed statistics, as normalize wrote them and train and the tests read them.

Normalize stores them as one long-format shard (round, scope, name, value; :data:`gndpo.storage.shards.STATS`)
whose commit record is in its manifest; scope "global", a prompt_id for group statistics, or
``teacher:<name>`` for one teacher's tokens. Reading them needs only the committed product, so it sits
here, below every stage, and no stage imports another to get them.
"""

from __future__ import annotations

from gndpo.pipeline.methods.base import Stats
from gndpo.pipeline.run.products import STATISTICS, StatsNumbers
from gndpo.pipeline.run.run import Run
from gndpo.storage.products import Manifest
from gndpo.storage.runfs import RunFS
from gndpo.storage.shards import read_shards


def statistics(fs: RunFS, manifest: Manifest[StatsNumbers]) -> Stats:
    """The statistics (global and per scope) a committed normalize stage wrote, read from its shard."""
    stats = Stats()
    for r in read_shards(fs, manifest.files()).to_pylist():
        target = stats.round_wide if r["scope"] == "global" else stats.groups.setdefault(r["scope"], {})
        target[r["name"]] = r["value"]
    return stats


def round_stats(run: Run, round_idx: int) -> Stats:
    """The committed statistics of round ``round_idx``."""
    return statistics(run.fs, run.records(round_idx, STATISTICS).require_manifest())
