"""Read-only SQL over a run: DuckDB views rollouts, scores, stats, metrics built from manifests.

Only committed files are visible (the views list manifest entries, never globbed folders). The
connection accepts SELECT-like statements only and its configuration is locked afterwards, so a query
cannot write files (COPY, EXPORT), attach databases or change settings.
"""

from __future__ import annotations

import duckdb
import polars as pl

from gndpo.errors import GndpoError
from gndpo.pipeline.metrics import collect_metrics, committed_rounds
from gndpo.storage.duck import connect, create_view
from gndpo.storage.records import manifest_files, rollout_shards
from gndpo.storage.shards import ROLLOUTS, SCORES, STATS

READ_ONLY = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


def run_connection(run) -> duckdb.DuckDBPyConnection:
    con = connect(run.fs)
    files = {"rollout": [], "score": [], "normalize": []}
    for r in range(committed_rounds(run)):
        for stage in files:
            m = run.records(r, stage).manifest()
            if m is not None:
                files[stage] += rollout_shards(m) if stage == "rollout" else manifest_files(m)
    for view, stage, schema in (("rollouts", "rollout", ROLLOUTS), ("scores", "score", SCORES), ("stats", "normalize", STATS)):
        con.register(f"empty_{view}", schema.empty_table())
        create_view(con, run.fs, view, files[stage], f"SELECT * FROM empty_{view}")
    rows = collect_metrics(run)
    metrics = pl.DataFrame(rows, infer_schema_length=None) if rows else pl.DataFrame(schema={"round": pl.Int64, "stage": pl.Utf8})
    con.register("metrics_table", metrics.to_arrow())
    con.execute("CREATE VIEW metrics AS SELECT * FROM metrics_table")
    con.execute("SET lock_configuration = true")
    return con


def query(run, sql: str):
    """Run one read-only statement; returns a polars DataFrame."""
    con = run_connection(run)
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise GndpoError(f"SQL error: {str(exc).splitlines()[0]}") from None
    if len(statements) != 1:
        raise GndpoError("give exactly one SQL statement")
    if statements[0].type not in READ_ONLY:
        raise GndpoError(f"only read-only queries are allowed (got {statements[0].type.name})")
    try:
        return con.sql(sql).pl()
    except duckdb.Error as exc:
        raise GndpoError(f"SQL error: {str(exc).splitlines()[0]}") from None
