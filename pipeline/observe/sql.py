"""Read-only SQL over a run: DuckDB views rollouts, scores, tokens, stats, metrics built from manifests,
and prompts (the run's prompt tables).

Only committed files are visible (the views list manifest entries, never globbed folders). Every view has
a ``round`` column (score shards do not store one: the view adds it from the manifest the shard came
from). The connection accepts SELECT-like statements only and its configuration is locked afterwards,
so a query cannot write files (COPY, EXPORT), attach databases or change settings; and it opens no file
but the committed shards the views list unless the user passes ``--allow-files``.
"""

from __future__ import annotations

import duckdb
import polars as pl
import pyarrow as pa

from gndpo.errors import GndpoError
from gndpo.pipeline.observe.metrics import collect_metrics, committed_rounds
from gndpo.pipeline.run import products
from gndpo.pipeline.run.run import PROMPT_SPLITS
from gndpo.storage.duck import connect, create_view, lock, parquet_source, record_uris, uris_source
from gndpo.storage.shards import ROLLOUTS, SCORES, STATS

READ_ONLY = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


# One row per response token: what the student sampled and both models' log-probs of it. Tool and
# template tokens are here too, with loss_mask 0.
TOKENS_VIEW = """
    SELECT r.round, r.rollout_id, r.prompt_id, unnest(range(len(r.response_token_ids))) AS t,
           unnest(r.response_token_ids) AS token_id, unnest(r.loss_mask) AS loss_mask,
           unnest(r.sampler_logprobs) AS sampler_logprob, unnest(s.teacher_logprobs) AS teacher_logprob,
           unnest(s.student_logprobs) AS student_logprob
    FROM rollouts r JOIN scores s USING (round, rollout_id)
"""


def run_connection(run, allow_files: bool = False) -> duckdb.DuckDBPyConnection:
    """A connection with the run's views, its settings locked and, unless ``allow_files``, no file
    readable but the committed shards the views list (:func:`gndpo.storage.duck.lock`)."""
    con = connect(run.fs)
    rollout_files, score_files, stats_files, score_rounds = [], [], [], []
    for r in range(committed_rounds(run)):
        rollouts, scores, stats = (run.records(r, product).manifest() for product in (products.ROLLOUTS, products.SCORES, products.STATISTICS))
        rollout_files += rollouts.row_files() if rollouts is not None else []
        stats_files += stats.row_files() if stats is not None else []
        if scores is not None:
            score_files += scores.row_files()
            score_rounds.append(f"SELECT *, {r}::INTEGER AS round FROM {parquet_source(run.fs, scores.row_files())}")
    for view, files, schema in (("rollouts", rollout_files, ROLLOUTS), ("stats", stats_files, STATS)):
        con.register(f"empty_{view}", schema.empty_table())
        create_view(con, run.fs, view, files, f"SELECT * FROM empty_{view}")
    con.register("empty_scores", SCORES.append(pa.field("round", pa.int32())).empty_table())
    con.execute("CREATE VIEW scores AS " + (" UNION ALL BY NAME ".join(score_rounds) or "SELECT * FROM empty_scores"))
    con.execute(f"CREATE VIEW tokens AS {TOKENS_VIEW}")
    rows = collect_metrics(run)
    metrics = pl.DataFrame(rows, infer_schema_length=None) if rows else pl.DataFrame(schema={"round": pl.Int64, "stage": pl.Utf8})
    con.register("metrics_table", metrics.to_arrow())
    con.execute("CREATE VIEW metrics AS SELECT * FROM metrics_table")
    # The prompt tables init wrote, read where they are, with a split column: which question, answer
    # and pictures (their ids under RUN/images/) a rollout's prompt_id names.
    prompt_tables = {split: run.fs.uri(f"prompts/{split}.parquet") for split in PROMPT_SPLITS}
    con.execute("CREATE VIEW prompts AS " + " UNION ALL BY NAME ".join(
        f"SELECT *, '{split}' AS split FROM {uris_source([uri])}" for split, uri in prompt_tables.items()))
    committed = record_uris(run.fs, rollout_files + score_files + stats_files)
    lock(con, None if allow_files else [*committed, *prompt_tables.values()])
    return con


def sql_error(exc: duckdb.Error) -> GndpoError:
    """DuckDB's message on one line, its "Did you mean ...?" hint kept, the query echo ("LINE 1: ...")
    and its caret line left out. A refused file read says how to allow it."""
    lines = [line.strip() for line in str(exc).splitlines()]
    text = " ".join(line for line in lines if line and not line.startswith("LINE ") and set(line) != {"^"})
    if "disabled by configuration" in text:
        text += " (gndpo sql reads the run's committed shards only; --allow-files lets a query open other files)"
    return GndpoError(f"SQL error: {text}")


def query(run, sql: str, allow_files: bool = False):
    """Run one read-only statement; returns a polars DataFrame."""
    con = run_connection(run, allow_files)
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise sql_error(exc) from None
    if len(statements) != 1:
        raise GndpoError("give exactly one SQL statement")
    if statements[0].type not in READ_ONLY:
        raise GndpoError(f"only read-only queries are allowed (got {statements[0].type.name})")
    try:
        return con.sql(sql).pl()
    except duckdb.Error as exc:
        raise sql_error(exc) from None
