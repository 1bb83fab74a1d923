"""Images in prompts: reading a data set's image column, the checks ``gndpo init`` makes, and decoding.

A prompts file's image column (``data.images_key``, default ``images``) holds, per row, one image or a
list of them, each a path (relative to the prompts file, absolute, or any fsspec URL), raw bytes, or
the ``{"bytes": ..., "path": ...}`` struct that Hugging Face ``datasets`` writes to Parquet (geo3k's
layout). Where a picture goes in the prompt is an ``<image>`` placeholder in the text (plain prompts,
or string content of chat turns) or a ``{"type": "image"}`` part of a turn's content list; a row has
exactly as many placeholders as images, in order.

At init every image is read, decoded once (a file that is not a picture is refused there, naming the
row) and stored in the run under its sha256 (:mod:`gndpo.storage.images`); the prompt table's
``images`` column is the JSON list of those ids. Stages decode by id (:class:`RunImages`).
"""

from __future__ import annotations

import io
import json
from functools import lru_cache

import polars as pl

from gndpo.errors import GndpoError
from gndpo.storage.images import image_id, put_image, read_image, read_source_image
from gndpo.storage.runfs import RunFS

PLACEHOLDER = "<image>"


def source_images(cell, base: str, where: str) -> list[bytes]:
    """The bytes of every image in one row's image cell (null: none)."""
    if cell is None:
        return []
    items = cell if isinstance(cell, list) else [cell]
    out = []
    for k, item in enumerate(items):
        if isinstance(item, dict):  # datasets' Image feature: bytes when embedded, else a path
            item = item.get("bytes") or item.get("path")
        if isinstance(item, (bytes, bytearray)):
            out.append(bytes(item))
        elif isinstance(item, str) and item:
            out.append(read_source_image(item, base))
        else:
            raise GndpoError(f"{where}: image {k + 1} is neither a path, bytes nor a {{bytes, path}} struct (got {type(item).__name__})")
    return out


def decode(data: bytes):
    """A PIL image, RGB, fully loaded."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")


def check_decodes(data: bytes, where: str) -> None:
    try:
        decode(data)
    except Exception as exc:
        raise GndpoError(f"{where}: cannot be decoded as an image ({' '.join(str(exc).split())[:160]})") from None


def content_text(content) -> str:
    """A turn's content (a string or a list of text and image parts) as text, each image part written
    as its ``<image>`` placeholder."""
    if isinstance(content, str):
        return content
    return "".join(PLACEHOLDER if part["type"] == "image" else part["text"] for part in content)


def placeholders(prompt: str | None, messages: list[dict] | None) -> int:
    """How many images a prompt places: ``<image>`` in text plus image parts of chat turns."""
    if messages is None:
        return (prompt or "").count(PLACEHOLDER)
    return sum(content_text(turn["content"]).count(PLACEHOLDER) for turn in messages)


def with_image_parts(content):
    """A turn's content as multimodal chat templates expect it: each ``<image>`` in its text an image
    part (a string without placeholders stays a string; a list keeps its parts, their text split)."""
    if isinstance(content, str):
        return image_parts(content) if PLACEHOLDER in content else content
    return [piece for part in content for piece in (image_parts(part["text"]) if part["type"] == "text" else [part])]


def image_parts(text: str) -> list[dict]:
    """``text`` as text parts with an image part at each ``<image>`` (no empty text parts around them)."""
    if PLACEHOLDER not in text:
        return [{"type": "text", "text": text}]
    parts = []
    for i, piece in enumerate(text.split(PLACEHOLDER)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def with_image_ids(table: pl.DataFrame, found: dict[str, bytes], where: str) -> pl.DataFrame:
    """``table`` (a loaded prompts file) with each row's image bytes replaced by the JSON list of their
    ids. Every image is decoded once here (one that is not a picture is a one-line error naming its
    row) and put in ``found`` (id -> bytes), which init stores once all its checks have passed."""
    if "images" not in table.columns:
        return table
    ids = []
    for i, images in enumerate(table["images"].to_list()):
        row = []
        for k, data in enumerate(images or []):
            image = image_id(data)
            if image not in found:
                check_decodes(data, f"{where}, row {i + 1}, image {k + 1}")
                found[image] = data
            row.append(image)
        ids.append(json.dumps(row) if row else None)
    return table.with_columns(pl.Series("images", ids, dtype=pl.Utf8))


def store_images(fs: RunFS, found: dict[str, bytes]) -> None:
    for data in found.values():
        put_image(fs, data)


def copy_images(source: RunFS, dest: RunFS, prompts: list[dict]) -> None:
    """Store in ``dest`` every picture ``prompts`` (prompt-table rows) name, read from ``source``: a
    fork takes its parent's imported pictures with its prompt tables."""
    for image in {i for row in prompts for i in image_ids(row)}:
        put_image(dest, read_image(source, image))


def image_ids(row: dict) -> list[str]:
    """The ids of a prompt-table row's images, in placeholder order."""
    value = row.get("images")
    return json.loads(value) if value else []


class RunImages:
    """A run's images by id, decoded once per process."""

    def __init__(self, fs: RunFS, cache: int = 4096):
        self.fs = fs
        self.get = lru_cache(maxsize=cache)(self._decode)

    def _decode(self, image: str):
        return decode(read_image(self.fs, image))

    def of(self, row: dict) -> list:
        return [self.get(i) for i in image_ids(row)]
