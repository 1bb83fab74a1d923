"""Stored rows declared once, as typed records: each field is a column, with its Arrow type.

Each shard's schema (:mod:`gndpo.storage.shards`), its reference page and ``gndpo sql``'s view come from
its row class (:class:`RolloutRow`, :class:`ScoreRow`, :class:`StatRow`). Rollout and normalize write
their rows as instances of it: a misspelled or missing column is a TypeError where the row is made,
never a column of nulls in a committed shard. Score builds its columns whole, by the same names.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Annotated

import pyarrow as pa

TOOL_CALL = pa.struct([("turn", pa.int32()), ("name", pa.string()), ("arguments", pa.string()), ("ok", pa.bool_()), ("result", pa.string())])


@dataclass(frozen=True)
class RolloutRow:
    """One sampled response, as rollout stores it."""

    rollout_id: Annotated[str, pa.string()]
    prompt_id: Annotated[str, pa.string()]
    sample_idx: Annotated[int, pa.int32()]
    round: Annotated[int, pa.int32()]
    policy_version: Annotated[int, pa.int32()]
    prompt_token_ids: Annotated[list[int], pa.list_(pa.int32())]
    response_token_ids: Annotated[list[int], pa.list_(pa.int32())]
    # 1 = a token the student generated and is trained on; 0 = tool turns, the template's tokens
    # around them, or a teacher prefix.
    loss_mask: Annotated[list[int], pa.list_(pa.int8())]
    # Off-policy guidance: the first teacher_prefix_len response tokens were written by the teacher.
    teacher_prefix_len: Annotated[int, pa.int32()]
    sampler_logprobs: Annotated[list[float], pa.list_(pa.float32())]
    finish_reason: Annotated[str, pa.string()]  # stop | length | max_turns (a tool call in the last allowed turn)
    # Multi-turn tool use: student turns, and each tool call as the student wrote it (arguments as
    # JSON, empty when the call could not be read), whether it succeeded and what the tool answered.
    num_turns: Annotated[int, pa.int32()]
    tool_calls: Annotated[list[dict], pa.list_(TOOL_CALL)]
    reward: Annotated[float | None, pa.float64()]
    rewards: Annotated[dict[str, float], pa.map_(pa.string(), pa.float64())]
    temperature: Annotated[float, pa.float32()]
    top_p: Annotated[float, pa.float32()]
    top_k: Annotated[int, pa.int32()]
    max_tokens: Annotated[int, pa.int32()]
    seed: Annotated[int, pa.int64()]
    # vLLM returns log-probs of the raw distribution unless told otherwise; recorded per row so
    # importance ratios are never silently computed against a truncated distribution.
    logprobs_mode: Annotated[str, pa.string()]
    prompt: Annotated[str, pa.string()]
    response: Annotated[str, pa.string()]


@dataclass(frozen=True)
class ScoreRow:
    """The teacher's and the student's numbers for one response, as score stores them (its writer
    builds the columns whole; ``k`` of the top-k is the shard's, min(score.teacher_topk, vocabulary))."""

    rollout_id: Annotated[str, pa.string()]
    prompt_id: Annotated[str, pa.string()]
    teacher_logprobs: Annotated[list[float], pa.list_(pa.float32())]
    student_logprobs: Annotated[list[float], pa.list_(pa.float32())]
    # Per-row partial sums of the clamped score c_t = clamp(lpT - lpS) over valid tokens, so the
    # normalize stage's cost grows with responses, not tokens. Float64 to keep the variance exact.
    n_valid: Annotated[int, pa.int64()]
    c_sum: Annotated[float, pa.float64()]
    c_sq_sum: Annotated[float, pa.float64()]
    c_min: Annotated[float, pa.float64()]
    c_max: Annotated[float, pa.float64()]
    teacher: Annotated[str, pa.string()]
    # Written only when the run's method needs them (null otherwise), per token of the response:
    # the teacher's top-k ids and full-softmax log-probs (k = score.teacher_topk), teacher and
    # student entropies in nats, and the full-vocabulary KL(p_S || p_T).
    # Top-k as fixed-size lists: one flat buffer per column that readers view as [tokens, k].
    teacher_topk_ids: Annotated[list[list[int]] | None, pa.list_(pa.list_(pa.int32(), 16))]
    teacher_topk_logprobs: Annotated[list[list[float]] | None, pa.list_(pa.list_(pa.float32(), 16))]
    # With the top-k: log of the teacher's mass outside its top-k ids (the "rest" bucket), from the
    # full softmax (a logsumexp over the other ids), never 1 - sum(p), which is rounding noise for a
    # confident teacher; float32 even under score.dtype bfloat16. Shards written before it have no
    # such column: train then recomputes the rest from the top-k, as it used to.
    teacher_rest_logprob: Annotated[list[float] | None, pa.list_(pa.float32())]
    teacher_entropy: Annotated[list[float] | None, pa.list_(pa.float32())]
    student_entropy: Annotated[list[float] | None, pa.list_(pa.float32())]
    token_kl: Annotated[list[float] | None, pa.list_(pa.float32())]
    # score.cross_tokenizer: 1 where the student token's teacher log-prob came from teacher tokens
    # covering exactly its characters; 0 where it did not align (no signal there). Null otherwise.
    aligned: Annotated[list[int] | None, pa.list_(pa.int8())]


@dataclass(frozen=True)
class StatRow:
    """One statistic of a round, as normalize stores them (long format)."""

    round: Annotated[int, pa.int32()]
    scope: Annotated[str, pa.string()]  # "global" or a group key such as a prompt_id
    name: Annotated[str, pa.string()]
    value: Annotated[float, pa.float64()]


def arrow_schema(row: type) -> pa.Schema:
    """The Arrow schema of a row class: its fields in order, each with the Arrow type it declares."""
    hints = typing.get_type_hints(row, include_extras=True)
    return pa.schema([(f.name, typing.get_args(hints[f.name])[1]) for f in dataclasses.fields(row)])


def rows_table(rows: list, schema: pa.Schema) -> pa.Table:
    """``rows`` (instances of one row class) as a table of ``schema`` (its :func:`arrow_schema`)."""
    return pa.Table.from_pylist([vars(r) for r in rows], schema=schema)
