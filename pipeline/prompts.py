"""Importing prompt files: validation and stable prompt ids."""

from __future__ import annotations

import hashlib

import polars as pl

from gndpo.errors import GndpoError
from gndpo.storage.tables import read_table_url


def prompt_id(prompt: str) -> str:
    """A stable id from the prompt text, so re-importing the same file gives the same ids."""
    return hashlib.sha1(prompt.encode()).hexdigest()[:16]


def load_prompts(url: str, prompt_key: str = "prompt", answer_key: str = "answer") -> pl.DataFrame:
    """Read and validate a prompts file into (prompt_id, prompt, answer); any problem is a GndpoError."""
    df = read_table_url(url)
    for key in (prompt_key, answer_key):
        if key not in df.columns:
            raise GndpoError(f"prompts file {url} has no {key!r} column (columns: {', '.join(df.columns) or 'none'})")
    if df.height == 0:
        raise GndpoError(f"prompts file {url} has no rows")
    df = df.select(
        pl.col(prompt_key).cast(pl.Utf8, strict=False).alias("prompt"),
        pl.col(answer_key).cast(pl.Utf8, strict=False).alias("answer"),
    )
    bad = df.filter(pl.col("prompt").is_null() | (pl.col("prompt").str.len_chars() == 0) | pl.col("answer").is_null())
    if bad.height:
        raise GndpoError(f"prompts file {url} has {bad.height} rows with an empty prompt or a missing answer")
    df = df.with_columns(pl.col("prompt").map_elements(prompt_id, return_dtype=pl.Utf8).alias("prompt_id"))
    dupes = df.height - df["prompt_id"].n_unique()
    if dupes:
        raise GndpoError(f"prompts file {url} has {dupes} duplicate prompts")
    return df.select("prompt_id", "prompt", "answer")
