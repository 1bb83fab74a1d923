"""Importing prompt files: validation and stable prompt ids.

A prompt file has an answer column and either a plain prompt column or a messages column (a list of
``{"role": ..., "content": ...}`` turns, system turn included). The run's prompt table keeps, per
prompt: ``prompt_id``, ``prompt`` (the plain prompt, or the last user turn of a conversation: what a
person reading the run wants to see), ``messages`` (the conversation as JSON, null for a plain prompt)
and ``answer``; and, where the file has them, the tool-use columns ``tool_calls`` (the calls a correct
response makes, for the ``tool_format`` and ``tool_correctness`` rewards) and ``lookup`` (the ``lookup``
tool's key-value table for that prompt), kept as JSON text; and ``teacher`` (from ``data.teacher_key``),
the teacher a prompt is routed to when a run has several. JSON strings are the safest form for these
columns: a file of nested objects is read with one struct type per column, whose missing keys come back
as nulls and are dropped here. How a prompt becomes text and token ids is decided in one place,
:func:`gndpo.stages.text.chat.render_prompt`.
"""

from __future__ import annotations

import hashlib
import json

import polars as pl

from gndpo.errors import GndpoError
from gndpo.storage.tables import read_table_url

ROLES = ("system", "user", "assistant", "tool")
TOOL_COLUMNS = ("tool_calls", "lookup")


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def json_column(values: list) -> list[str | None]:
    """A nested column's values as JSON text (strings are taken as JSON already; nulls stay null)."""
    return [v if v is None or isinstance(v, str) else json.dumps(_without_nulls(v), ensure_ascii=False) for v in values]


def prompt_id(prompt: str) -> str:
    """A stable id from the prompt text, so re-importing the same file gives the same ids."""
    return hashlib.sha1(prompt.encode()).hexdigest()[:16]


def check_messages(value, where: str) -> list[dict]:
    """``value`` as a list of {role, content} dicts; a GndpoError naming ``where`` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise GndpoError(f"{where}: messages must be a list of {{role, content}} turns, got a string that is not JSON") from None
    if not isinstance(value, list) or not value:
        raise GndpoError(f"{where}: messages must be a non-empty list of {{role, content}} turns, got {type(value).__name__}")
    turns = []
    for i, turn in enumerate(value):
        if isinstance(turn, dict) and isinstance(turn.get("content"), list):
            raise GndpoError(f"{where}: turn {i} has a list of content parts (the multimodal form); "
                             "only string content is supported for now (images are not supported yet)")
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or not isinstance(turn.get("content"), str):
            raise GndpoError(f"{where}: turn {i} must be a dict with a string role and a string content, got {turn!r}")
        if turn["role"] not in ROLES:
            raise GndpoError(f"{where}: turn {i} has unknown role {turn['role']!r} (roles: {', '.join(ROLES)})")
        turns.append({"role": turn["role"], "content": turn["content"]})
    if not any(t["role"] == "user" for t in turns):
        raise GndpoError(f"{where}: the conversation has no user turn")
    return turns


BUILT_IN = ("prompt_id", "prompt", "messages", "answer")
# Columns that hold a prompt's images in vision-language data sets (geo3k, LLaVA-style files).
IMAGE_COLUMNS = ("image", "images", "image_path", "image_paths", "image_url", "pixel_values")


def load_prompts(url: str, prompt_key: str = "prompt", answer_key: str = "answer", messages_key: str = "messages",
                 teacher_key: str = "teacher", keep: tuple = ()) -> pl.DataFrame:
    """Read and validate a prompts file into (prompt_id, prompt, messages, answer); any problem is a
    GndpoError. A file with a ``messages_key`` column is read as conversations, else ``prompt_key``.
    ``keep``: more columns to keep as text (those a teacher context names); each must exist."""
    df = read_table_url(url)
    if images := [c for c in df.columns if c.lower() in IMAGE_COLUMNS]:
        raise GndpoError(f"prompts file {url} has an image column ({', '.join(images)}): prompts are text only for now "
                         "(images are not supported yet); drop the column to train on the text alone")
    chat = messages_key in df.columns
    for key in (messages_key if chat else prompt_key, answer_key):
        if key not in df.columns:
            raise GndpoError(f"prompts file {url} has no {key!r} column (columns: {', '.join(df.columns) or 'none'})")
    if df.height == 0:
        raise GndpoError(f"prompts file {url} has no rows")
    answers = df[answer_key].cast(pl.Utf8, strict=False)
    if chat:
        conversations = [check_messages(v, f"prompts file {url}, row {i + 1}") for i, v in enumerate(df[messages_key].to_list())]
        messages = [json.dumps(c, ensure_ascii=False) for c in conversations]
        prompts = [next(t["content"] for t in reversed(c) if t["role"] == "user") for c in conversations]
        ids = [prompt_id(m) for m in messages]
    else:
        prompts = df[prompt_key].cast(pl.Utf8, strict=False).to_list()
        messages = [None] * len(prompts)
        ids = [prompt_id(p) if p else "" for p in prompts]
    extra = {name: json_column(df[name].to_list()) for name in TOOL_COLUMNS if name in df.columns}
    for name in (k for k in keep if k not in BUILT_IN):  # a teacher context's columns (self-distillation)
        if name not in df.columns:
            raise GndpoError(f"teacher_context names column {name!r}, which prompts file {url} does not have (columns: {', '.join(df.columns)})")
        extra[name] = json_column(df[name].to_list())
    if teacher_key in df.columns:  # the teacher a prompt is routed to (several teachers)
        extra["teacher"] = df[teacher_key].cast(pl.Utf8, strict=False).to_list()
    out = pl.DataFrame(
        {"prompt_id": ids, "prompt": prompts, "messages": messages, "answer": answers, **extra},
        schema={"prompt_id": pl.Utf8, "prompt": pl.Utf8, "messages": pl.Utf8, "answer": pl.Utf8, **{k: pl.Utf8 for k in extra}},
    )
    bad = out.with_row_index("row", offset=1).filter(
        pl.col("prompt").is_null() | (pl.col("prompt").str.len_chars() == 0) | pl.col("answer").is_null())
    if bad.height:
        first = bad.row(0, named=True)
        what = f"a missing {answer_key!r}" if first["answer"] is None else "an empty prompt"
        raise GndpoError(f"prompts file {url} has {bad.height} rows with an empty prompt or a missing answer; "
                         f"first row {first['row']}" + (f" (prompt_id {first['prompt_id']})" if first["prompt_id"] else "") + f": {what}")
    dupes = out.height - out["prompt_id"].n_unique()
    if dupes:
        raise GndpoError(f"prompts file {url} has {dupes} duplicate prompts")
    return out
