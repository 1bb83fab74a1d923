"""Stored rows declared once, as typed records: each field is a column, with its Arrow type.

The rollout shard's schema (:data:`gndpo.storage.shards.ROLLOUTS`), the reference page of the shards
and ``gndpo sql``'s ``rollouts`` view come from :class:`RolloutRow`, and rollout writes its rows as
instances of it: a misspelled or missing column is a TypeError where the row is made, never a column
of nulls in a committed shard.
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


def arrow_schema(row: type) -> pa.Schema:
    """The Arrow schema of a row class: its fields in order, each with the Arrow type it declares."""
    hints = typing.get_type_hints(row, include_extras=True)
    return pa.schema([(f.name, typing.get_args(hints[f.name])[1]) for f in dataclasses.fields(row)])


def rows_table(rows: list, schema: pa.Schema) -> pa.Table:
    """``rows`` (instances of one row class) as a table of ``schema`` (its :func:`arrow_schema`)."""
    return pa.Table.from_pylist([vars(r) for r in rows], schema=schema)
