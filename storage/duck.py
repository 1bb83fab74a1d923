"""DuckDB over committed shards: a connection that can read the run's filesystem, and views built
from manifests (never from globbing data folders, so uncommitted or losing attempts are invisible)."""

from __future__ import annotations

import duckdb

from gndpo.storage.products import FileRecord
from gndpo.storage.runfs import RunFS


def connect(run: RunFS, threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory connection that reads ``run``'s filesystem. ``threads=1`` makes every float sum
    add its rows in one fixed order: DuckDB's parallel sums combine per-thread partial sums in whatever
    order the threads finish, so two runs' means differ in the last bits (GNDPO's c_mean by 1.7e-15,
    enough to change a trained round's weights and a demo's final accuracy by 0.002)."""
    con = duckdb.connect(":memory:", config={"threads": threads} if threads else {})
    if not run.is_local:
        con.register_filesystem(run.fs)
    return con


def _sql_list(values: list[str]) -> str:
    return "[" + ", ".join("'" + v.replace("'", "''") + "'" for v in values) + "]"


def lock(con: duckdb.DuckDBPyConnection, readable: list[str] | None) -> None:
    """Freeze the connection's settings (a query cannot change them, attach a database or install an
    extension) and, unless ``readable`` is None, let queries open no file but those: the committed
    shards the views read. ``read_csv('/etc/passwd')``, ``glob`` over the run folder or a read of an
    uncommitted attempt's file are refused."""
    if readable is not None:
        con.execute(f"SET allowed_paths = {_sql_list(readable)}")
        con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def record_uris(run: RunFS, records: list[FileRecord]) -> list[str]:
    """The URLs DuckDB opens the given file records at (a forked run's inherited ones in its parent)."""
    return [run.holding(r).uri(r.path) for r in records]


def parquet_source(run: RunFS, records: list[FileRecord]) -> str:
    """A ``read_parquet([...])`` expression over the given file records (union by column name)."""
    return uris_source(record_uris(run, records))


def uris_source(uris: list[str]) -> str:
    """A ``read_parquet([...])`` expression over the Parquet files at ``uris`` (union by column name)."""
    return f"read_parquet({_sql_list(uris)}, union_by_name = true)"


def create_view(con: duckdb.DuckDBPyConnection, run: RunFS, name: str, records: list[FileRecord], empty_sql: str) -> None:
    """A view ``name`` over ``records``; ``empty_sql`` (a typed empty SELECT) when there are none yet."""
    body = f"SELECT * FROM {parquet_source(run, records)}" if records else empty_sql
    con.execute(f"CREATE OR REPLACE VIEW {name} AS {body}")
