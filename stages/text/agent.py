"""Conversations: the student's responses, one turn each, or interleaved with tool turns.

Rollout and eval both write responses through :func:`run_conversations`. Without tools a conversation is
one student turn, exactly the single ``generate`` call it always was. With tools (``rollout.tools``)
each student turn also stops at ``</tool_call>``; the first call of the turn is executed
(:func:`gndpo.pipeline.tasks.tools.run_tool_calls`: all calls of a turn at once, never raising), its result is rendered as a tool
turn through the chat template (:func:`gndpo.stages.text.chat.tool_turn_ids`) and appended, and the student
continues from the whole conversation so far. All conversations of a batch advance together, one
``generate`` per turn over the ones still open, so the sampler batches them (and vLLM's prefix cache
reuses each conversation's earlier turns).

A conversation is one token sequence after the prompt with a loss mask: 1 for tokens the student
sampled, 0 for tool turns and the template's tokens around them (and for a guided teacher prefix).
It ends when the student ends a turn without a call (``stop``), a turn hits ``rollout.max_tokens``
or the whole response hits the length budget (``length``), or the student calls a tool in its last
allowed turn (``max_turns``; the call is recorded, not executed). Each turn is sampled with its own
seed derived from the conversation's seed and the turn number, so a conversation is reproducible from
its seed whatever else shares the batch or the unit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from gndpo.faults import crash_point
from gndpo.pipeline.run.seeds import derived_seed
from gndpo.pipeline.settings.schema import DataConfig, RolloutConfig
from gndpo.pipeline.tasks.tools import Tool, ToolResult, get_tool, parse_tool_call, run_tool_calls
from gndpo.stages.models.sampling import SamplingRequest
from gndpo.stages.samplers.base import Sampler
from gndpo.stages.text.chat import tool_turn_ids
from gndpo.storage.rows import RolloutRow

CALL_END = "</tool_call>"


@dataclass(frozen=True)
class ToolUse:
    """What a multi-turn rollout may do: its tools by name, and its limits."""

    tools: dict[str, Tool]
    max_turns: int
    max_response_tokens: int
    timeout_s: float

    @classmethod
    def from_config(cls, rollout_cfg: RolloutConfig) -> "ToolUse | None":
        """The run's tool settings, or None for single-turn rollouts (no ``rollout.tools``). An entry is
        a built-in's name, ``module:function`` (called by that path) or ``name=module:function``
        (called by ``name``); a GndpoError (one line) for one that does not resolve."""
        if not rollout_cfg.tools:
            return None
        tools = {}
        for entry in rollout_cfg.tools:
            name, _, path = entry.rpartition("=") if "=" in entry else (entry, "", entry)
            tools[name.strip()] = get_tool(path.strip())
        return cls(tools, rollout_cfg.max_turns, rollout_cfg.max_tool_response_tokens, rollout_cfg.tool_timeout_s)


@dataclass
class Conversation:
    """One response being written: the prompt's row and ids, the response so far and its record."""

    row: dict
    prompt_ids: list[int]  # with images: unexpanded until the first turn, then as the model read them
    seed: int
    images: list = field(default_factory=list)  # the prompt's pictures (PIL), for vLLM
    # What every turn's request starts with: vLLM expands a picture's placeholder itself, so with
    # images it is given the unexpanded prompt (and the pictures) again on each turn.
    engine_prompt_ids: list[int] = field(init=False)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # each student turn's [start, end)
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = ""

    def __post_init__(self):
        self.engine_prompt_ids = list(self.prompt_ids)

    def add_prefix(self, ids: list[int], ended: bool) -> None:
        """Tokens the student did not sample that open its first turn (a guided teacher prefix);
        ``ended``: the prefix already closed the turn, so the conversation is complete."""
        self._append(ids, 0, [0.0] * len(ids))
        if ended:
            self.turn_spans.append((0, len(ids)))
            self.finish_reason = "stop"

    def _append(self, ids: list[int], mask: int, logprobs: list[float]) -> None:
        self.response_ids += ids
        self.loss_mask += [mask] * len(ids)
        self.sampler_logprobs += logprobs

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

    def turn_text(self, tok, turn: int) -> str:
        a, b = self.turn_spans[turn]
        return tok.decode(self.response_ids[a:b], skip_special_tokens=True)

    def turn_texts(self, tok) -> list[str]:
        return [self.turn_text(tok, t) for t in range(self.num_turns)]

    def student_text(self, tok) -> str:
        """What rewards read: the student's turns (a guided prefix included), joined by newlines; the
        tool turns are not part of it, so a tool's result never counts as the student's answer."""
        return "\n".join(self.turn_texts(tok))


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of a conversation's ``turn``: the conversation's own seed for the first."""
    return seed if turn == 0 else derived_seed(seed, "turn", turn)


def _called_tool(g) -> bool:
    return g.finish_reason == "stop" and g.stop_reason == CALL_END


def run_conversations(
    sampler: Sampler, tok, conversations: list[Conversation], data: DataConfig, tool_use: ToolUse | None, max_tokens: int,
    sampling: Callable[[int, int, list[str]], SamplingRequest], on_turn: Callable[[list[Conversation]], None] | None = None,
    on_finished: Callable[[int], None] | None = None,
) -> None:
    """Write every open conversation to its end, in place. ``max_tokens`` caps each student turn and,
    without tools, the whole response (a guided prefix included); ``sampling(seed, max_tokens,
    extra_stops)`` makes a turn's request (the caller's temperature and stops; ``extra_stops`` are the
    stop strings tool use adds, to be kept in the output).
    ``on_turn`` is called after each turn with the conversations that ended in it, ``on_finished(count)``
    as a turn's generations finish inside it (both for progress)."""
    budget = tool_use.max_response_tokens if tool_use else max_tokens
    turns = tool_use.max_turns if tool_use else 1
    extra_stops = [CALL_END] if tool_use else []
    for turn in range(turns):
        active = [c for c in conversations if not c.finish_reason]
        if not active:
            break
        # At least one token per request: a conversation with no room left was ended below.
        params = [sampling(turn_seed(c.seed, turn), max(min(max_tokens, budget - len(c.response_ids)), 1), extra_stops) for c in active]
        gens = sampler.generate([c.engine_prompt_ids + c.response_ids for c in active], params, on_finished, [c.images for c in active])
        calling = []
        for c, g in zip(active, gens):
            if c.images:  # score and train read the prompt as vLLM expanded it (the response so far follows it)
                c.prompt_ids = g.prompt_ids[: len(g.prompt_ids) - len(c.response_ids)]
            start = 0 if turn == 0 else len(c.response_ids)  # the first turn includes a guided prefix
            c._append(list(g.token_ids), 1, list(g.logprobs))
            c.turn_spans.append((start, len(c.response_ids)))
            if not (tool_use and _called_tool(g)):
                c.finish_reason = g.finish_reason
            elif turn + 1 == turns:  # a call in the last allowed turn: recorded, not executed
                c.tool_calls.append(call_record(_last_turn_text(c, tok), turn, None, False))
                c.finish_reason = "max_turns"
            else:
                calling.append(c)
        if calling:
            _answer_calls(calling, tok, data, tool_use, turn, budget)
        if on_turn is not None:
            on_turn([c for c in active if c.finish_reason])
        crash_point("agent.turn")


