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

from gndpo.errors import GndpoError, first_line
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
        raise GndpoError(f"malformed prompts file {url}: {first_line(exc)}") from None


def write_prompt_table(run: RunFS, rel: str, table: pl.DataFrame) -> None:
    """Write a prompt table as Parquet at ``rel`` in the run (exclusive create: never overwritten)."""
    buf = io.BytesIO()
    table.write_parquet(buf)
    run.write_new(rel, buf.getvalue())


def read_prompt_table(run: RunFS, rel: str) -> list[dict]:
    """A prompt table of the run, one dict per row."""
    return pl.read_parquet(io.BytesIO(run.read_bytes(rel))).to_dicts()


def write_file(url: str, data: bytes) -> None:
    """Write ``data`` to ``url`` (any fsspec URL) under a temporary name and move it into place, so a
    crash never leaves a half-written file under the final name."""
    fs, path = fsspec.core.url_to_fs(url)
    if fs.isdir(path):
        raise GndpoError(f"{url} is a folder; give a file path")
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
    except BaseException as exc:
        if fs.exists(tmp):  # never leave the temporary file behind
            fs.rm(tmp)
        if isinstance(exc, OSError) and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror, url) from exc  # the path the user gave, not the temporary one
        raise


def write_results(folder: str, table: pa.Table, summary: dict) -> dict:
    """``folder/per_prompt.parquet`` and ``folder/summary.json`` (any fsspec URL), each moved into place
    only when complete."""
    folder = folder.rstrip("/")
    paths = {"per_prompt": f"{folder}/per_prompt.parquet", "summary": f"{folder}/summary.json"}
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    write_file(paths["per_prompt"], buf.getvalue())
    write_file(paths["summary"], json.dumps(summary, indent=1).encode())
    return paths


FRAME_FORMATS = ("table", "csv", "json", "parquet")


def encode_frame(df: pl.DataFrame, fmt: str) -> bytes:
    """``df`` as the bytes of an aligned text table (every row and column, no shape line), a csv, a json
    (an array of row objects) or a parquet file."""
    if fmt == "table":
        # For reading: no dtype row, floats to 4 decimals (csv, json and parquet keep every digit).
        with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, fmt_str_lengths=60, tbl_hide_dataframe_shape=True,
                       tbl_hide_column_data_types=True, float_precision=4):
            return (str(df) + "\n").encode()
    if fmt == "csv":
        nested = [name for name, dtype in df.schema.items() if dtype.is_nested()]
        if nested:
            raise GndpoError(
                f"csv cannot hold the nested columns {', '.join(nested)}: select scalar columns (or unnest them), "
                "or use --format json or parquet"
            )
        return df.write_csv().encode()
    if fmt == "json":
        return df.write_json().encode()
    if fmt == "parquet":
        buf = io.BytesIO()
        df.write_parquet(buf, compression="zstd")
        return buf.getvalue()
    raise GndpoError(f"unknown format {fmt!r} (use one of {', '.join(FRAME_FORMATS)})")
