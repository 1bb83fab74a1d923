"""Small tables that are not shards: user prompt files (any fsspec URL) and the run's prompt tables."""

from __future__ import annotations

import io

import fsspec
import polars as pl

from gndpo.errors import GndpoError
from gndpo.storage.runfs import RunFS

READERS = {
    ".jsonl": lambda f: pl.read_ndjson(f),
    ".json": lambda f: pl.read_ndjson(f),
    ".parquet": lambda f: pl.read_parquet(f),
    ".csv": lambda f: pl.read_csv(f),
}


def read_table_url(url: str) -> pl.DataFrame:
    """Read a jsonl / parquet / csv file from a local path or any fsspec URL into polars."""
    suffix = next((s for s in READERS if url.endswith(s)), None)
    if suffix is None:
        raise GndpoError(f"unsupported prompts file type (use .jsonl, .parquet or .csv): {url}")
    try:
        with fsspec.open(url, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise GndpoError(f"prompts file not found: {url}") from None
    except Exception as exc:
        raise GndpoError(f"cannot open prompts file {url}: {exc}") from None
    try:
        return READERS[suffix](io.BytesIO(data))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GndpoError(f"malformed prompts file {url}: {first}") from None


def write_prompt_table(run: RunFS, rel: str, table: pl.DataFrame) -> None:
    buf = io.BytesIO()
    table.write_parquet(buf)
    run.write_new(rel, buf.getvalue())


def read_prompt_table(run: RunFS, rel: str) -> list[dict]:
    return pl.read_parquet(io.BytesIO(run.read_bytes(rel))).to_dicts()
