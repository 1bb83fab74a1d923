"""Importing prompt files: validation and stable prompt ids.

A prompt file (any source :func:`gndpo.storage.tables.read_table_url` reads: a file, a folder of
Parquet shards, a ``datasets`` folder or dataset id, with a split) has either a plain prompt column, a
messages column (a list of ``{"role": ..., "content": ...}`` turns, system turn included) or a ShareGPT
``conversations`` column (``{"from": "human" | "gpt" | "system" | ..., "value": ...}`` turns, read as
messages). A conversation whose last turn is the assistant's (SFT data) is the prompt before that turn,
and that reply is the row's reference answer where the row has no answer of its own. The answer column
is optional: a file without one gives null answers, refused only where something needs them
(``answers_for``); where the column is there, every row has an answer.

The run's prompt table keeps, per prompt: ``prompt_id`` (from the stored messages, or the plain prompt),
``prompt`` (the plain prompt, or the last user turn of a conversation: what a person reading the run
wants to see), ``messages`` (the conversation as JSON, without a trailing assistant reply; null for a
plain prompt) and ``answer`` (null where the file has none); and, where the file has them, the tool-use
columns ``tool_calls`` (the calls a correct response makes, for the ``tool_format`` and
``tool_correctness`` rewards) and ``lookup`` (the ``lookup`` tool's key-value table for that prompt),
kept as JSON text; and ``teacher`` (from ``data.teacher_key``), the teacher a prompt is routed to when a
run has several. JSON strings are the safest form for these columns: a file of nested objects is read
with one struct type per column, whose missing keys come back as nulls and are dropped here. How a
prompt becomes text and token ids is decided in one place, :func:`gndpo.stages.text.chat.render_prompt`.
"""

from __future__ import annotations

import hashlib
import json

import polars as pl

from gndpo.errors import GndpoError
from gndpo.pipeline.run.images import content_text, placeholders, source_images
from gndpo.pipeline.settings.schema import DataConfig
from gndpo.storage.images import image_id
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


def check_content(content, where: str):
    """A turn's content: a string, or a list of ``{"type": "text", "text": ...}`` and ``{"type": "image"}``
    parts (the multimodal form), returned without extra keys."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise GndpoError(f"{where} must have a string content or a non-empty list of content parts, got {content!r}")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            parts.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise GndpoError(f"{where} has a content part that is neither {{type: text, text: ...}} nor {{type: image}}: {part!r}")
    return parts


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
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or turn.get("content") is None:
            raise GndpoError(f"{where}: turn {i} must be a dict with a string role and a content, got {turn!r}")
        if turn["role"] not in ROLES:
            raise GndpoError(f"{where}: turn {i} has unknown role {turn['role']!r} (roles: {', '.join(ROLES)})")
        turns.append({"role": turn["role"], "content": check_content(turn["content"], f"{where}: turn {i}")})
    if not any(t["role"] == "user" for t in turns):
        raise GndpoError(f"{where}: the conversation has no user turn")
    return turns


# ShareGPT's speakers (``from``) and the roles they are.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "function_call": "assistant", "system": "system", "tool": "tool", "observation": "tool"}


def sharegpt_messages(value, where: str) -> list:
    """A ShareGPT row's ``{"from": ..., "value": ...}`` turns as ``{role, content}`` turns (checked by
    :func:`check_messages` after); a GndpoError naming ``where`` for an unknown speaker."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise GndpoError(f"{where}: conversations must be a list of {{from, value}} turns, got a string that is not JSON") from None
    if not isinstance(value, list):
        raise GndpoError(f"{where}: conversations must be a list of {{from, value}} turns, got {type(value).__name__}")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise GndpoError(f"{where}: turn {i} must be a {{from, value}} dict, got {turn!r}")
        if turn.get("from") not in SHAREGPT_ROLES:
            raise GndpoError(f"{where}: turn {i} has unknown 'from' {turn.get('from')!r} (known: {', '.join(SHAREGPT_ROLES)})")
        turns.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn.get("value")})
    return turns


def chat_rows(df: pl.DataFrame, data: DataConfig, url: str) -> tuple[list[list[dict]], list[str | None]]:
    """Each row's conversation (the ``messages_key`` column, else ShareGPT's ``conversations_key``) and
    its reference: the text of a last assistant turn, which the conversation then leaves out (the student
    continues the turns before it); None where the last turn is not the assistant's."""
    sharegpt = data.messages_key not in df.columns
    conversations, references = [], []
    for i, value in enumerate(df[data.conversations_key if sharegpt else data.messages_key].to_list()):
        where = f"prompts file {url}, row {i + 1}"
        turns = check_messages(sharegpt_messages(value, where) if sharegpt else value, where)
        reply = turns[-1]["role"] == "assistant"
        references.append(content_text(turns[-1]["content"]) if reply else None)
        conversations.append(turns[:-1] if reply else turns)
    return conversations, references


