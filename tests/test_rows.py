"""Each stored row is declared once: a shard's schema is its row class's, and `gndpo sql`'s views show
exactly the declared columns (scores with the round the view adds), on a run with rows and on one
without."""

from __future__ import annotations

import dataclasses

import pytest

from gndpo.pipeline.observe.sql import run_connection
from gndpo.pipeline.run.run import open_run
from gndpo.storage.rows import RolloutRow, ScoreRow, StatRow, arrow_schema
from gndpo.storage.shards import ROLLOUTS, SCORES, STATS
from tests.conftest import invoke_ok, run_stages


def view_columns(run_dir) -> dict[str, list[str]]:
    con = run_connection(open_run(str(run_dir)))
    return {view: [row[0] for row in con.execute(f"DESCRIBE {view}").fetchall()] for view in ("rollouts", "scores", "stats")}


def fields(row: type) -> list[str]:
    return [f.name for f in dataclasses.fields(row)]


def declared() -> dict[str, list[str]]:
    """Each view's columns as the row classes declare them (score shards store no round: the view adds it)."""
    return {"rollouts": fields(RolloutRow), "scores": [*fields(ScoreRow), "round"], "stats": fields(StatRow)}


def test_each_shard_schema_is_its_row_class():
    for schema, row in ((ROLLOUTS, RolloutRow), (SCORES, ScoreRow), (STATS, StatRow)):
        assert schema == arrow_schema(row) and schema.names == fields(row)
    values = {name: 0 for name in fields(RolloutRow)}
    with pytest.raises(TypeError, match="reward_sum"):  # a misspelled column fails where the row is made
        RolloutRow(**{**values, "reward_sum": 1.0})


@pytest.mark.slow
def test_the_sql_views_show_the_declared_columns(rolled_out, tmp_path):
    """Before any row (the views' empty tables) and after a round's rollout, score and normalize."""
    new = tmp_path / "run"
    invoke_ok("fork", rolled_out, new, "--from-round", "0")
    assert view_columns(new) == declared()  # the fork has its parent's rollouts, no scores or statistics yet
    run_stages(new, "score", "normalize")
    assert view_columns(new) == declared()
