"""Prompt rendering and stopping: what the student sees before its response, and where it ends.

:func:`render_prompt` is the only place a prompt row becomes text and token ids: rollout, eval, the
init-time length check and the teacher-prefix guidance all call it, and rollout stores the ids it
returns, so score and train see exactly those tokens (teacher and student share the tokenizer). A
conversation goes through the student's chat template with ``add_generation_prompt``; the rendered text
is tokenized without adding special tokens again (templates write their own BOS where the model has
one, as vLLM's chat path does). A plain prompt is wrapped as one user turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from gndpo.errors import GndpoError, first_line
from gndpo.pipeline.run.images import content_text, image_ids, with_image_parts
from gndpo.pipeline.settings.schema import DataConfig


@dataclass
class RenderedPrompt:
    """A prompt as the model reads it: the rendered text, its token ids and its images."""

    text: str
    token_ids: list[int]  # with one placeholder token per image: the model's processor expands them
    images: list[str] = field(default_factory=list)  # the run's image ids, in placeholder order


def conversation(row: dict, data: DataConfig) -> list[dict]:
    """The row's turns (its ``messages``, or its plain prompt as one user turn), with
    ``data.system_prompt`` first where the conversation has no system turn."""
    messages = row.get("messages")
    turns = json.loads(messages) if isinstance(messages, str) else list(messages or [])
    if not turns:
        turns = [{"role": "user", "content": row["prompt"]}]
    # Multimodal templates take a picture as an image part of the content; text templates take strings.
    as_content = with_image_parts if image_ids(row) else content_text
    turns = [{**turn, "content": as_content(turn["content"])} for turn in turns]
    if data.system_prompt and turns[0]["role"] != "system":
        turns = [{"role": "system", "content": data.system_prompt}, *turns]
    return turns


def uses_template(tok, data: DataConfig) -> bool:
    return data.chat_template == "auto" and bool(getattr(tok, "chat_template", None))


def render_prompt(tok, row: dict, data: DataConfig) -> RenderedPrompt:
    """The text and token ids of a prompt row as the student sees it; a GndpoError (one line) for a
    conversation that cannot be rendered."""
    if not uses_template(tok, data):
        if row.get("messages") or data.system_prompt:
            model = getattr(tok, "name_or_path", "") or "this model"
            why = "data.chat_template is none" if data.chat_template == "none" else f"the tokenizer of {model} has no chat template"
            raise GndpoError(f"prompt {row.get('prompt_id', '?')} is a conversation (messages or data.system_prompt) but {why}")
        return RenderedPrompt(row["prompt"], list(tok(row["prompt"])["input_ids"]), image_ids(row))
    try:
        text = tok.apply_chat_template(
            conversation(row, data), tokenize=False, add_generation_prompt=True, **data.template_kwargs
        )
    except Exception as exc:  # jinja errors, a template's own raise_exception(...)
        raise GndpoError(f"the chat template cannot render prompt {row.get('prompt_id', '?')}: {first_line(exc, with_type=True)}") from None
    return RenderedPrompt(text, list(tok(text, add_special_tokens=False)["input_ids"]), image_ids(row))


def end_of_turn_ids(tok, data: DataConfig) -> list[int]:
    """The token(s) the chat template closes an assistant turn with (found by rendering a probe
    conversation and reading the special token right after the assistant's text)."""
    if not uses_template(tok, data):
        return []
    probe = "gndpo-probe-answer"
    try:
        text = tok.apply_chat_template(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": probe}], tokenize=False, **data.template_kwargs
        )
    except Exception:  # a template that cannot close an assistant turn: EOS is the only stop
        return []
    tail = text[text.rfind(probe) + len(probe):] if probe in text else ""
    ids = tok(tail, add_special_tokens=False)["input_ids"] if tail.strip() else []
    special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}) or {})
    return [ids[0]] if ids and ids[0] in special else []


def turn_end_id(tok, data: DataConfig) -> int | None:
    """The one token that closes a turn: the template's end-of-turn, else EOS (None: neither)."""
    return (end_of_turn_ids(tok, data) or [tok.eos_token_id])[0]


def stop_token_ids(tok, data: DataConfig) -> list[int]:
    """Where a response ends: the tokenizer's EOS and the template's end-of-turn token."""
    ids = set(end_of_turn_ids(tok, data))
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return sorted(ids)


def tool_turn_ids(tok, row: dict, data: DataConfig, tool_text: str) -> list[int]:
    """The tokens that follow an assistant turn which ended in a tool call (multi-turn rollouts): the
    template's close of that turn, a ``tool`` turn holding ``tool_text``, and the opening of the next
    assistant turn. Found by rendering the row's conversation with a probe assistant turn and reading
    what the template writes after the probe; a GndpoError (one line) if the template cannot render a
    tool turn."""
    if not uses_template(tok, data):
        raise GndpoError("tool use needs a chat template (the student's tokenizer has none, or data.chat_template is none)")
    probe = "gndpo-probe-call"
    turns = [*conversation(row, data), {"role": "assistant", "content": probe}, {"role": "tool", "content": tool_text}]
    try:
        text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, **data.template_kwargs)
    except Exception as exc:
        raise GndpoError(f"the chat template cannot render a tool turn: {first_line(exc, with_type=True)}") from None
    at = text.rfind(probe)
    tail = text[at + len(probe):] if at >= 0 else ""
    if tool_text not in tail:
        raise GndpoError("the chat template drops tool turns (its rendering has no tool result); it cannot be used for tool use")
    return list(tok(tail, add_special_tokens=False)["input_ids"])
