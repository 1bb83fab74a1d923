"""Small tables that are not shards: user prompt files (any fsspec URL), the run's prompt tables and
`gndpo eval`'s result files."""

from __future__ import annotations

import io
import json
import uuid

import fsspec
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

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


def write_results(folder: str, table: pa.Table, summary: dict) -> dict:
    """``folder/per_prompt.parquet`` and ``folder/summary.json`` (any fsspec URL), each written to a
    temporary name first and moved into place, so a crash never leaves a half-written result."""
    fs, root = fsspec.core.url_to_fs(folder)
    fs.makedirs(root, exist_ok=True)
    paths = {"per_prompt": f"{root}/per_prompt.parquet", "summary": f"{root}/summary.json"}
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    for path, data in ((paths["per_prompt"], buf.getvalue()), (paths["summary"], json.dumps(summary, indent=1).encode())):
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
    return paths
