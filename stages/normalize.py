"""Normalize: the round's batch statistics, computed by DuckDB over the committed score shards.

Always: the token count, mean and unbiased std of the clamped score c_t over ALL valid tokens of the
round (every worker's shards, hence global across data-parallel ranks of train), from the per-response
partial sums written by score, so that cost grows with responses, not tokens; plus reward, length and
KL figures for the logs. Then whatever the run's method asks for (gndpo.pipeline.methods): quantiles,
min/max, group statistics per prompt, ... as DuckDB queries over two views, ``responses`` (rollouts
joined with scores) and ``tokens`` (one row per valid token). The result is a small long-format table
(round, scope, name, value): scope "global", or a prompt_id for group statistics; train reads it back
with :func:`gndpo.pipeline.run.stats.round_stats`.
"""

from __future__ import annotations

from gndpo.pipeline.exec.inputs import Read
from gndpo.pipeline.exec.stage import StageJob
from gndpo.pipeline.methods import StatsQuery, gndpo_stats_from_sums, method_statistics, score_needs
from gndpo.pipeline.methods.base import TEACHER_SCOPE
from gndpo.pipeline.run.products import ROLLOUTS, SCORES, STATISTICS, StatsNumbers
from gndpo.pipeline.settings.schema import Config
from gndpo.storage.duck import connect, parquet_source
from gndpo.storage.products import Commit, Unit
from gndpo.storage.rows import StatRow, rows_table
from gndpo.storage.shards import STATS, verify_shards, write_shard


class NormalizeJob(StageJob):
    """The normalize stage: one unit that computes the round's statistics with DuckDB over the
    committed score shards (what the run's method asks for) and writes them as one shard. It needs no
    model: DuckDB opens per unit."""

    makes = STATISTICS
    reads = (Read(ROLLOUTS), Read(SCORES))

    def plan(self):
        """One unit, "stats", reading the committed score and rollout manifests."""
        scores, rollouts = self.inputs.manifest(SCORES), self.inputs.manifest(ROLLOUTS)
        inputs = {"score_manifest_finished_at": scores.finished_at, "rollout_manifest_finished_at": rollouts.finished_at}
        return [Unit("stats")], inputs

    def run_unit(self, unit, out_dir):
        """The round's statistics: the score moments every method gets, the logged figures, then what
        the run's method asks for (global and per scope), written as one long-format shard."""
        fs = self.run.fs
        score_files, rollout_files = self.inputs.files(SCORES), self.inputs.files(ROLLOUTS)
        # DuckDB reads the files directly; check them against their commit records first.
        verify_shards(fs, score_files + rollout_files)
        con = connect(fs, threads=1)  # statistics with the same bits on every rerun
        all_rollouts = parquet_source(fs, rollout_files)
        rollouts, scores = create_views(con, all_rollouts, parquet_source(fs, score_files), self.cfg)

        stats = score_moments(con, scores)
        stats.update(rollout_figures(con, all_rollouts))
        method_stats, groups = method_statistics(StatsQuery(con), self.cfg.method, self.round)
        stats.update(method_stats)
        if self.cfg.method.stats_scope == "teacher":  # GNDPO's moments over each teacher's tokens too
            groups.update(teacher_moments(con, scores))

        record = write_shard(fs, f"{out_dir}/stats.parquet", rows_table(stats_rows(self.round, stats, groups), STATS))
        summary = {k: (float(v) if v is not None else None) for k, v in stats.items()}
        return [record], StatsNumbers(stats=summary, groups=len(groups))

    def summarize(self, commits: list[Commit[StatsNumbers]]) -> dict:
        """The manifest's metrics: the round's statistics and the unit's speed."""
        (unit,) = commits
        seconds, stats = unit.numbers.seconds, unit.numbers.stats
        return {**stats, "seconds": seconds, "tokens_per_s": (stats["token_count"] or 0) / max(seconds, 1e-9)}


