"""Normalize: the round's batch statistics, computed by DuckDB over the committed score shards.

GNDPO needs the token count, mean and unbiased std of the clamped score c_t over ALL valid tokens of the
round (every worker's shards, hence global across data-parallel ranks of train). DuckDB sums the
per-response partial sums written by score (n_valid, sum c, sum c^2), so the cost grows with responses,
not tokens. The result is a small long-format table (round, scope, name, value) plus the manifests it
was computed from, recorded in the stage's manifest.
"""

from __future__ import annotations

import pyarrow as pa

from gndpo.pipeline.methods import get_method, gndpo_stats_from_sums
from gndpo.pipeline.runs import Run
from gndpo.stages.rollout import rollout_shards
from gndpo.storage.duck import connect, parquet_source
from gndpo.storage.records import manifest_files
from gndpo.storage.shards import STATS, read_shards, verify_shards, write_shard


class NormalizeJob:
    stage = "normalize"

    def __init__(self, run: Run, round_idx: int, log=print):
        self.run, self.round, self.cfg, self.log = run, round_idx, run.cfg, log

    def plan(self):
        scores = self.run.records(self.round, "score").require_manifest()
        rollouts = self.run.records(self.round, "rollout").require_manifest()
        inputs = {"score_manifest_finished_at": scores["finished_at"], "rollout_manifest_finished_at": rollouts["finished_at"]}
        return [{"unit": "stats"}], inputs

    def setup(self):
        pass

    def run_unit(self, unit, out_dir):
        fs = self.run.fs
        score_files = manifest_files(self.run.records(self.round, "score").require_manifest())
        rollout_files = rollout_shards(self.run.records(self.round, "rollout").require_manifest())
        # DuckDB reads the files directly; check them against their commit records first.
        verify_shards(fs, score_files + rollout_files)
        con = connect(fs)
        n, c_sum, c_sq, c_min, c_max, responses = con.execute(
            f"SELECT sum(n_valid), sum(c_sum), sum(c_sq_sum), min(c_min), max(c_max), count(*) FROM {parquet_source(fs, score_files)}"
        ).fetchone()
        stats = gndpo_stats_from_sums(n or 0, c_sum or 0.0, c_sq or 0.0)
        stats.update({"c_min": c_min, "c_max": c_max, "responses": responses})
        reward_mean, len_mean, truncated = con.execute(
            f"SELECT avg(reward), avg(len(response_token_ids)), avg((finish_reason = 'length')::INT) "
            f"FROM {parquet_source(fs, rollout_files)}"
        ).fetchone()
        stats.update({"reward_mean": reward_mean, "response_length_mean": len_mean, "truncated_fraction": truncated})
        # E[c] = -KL(pi_S || pi_T) (k1 estimator, clamped): logged as the round's distillation gap.
        stats["reverse_kl_estimate"] = -stats["c_mean"]
        get_method(self.cfg.method.name)  # fail here, not in train, on an unknown method
        table = pa.Table.from_pylist(
            [{"round": self.round, "scope": "global", "name": k, "value": float(v)} for k, v in sorted(stats.items()) if v is not None],
            schema=STATS,
        )
        record = write_shard(fs, f"{out_dir}/stats.parquet", table)
        return [record], {"stats": {k: (float(v) if v is not None else None) for k, v in stats.items()}}

    def summarize(self, commits):
        return dict(commits[0]["stats"])


def global_stats(run: Run, round_idx: int) -> dict:
    """The committed global statistics of a round as {name: value}, read from its stats shard."""
    table = read_shards(run.fs, manifest_files(run.records(round_idx, "normalize").require_manifest()))
    return {r["name"]: r["value"] for r in table.to_pylist() if r["scope"] == "global"}