BUILT_IN = ("prompt_id", "prompt", "messages", "answer", "images")
# Columns that hold a prompt's images in vision-language data sets (geo3k, LLaVA-style files).
IMAGE_COLUMNS = ("image", "images", "image_path", "image_paths", "image_url", "pixel_values")


def answer_column(df: pl.DataFrame, key: str, url: str) -> pl.Series | None:
    """The answers as text: column ``key``, or with a dotted key a field of a struct column; None where
    the file has no such column."""
    if key in df.columns:
        return df[key].cast(pl.Utf8, strict=False)
    column, _, field_name = key.partition(".")
    if not field_name or column not in df.columns:
        return None
    if not isinstance(df[column].dtype, pl.Struct):
        raise GndpoError(f"data.answer_key {key!r}: column {column!r} of prompts file {url} is not a struct (it is {df[column].dtype})")
    fields = [f.name for f in df[column].dtype.fields]
    if field_name not in fields:
        raise GndpoError(f"data.answer_key {key!r}: column {column!r} has no field {field_name!r} (fields: {', '.join(fields)})")
    return df[column].struct.field(field_name).cast(pl.Utf8, strict=False)


def row_answers(df: pl.DataFrame, key: str, url: str, references: list, answers_for: str) -> tuple[list, bool]:
    """Each row's answer (the answer column's value, else a chat row's reference) and whether every row
    must have one: where the file has the column, or ``answers_for`` (what needs them) is set."""
    column = answer_column(df, key, url)
    if column is None and answers_for and all(r is None for r in references):
        raise GndpoError(f"{answers_for} needs answers: prompts file {url} has no {key!r} column (columns: {', '.join(df.columns) or 'none'})")
    values = column.to_list() if column is not None else [None] * df.height
    return [v if v is not None else r for v, r in zip(values, references)], column is not None or bool(answers_for)


def row_images(df: pl.DataFrame, images_key: str, url: str) -> list[list[bytes]] | None:
    """Each row's images as bytes (:func:`gndpo.pipeline.run.images.source_images`), or None for a file
    without an image column."""
    if images_key not in df.columns:
        if others := [c for c in df.columns if c.lower() in IMAGE_COLUMNS]:
            raise GndpoError(f"prompts file {url} has an image column ({', '.join(others)}) but no {images_key!r} column: "
                             f"set data.images_key: {others[0]}")
        return None
    base = url.rsplit("/", 1)[0] if "/" in url else "."
    return [source_images(cell, base, f"prompts file {url}, row {i + 1}") for i, cell in enumerate(df[images_key].to_list())]


def load_prompts(url: str, data: DataConfig = DataConfig(), keep: tuple = (), answers_for: str = "") -> pl.DataFrame:
    """Read and validate a prompts file into (prompt_id, prompt, messages, answer); any problem is a
    GndpoError. The columns are ``data``'s keys: a file with a ``messages_key`` column is read as
    conversations, else one with a ``conversations_key`` column as ShareGPT rows, else ``prompt_key``.
    Answers are optional: ``answers_for`` names what needs them (``"method.name grpo"``), and a file with
    no answer column (and no assistant replies to take them from) is then refused; without it the
    answers are null. ``keep``: more columns to keep as text (those a teacher context names); each must
    exist. A file with an ``images_key`` column gains ``images``: each row's image bytes, as many as its
    placeholders (``gndpo init`` stores them in the run and keeps their ids)."""
    df = read_table_url(url)
    images = row_images(df, data.images_key, url)
    chat = data.messages_key in df.columns or data.conversations_key in df.columns
    if not chat and data.prompt_key not in df.columns:
        raise GndpoError(f"prompts file {url} has no {data.prompt_key!r} column (nor {data.messages_key!r} or {data.conversations_key!r}; "
                         f"columns: {', '.join(df.columns) or 'none'})")
    if df.height == 0:
        raise GndpoError(f"prompts file {url} has no rows")
    if chat:
        conversations, references = chat_rows(df, data, url)
        messages = [json.dumps(c, ensure_ascii=False) for c in conversations]
        prompts = [content_text(next(t["content"] for t in reversed(c) if t["role"] == "user")) for c in conversations]
        ids = [prompt_id(m) for m in messages]
    else:
        conversations = references = [None] * df.height
        prompts = df[data.prompt_key].cast(pl.Utf8, strict=False).to_list()
        messages = [None] * len(prompts)
        ids = [prompt_id(p) if p else "" for p in prompts]
    answers, required = row_answers(df, data.answer_key, url, references, answers_for)
    extra = kept_columns(df, keep, data.teacher_key, url)
    schema = {"prompt_id": pl.Utf8, "prompt": pl.Utf8, "messages": pl.Utf8, "answer": pl.Utf8, **{k: pl.Utf8 for k in extra}}
    if images is None:
        refuse_image_parts(conversations, url, data.images_key)
    else:
        check_placeholders(images, prompts, conversations, url)
        extra["images"], schema["images"] = images, pl.List(pl.Binary)
        # The same question about another picture is another prompt.
        ids = [prompt_id(key + "".join(f"\0{image_id(b)}" for b in row)) if row else key_id
               for key, key_id, row in zip(messages if chat else prompts, ids, images)]
    out = pl.DataFrame({"prompt_id": ids, "prompt": prompts, "messages": messages, "answer": answers, **extra}, schema=schema)
    check_rows(out, url, data.answer_key, required, answers_for)
    return out


