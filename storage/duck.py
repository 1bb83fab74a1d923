"""DuckDB over committed shards: a connection that can read the run's filesystem, and views built
from manifests (never from globbing data folders, so uncommitted or losing attempts are invisible)."""

from __future__ import annotations

import duckdb

from gndpo.storage.runfs import RunFS


def connect(run: RunFS) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(":memory:")
    if not run.is_local:
        con.register_filesystem(run.fs)
    return con


def parquet_source(run: RunFS, records: list[dict]) -> str:
    """A ``read_parquet([...])`` expression over the given file records (union by column name)."""
    uris = ", ".join("'" + run.holding(r).uri(r["path"]).replace("'", "''") + "'" for r in records)
    return f"read_parquet([{uris}], union_by_name = true)"


def create_view(con: duckdb.DuckDBPyConnection, run: RunFS, name: str, records: list[dict], empty_sql: str) -> None:
    """A view ``name`` over ``records``; ``empty_sql`` (a typed empty SELECT) when there are none yet."""
    body = f"SELECT * FROM {parquet_source(run, records)}" if records else empty_sql
    con.execute(f"CREATE OR REPLACE VIEW {name} AS {body}")