def create_views(con, rollouts: str, scores: str, cfg: Config) -> tuple[str, str]:
    """The two views every method's SQL reads: ``responses`` (rollouts joined with their scores, one
    row per response) and ``tokens`` (one row per valid token); returns the (rollouts, scores)
    sources the statistics use, which leave out truncated responses where ``rollout.truncated`` is
    drop."""
    if cfg.rollout.truncated == "drop":
        # Responses cut at max_tokens stay out of every statistic (and out of train).
        con.sql(f"CREATE VIEW kept_rollouts AS SELECT * FROM {rollouts} WHERE finish_reason IS DISTINCT FROM 'length'")
        con.sql(f"CREATE VIEW kept_scores AS SELECT s.* FROM {scores} s SEMI JOIN kept_rollouts USING (rollout_id)")
        rollouts, scores = "kept_rollouts", "kept_scores"
    con.sql(
        f"""CREATE VIEW responses AS
            SELECT r.rollout_id, r.prompt_id, r.reward, r.rewards, s.n_valid, s.c_sum, s.c_sq_sum
            FROM {rollouts} r JOIN {scores} s USING (rollout_id)"""
    )
    # Per-token columns score stored for this method are unnested; the others are typed NULLs, so
    # every method's SQL sees the same view without paying for lists that are all null.
    stored = score_needs(cfg.method)
    extras = ", ".join(
        f"unnest(s.{column}) AS {alias}" if column in stored else f"NULL::FLOAT AS {alias}"
        for column, alias in (("teacher_entropy", "hT"), ("student_entropy", "hS"), ("token_kl", "kl"))
    )
    # A cross-tokenizer teacher's unaligned tokens are out, like tool and prompt tokens.
    mask = ("unnest(list_transform(list_zip(r.loss_mask, s.aligned), lambda x: x[1] * x[2]))" if cfg.score.cross_tokenizer
            else "unnest(r.loss_mask)")
    con.sql(
        f"""CREATE VIEW tokens AS
            SELECT * EXCLUDE (m) FROM (
                SELECT r.rollout_id, r.prompt_id, unnest(range(len(r.loss_mask))) AS t, {mask} AS m,
                       unnest(s.teacher_logprobs) AS lpT, unnest(s.student_logprobs) AS lpS, {extras}
                FROM {rollouts} r JOIN {scores} s USING (rollout_id))
            WHERE m = 1"""
    )
    return rollouts, scores


def score_moments(con, scores: str) -> dict:
    """Count, mean and unbiased std of the clamped score c over every valid token, from score's
    per-response partial sums (cost grows with responses, not tokens), its range, the response count,
    and the round's distillation gap: E[c] = -KL(pi_S || pi_T) (k1 estimator, clamped)."""
    n, c_sum, c_sq, c_min, c_max, responses = con.execute(
        f"SELECT sum(n_valid), sum(c_sum), sum(c_sq_sum), min(c_min), max(c_max), count(*) FROM {scores}"
    ).fetchall()[0]
    stats = gndpo_stats_from_sums(n or 0, c_sum or 0.0, c_sq or 0.0)
    stats.update({"c_min": c_min, "c_max": c_max, "responses": responses})
    stats["reverse_kl_estimate"] = -stats["c_mean"]
    return stats


def rollout_figures(con, rollouts: str) -> dict:
    """Reward, response length and the share cut at max_tokens, for the logs: over every response,
    dropped ones included (how often max_tokens cuts a response)."""
    reward_mean, len_mean, len_max, truncated = con.execute(
        f"SELECT avg(reward), avg(len(response_token_ids)), max(len(response_token_ids)), avg((finish_reason = 'length')::INT) FROM {rollouts}"
    ).fetchall()[0]
    return {"reward_mean": reward_mean, "response_length_mean": len_mean, "response_length_max": len_max, "truncated_fraction": truncated}


def teacher_moments(con, scores: str) -> dict[str, dict]:
    """{teacher scope: score moments over that teacher's tokens}, for ``method.stats_scope: teacher``."""
    rows = con.execute(f"SELECT teacher, sum(n_valid), sum(c_sum), sum(c_sq_sum) FROM {scores} GROUP BY teacher ORDER BY teacher").fetchall()
    return {f"{TEACHER_SCOPE}{teacher}": gndpo_stats_from_sums(n or 0, c_sum or 0.0, c_sq or 0.0) for teacher, n, c_sum, c_sq in rows}


def stats_rows(round_idx: int, stats: dict, groups: dict[str, dict]) -> list[StatRow]:
    """The long-format rows (round, scope, name, value) of the global statistics and each scope's;
    a statistic that is None (no tokens to compute it over) is left out."""
    rows = [StatRow(round_idx, "global", k, float(v)) for k, v in sorted(stats.items()) if v is not None]
    rows += [StatRow(round_idx, scope, k, float(v)) for scope, values in sorted(groups.items()) for k, v in sorted(values.items()) if v is not None]
    return rows