def kept_columns(df: pl.DataFrame, keep: tuple, teacher_key: str, url: str) -> dict[str, list]:
    """The columns kept beside the built-in ones, as text: the tool columns a row may have, those a
    teacher context names (``keep``; each must exist) and the teacher a prompt is routed to."""
    extra = {name: json_column(df[name].to_list()) for name in TOOL_COLUMNS if name in df.columns}
    for name in (k for k in keep if k not in BUILT_IN):  # a teacher context's columns (self-distillation)
        if name not in df.columns:
            raise GndpoError(f"teacher_context names column {name!r}, which prompts file {url} does not have (columns: {', '.join(df.columns)})")
        extra[name] = json_column(df[name].to_list())
    if teacher_key in df.columns:  # the teacher a prompt is routed to (several teachers)
        extra["teacher"] = df[teacher_key].cast(pl.Utf8, strict=False).to_list()
    return extra


def refuse_image_parts(conversations: list, url: str, images_key: str) -> None:
    """A file without an image column may not have image parts in its conversations."""
    for i, turns in enumerate(conversations):
        if turns and any(part["type"] == "image" for t in turns if not isinstance(t["content"], str) for part in t["content"]):
            raise GndpoError(f"prompts file {url}, row {i + 1} has an image part but the file has no {images_key!r} column")


def check_rows(out: pl.DataFrame, url: str, answer_key: str, answers: bool = True, answers_for: str = "") -> None:
    """No empty prompt, no missing answer where ``answers`` (the first such row is named), no duplicate
    prompt."""
    missing = pl.col("answer").is_null() if answers else pl.lit(False)
    bad = out.with_row_index("row", offset=1).filter(pl.col("prompt").is_null() | (pl.col("prompt").str.len_chars() == 0) | missing)
    if bad.height:
        first = bad.row(0, named=True)
        lacks_answer = answers and first["answer"] is None and bool(first["prompt"])
        what = f"a missing {answer_key!r}" if lacks_answer else "an empty prompt"
        raise GndpoError((f"{answers_for} needs answers: " if answers_for and lacks_answer else "") +
                         f"prompts file {url} has {bad.height} rows with an empty prompt or a missing answer; "
                         f"first row {first['row']}" + (f" (prompt_id {first['prompt_id']})" if first["prompt_id"] else "") + f": {what}")
    dupes = out.height - out["prompt_id"].n_unique()
    if dupes:
        raise GndpoError(f"prompts file {url} has {dupes} duplicate prompts")


def check_placeholders(images: list[list[bytes]], prompts: list[str], conversations: list, url: str) -> None:
    """Every row places exactly as many images as it has (``<image>`` or image parts)."""
    for i, (row_images_, prompt, turns) in enumerate(zip(images, prompts, conversations)):
        placed = placeholders(prompt, turns)
        if placed != len(row_images_):
            raise GndpoError(f"prompts file {url}, row {i + 1}: {len(row_images_)} image(s) but {placed} placeholder(s) "
                             "(an <image> in the text or a {type: image} content part for each image, in order)")


def heldout_rank(prompt_id: str) -> float:
    """Where a prompt falls in [0, 1) for holding out: a hash of its id alone, so the choice does not
    depend on the file's order, its other prompts or the run."""
    return int(hashlib.sha256(f"heldout:{prompt_id}".encode()).hexdigest()[:15], 16) / 16**15


def split_heldout(table: pl.DataFrame, data: DataConfig) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``table`` (a loaded data.train) as (train, held-out) by ``data.heldout_share``: the prompts whose
    :func:`heldout_rank` is below the share, at least the lowest one and at most ``data.heldout_max``
    (the lowest ranks), go to held-out with every row that repeats them; the rest keep their order.
    A prompt added to the file later never moves another prompt across, until the cap is reached."""
    if data.heldout_share == 0:
        return table, table.head(0)
    ranked = sorted((heldout_rank(i), i) for i in set(table["prompt_id"].to_list()))
    held = {i for rank, i in ranked[: data.heldout_max] if rank < data.heldout_share} or {ranked[0][1]}
    mask = table["prompt_id"].is_in(list(held))
    return table.filter(~mask), table.filter(mask)
