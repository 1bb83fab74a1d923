"""Arrow schemas of the shards and the Parquet writer/reader that checks them against commit records.

Shards are ordinary Parquet files (zstd), one row per response, so DuckDB, polars and pyarrow open them
directly. A reader always starts from a manifest's file records and verifies bytes, sha256 and row count
before trusting a file: a shard that was truncated or edited after its commit is refused by name.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gndpo.errors import GndpoError
from gndpo.storage.products import FileKind, FileRecord
from gndpo.storage.rows import RolloutRow, ScoreRow, StatRow, arrow_schema
from gndpo.storage.runfs import RunFS

# Declared, with each column's comment, in storage/rows.py.
ROLLOUTS = arrow_schema(RolloutRow)

SCORES = arrow_schema(ScoreRow)


def scores_schema(topk: int) -> pa.Schema:
    """SCORES with a teacher top-k of ``topk`` ids per token (min(score.teacher_topk, vocabulary))."""
    schema = SCORES
    for name, typ in (("teacher_topk_ids", pa.int32()), ("teacher_topk_logprobs", pa.float32())):
        schema = schema.set(schema.get_field_index(name), pa.field(name, pa.list_(pa.list_(typ, topk))))
    return schema


def token_bytes(schema: pa.Schema, names) -> int:
    """Bytes one response token takes, uncompressed, in ``schema``'s per-token columns ``names`` (lists
    of a fixed-width type, or of fixed-size lists of one: the top-k)."""
    total = 0
    for name in names:
        item = schema.field(name).type.value_type
        width = 1
        if pa.types.is_fixed_size_list(item):
            width, item = item.list_size, item.value_type
        total += width * item.bit_width // 8
    return total


def list_column(values: np.ndarray, lengths: np.ndarray, typ: pa.DataType) -> pa.Array:
    """A list<typ> column (or list<fixed_size_list>) from one flat array of all rows' values [N] or
    [N, k] and each row's length, without per-element Python objects."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    if values.ndim == 2:
        inner = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), typ.value_type.value_type), values.shape[1])
    else:
        inner = pa.array(values, typ.value_type)
    return pa.ListArray.from_arrays(pa.array(offsets), inner)


def flat_values(column) -> tuple[np.ndarray, np.ndarray]:
    """(all rows' values as one numpy array, [N] or [N, k] for fixed-size lists; row offsets [rows+1])
    of a list column. Null rows count as empty."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if array.null_count:
        array = array.fill_null(pa.scalar([], array.type))
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.values.slice(offsets[0], offsets[-1] - offsets[0])
    offsets = offsets - offsets[0]
    if pa.types.is_fixed_size_list(values.type):
        k = values.type.list_size
        flat = values.flatten().to_numpy(zero_copy_only=False).reshape(-1, k)
    else:
        flat = values.to_numpy(zero_copy_only=False)
    return flat, offsets


STATS = arrow_schema(StatRow)


def float_leaf_columns(schema: pa.Schema) -> list[str]:
    """Parquet paths of every float leaf (``teacher_logprobs.list.element``, top-k values one level
    deeper), the columns written with BYTE_STREAM_SPLIT."""
    paths = []

    def walk(path: str, typ: pa.DataType) -> None:
        if pa.types.is_floating(typ):
            paths.append(path)
        elif pa.types.is_list(typ) or pa.types.is_fixed_size_list(typ):
            walk(f"{path}.list.element", typ.value_type)

    for field in schema:
        walk(field.name, field.type)
    return paths


def round_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), still as float32: the low 16 bits
    become zero, which byte-stream-split encoding then stores in almost no space."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    finite = np.isfinite(values)  # inf and NaN stay as they are (score refuses them anyway)
    return np.where(finite, rounded.view(np.float32), values).astype(np.float32)


def to_parquet_bytes(table: pa.Table) -> bytes:
    """zstd Parquet; float columns byte-stream-split and without dictionary encoding (Parquet applies
    byte-stream-split only to columns without a dictionary; log-probs then take about half the bytes:
    their sign and exponent bytes compress well, a dictionary of distinct floats does not)."""
    floats = float_leaf_columns(table.schema)
    with_floats = {path.split(".", 1)[0] for path in floats}
    buf = io.BytesIO()
    pq.write_table(
        table, buf, compression="zstd", use_byte_stream_split=floats or False,
        use_dictionary=[name for name in table.schema.names if name not in with_floats],
    )
    return buf.getvalue()


def write_shard(run: RunFS, rel: str, table: pa.Table, schema: pa.Schema | None = None, kind: FileKind = FileKind.ROWS) -> FileRecord:
    """Write ``table`` as one immutable Parquet file; its record has its row count and ``kind``."""
    if schema is not None:
        table = table.cast(schema) if table.schema != schema else table
    return replace(run.write_new(rel, to_parquet_bytes(table)), rows=table.num_rows, kind=kind)


def verified_bytes(run: RunFS, record: FileRecord) -> bytes:
    """The bytes of a committed file, refused if they no longer match its commit record."""
    run = run.holding(record)
    uri = run.uri(record.path)
    try:
        data = run.fs.cat_file(run.path(record.path))
    except FileNotFoundError:
        raise GndpoError(f"shard listed in a commit record is missing: {uri}") from None
    if len(data) != record.bytes or hashlib.sha256(data).hexdigest() != record.sha256:
        raise GndpoError(f"corrupt shard (checksum mismatch with its commit record): {uri}")
    return data


def verify_shards(run: RunFS, records: list[FileRecord]) -> None:
    """Check files against their commit records before another reader (DuckDB) opens them directly."""
    for record in records:
        verified_bytes(run, record)


def read_shard(run: RunFS, record: FileRecord, columns: list[str] | None = None) -> pa.Table:
    """Read one committed shard, refusing it if it no longer matches its commit record. With
    ``columns``, only those the file has are decoded (an older shard may lack a later column)."""
    uri = run.holding(record).uri(record.path)
    data = verified_bytes(run, record)
    try:
        parquet = pq.ParquetFile(io.BytesIO(data))
        table = parquet.read(columns=None if columns is None else [c for c in columns if c in parquet.schema_arrow.names])
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise GndpoError(f"corrupt shard (unreadable Parquet): {uri}: {exc}") from None
    if table.num_rows != record.rows:
        raise GndpoError(f"corrupt shard (row count {table.num_rows} != {record.rows}): {uri}")
    return table


def read_shards(run: RunFS, records: list[FileRecord], schema: pa.Schema | None = None) -> pa.Table:
    """Concatenate committed shards in record order (an empty table of ``schema`` when none)."""
    tables = [read_shard(run, r) for r in records]
    if not tables:
        if schema is None:
            raise GndpoError("no shards to read")
        return schema.empty_table()
    return pa.concat_tables(tables, promote_options="default")
