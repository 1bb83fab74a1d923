"""A score unit's shard: the columns it stores, the partial sums normalize aggregates, the metric sums.

Non-finite values are refused: a NaN here would silently poison the round's global statistics. The
metric sums (entropies, the sampler gap) are taken over the values as computed; then the stored
columns are rounded to ``score.dtype``, and everything derived from them (each row's partial sums of
the clamped score c_t, normalize's token statistics, train's old log-probs) sees the stored values.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from gndpo.errors import GndpoError
from gndpo.pipeline.methods import clamped_score, score_needs, score_partial_sums
from gndpo.pipeline.methods.base import STUDENT_ENTROPY, TEACHER_ENTROPY
from gndpo.pipeline.settings.schema import Config
from gndpo.stages.scoring.forward import Scored, UnitRows
from gndpo.storage.shards import flat_values, list_column, round_to_bfloat16, scores_schema


def refuse_non_finite(per_token: dict[str, np.ndarray], rows: UnitRows, round_idx: int) -> None:
    """Raise naming the first rollout with a NaN or an infinity in a float column."""
    for name, values in per_token.items():
        if values.dtype.kind != "f":
            continue
        bad = ~np.isfinite(values.reshape(len(values), -1)).all(-1)
        if bad.any():
            row = int(np.searchsorted(rows.offsets, np.argmax(bad), side="right") - 1)
            rid = rows.table.column("rollout_id")[row].as_py()
            raise GndpoError(f"non-finite {name} for rollout {rid} in round {round_idx}; refusing to score")


def score_shard(rows: UnitRows, scored: Scored, cfg: Config, student_from_engine: bool = False) -> tuple[pa.Table, dict]:
    """(the unit's score table, its commit counts: the metric sums and the token counts);
    ``student_from_engine``: the student's log-probs are the rollout engine's (score.student_logprobs)."""
    per_token, aligned = dict(scored.per_token), scored.aligned
    student_mask, _ = flat_values(rows.table.column("loss_mask"))
    # vLLM's sampler log-probs are of the raw distribution: comparable with ours at temperature 1 only
    # (and no comparison at all where they are the student's log-probs).
    sampler = rows.sampler_logprobs if rows.temperature == 1.0 and not student_from_engine else None
    counts = token_metric_sums(per_token, sampler, student_mask > 0)
    per_token = stored_columns(per_token, score_needs(cfg.method), cfg.score.dtype)
    c = clamped_score(per_token["teacher_logprobs"], per_token["student_logprobs"], cfg.method.clamp)
    mask = student_mask
    if aligned is not None:  # unaligned student tokens count nowhere
        mask = mask * aligned
        per_token["aligned"] = aligned
    offsets = rows.offsets
    partial = [score_partial_sums(c[offsets[i] : offsets[i + 1]], mask[offsets[i] : offsets[i + 1]].astype(np.float64)) for i in range(rows.n)]
    table = score_table(rows, per_token, scored.labels, partial, cfg.score.teacher_topk)
    counts["tokens"] = int(sum(p["n_valid"] for p in partial))
    counts["student_from_engine"] = int(student_from_engine)
    if aligned is not None:
        # Among the tokens the student sampled: tool turns are masked out, not unaligned.
        counts["unaligned_tokens"] = int(((aligned == 0) & (student_mask > 0)).sum())
        counts["split_span_tokens"] = int((scored.split * student_mask * aligned > 0).sum())
    return table, counts


def stored_columns(per_token: dict[str, np.ndarray], needs, dtype: str) -> dict[str, np.ndarray]:
    """The columns the shard stores: the entropies only for the methods that use them (the round's
    metrics may have needed them alone), each float32 column rounded to bf16 with ``score.dtype:
    bfloat16``. The teacher's rest log-prob stays float32: it is kept because it is exact where the
    top-k values cannot give it (a rest of 1e-9 next to bf16 top-k mass is all rounding)."""
    per_token = {k: v for k, v in per_token.items() if k not in (TEACHER_ENTROPY, STUDENT_ENTROPY) or k in needs}
    if dtype == "bfloat16":
        per_token = {k: round_to_bfloat16(v) if v.dtype == np.float32 and k != "teacher_rest_logprob" else v for k, v in per_token.items()}
    return per_token


def score_table(rows: UnitRows, per_token: dict[str, np.ndarray], labels: list[str], partial: list[dict], topk: int) -> pa.Table:
    """The shard's rows: the ids, the teacher per row, every stored per-token column as one list per
    row (typed nulls for those this run does not store) and each row's partial sums. The top-k width
    is the stored columns' (``topk``, score.teacher_topk, where there are none)."""
    k = per_token["teacher_topk_ids"].shape[1] if "teacher_topk_ids" in per_token else topk
    schema = scores_schema(k)
    columns = {
        "rollout_id": rows.table.column("rollout_id"),
        "prompt_id": rows.table.column("prompt_id"),
        "teacher": pa.array(labels, pa.string()),
    }
    for name in schema.names:
        if name in columns:
            continue
        typ = schema.field(name).type
        if name in per_token:
            columns[name] = list_column(per_token[name], rows.lengths, typ)
        elif pa.types.is_list(typ):
            columns[name] = pa.nulls(rows.n, typ)
        else:
            columns[name] = pa.array([p[name] for p in partial], typ)
    return pa.table(columns, schema=schema)


def token_metric_sums(per_token: dict, sampler_logprobs: np.ndarray | None, student_tokens: np.ndarray) -> dict:
    """A unit's sums behind the round's score metrics, over the tokens the student sampled: both models'
    entropies (where computed) and, given the sampler's log-probs, |student log-prob recomputed here -
    the sampler's|, the gap between the rollout engine's and the training forward's numbers for the
    same policy."""
    sums = {"student_tokens": int(student_tokens.sum())}
    if sampler_logprobs is not None:
        diff = np.abs(per_token["student_logprobs"][student_tokens].astype(np.float64) - sampler_logprobs[student_tokens])
        sums.update({"logprob_diff_max": float(diff.max(initial=0.0)), "logprob_diff_sum": float(diff.sum())})
    for name in (STUDENT_ENTROPY, TEACHER_ENTROPY):
        if name in per_token:
            sums[f"{name}_sum"] = float(per_token[name][student_tokens].astype(np.float64).sum())
    return sums