def _last_turn_text(c: Conversation, tok) -> str:
    return c.turn_text(tok, -1)


def _answer_calls(calling: list[Conversation], tok, data: DataConfig, tool_use: ToolUse, turn: int, budget: int) -> None:
    """Execute the calls that ended ``turn`` (all at once, each within the timeout) and append each
    conversation's tool turn, cut to what the budget leaves."""
    texts = [_last_turn_text(c, tok) for c in calling]
    results = run_tool_calls(texts, tool_use.tools, [c.row for c in calling], tool_use.timeout_s)
    for c, text, result in zip(calling, texts, results):
        if result is None:  # the turn closed a call it never opened
            result = ToolResult(None, f"error: {CALL_END} without <tool_call>", False)
        c.tool_calls.append(call_record(text, turn, result.text, result.ok))
        ids = tool_turn_ids(tok, c.row, data, result.text)
        room = budget - len(c.response_ids)
        c._append(ids[:room], 0, [0.0] * min(len(ids), room))
        if len(ids) >= room:  # no room left for the student to answer
            c.finish_reason = "length"


def call_record(turn_text: str, turn: int, result: str | None, ok: bool) -> dict:
    """A row's record of one tool call: the turn, the tool's name and arguments (JSON) as the student
    wrote them (empty when the call could not be read), whether it succeeded, and what it answered
    (null when it was not executed)."""
    call = parse_tool_call(turn_text)
    name, arguments = (call.name, json.dumps(call.arguments, sort_keys=True)) if hasattr(call, "name") else ("", "")
    return {"turn": turn, "name": name, "arguments": arguments, "ok": ok, "result": result}


def conversation_counts(rows: list[RolloutRow]) -> dict:
    """A unit's sums behind the round's multi-turn metrics (see :func:`conversation_metrics`)."""
    turns = [r.num_turns for r in rows] or [0]
    calls = [call for r in rows for call in r.tool_calls]
    return {
        "llm_tokens": sum(sum(r.loss_mask) for r in rows),
        "tool_tokens": sum(len(r.loss_mask) - sum(r.loss_mask) - r.teacher_prefix_len for r in rows),
        "turns_sum": sum(turns), "turns_min": min(turns), "turns_max": max(turns),
        "tool_calls": len(calls), "tool_errors": sum(not call["ok"] for call in calls),
    }


def conversation_metrics(counts: list, responses: int) -> dict:
    """The round's multi-turn metrics from its units' counts (:func:`conversation_counts`, as each
    unit's :class:`~gndpo.pipeline.run.products.RolloutNumbers` holds them), named as in verl's agent
    loop: tokens per response the student wrote (``tool_mask/llm_tokens``) and the tool turns added
    (``tool_mask/tool_tokens``), the tool share of all response tokens, student turns per response, and
    the calls made and failed."""
    llm, tool = sum(c.llm_tokens for c in counts), sum(c.tool_tokens for c in counts)
    per = max(responses, 1)
    return {
        "tool_mask/llm_tokens": llm / per,
        "tool_mask/tool_tokens": tool / per,
        "tool_mask/tool_ratio": tool / max(llm + tool, 1),
        "num_turns/mean": sum(c.turns_sum for c in counts) / per,
        "num_turns/min": min((c.turns_min for c in counts), default=0),
        "num_turns/max": max((c.turns_max for c in counts), default=0),
        "tool_calls/per_response": sum(c.tool_calls for c in counts) / per,
        "tool_calls/errors": sum(c.tool_errors for c in counts),
    }
