"""Each stored row is declared once: the rollout shard's schema is its row class's, and `gndpo sql`'s
views show exactly the declared columns (scores with the round the view adds), on a run with rows and
on one without."""

from __future__ import annotations

import dataclasses

import pytest

from gndpo.pipeline.observe.sql import run_connection
from gndpo.pipeline.run.run import open_run
from gndpo.storage.rows import RolloutRow, arrow_schema
from gndpo.storage.shards import ROLLOUTS, SCORES, STATS
from tests.conftest import invoke_ok, run_stages


def view_columns(run_dir) -> dict[str, list[str]]:
    con = run_connection(open_run(str(run_dir)))
    return {view: [row[0] for row in con.execute(f"DESCRIBE {view}").fetchall()] for view in ("rollouts", "scores", "stats")}


def declared() -> dict[str, list[str]]:
    return {"rollouts": [f.name for f in dataclasses.fields(RolloutRow)], "scores": [*SCORES.names, "round"], "stats": STATS.names}


def test_the_rollout_schema_is_its_row_class():
    assert ROLLOUTS == arrow_schema(RolloutRow)
    assert ROLLOUTS.names == [f.name for f in dataclasses.fields(RolloutRow)]
    fields = {f.name: 0 for f in dataclasses.fields(RolloutRow)}
    with pytest.raises(TypeError, match="reward_sum"):  # a misspelled column fails where the row is made
        RolloutRow(**{**fields, "reward_sum": 1.0})


@pytest.mark.slow
def test_the_sql_views_show_the_declared_columns(rolled_out, tmp_path):
    """Before any row (the views' empty tables) and after a round's rollout, score and normalize."""
    new = tmp_path / "run"
    invoke_ok("fork", rolled_out, new, "--from-round", "0")
    assert view_columns(new) == declared()  # the fork has its parent's rollouts, no scores or statistics yet
    run_stages(new, "score", "normalize")
    assert view_columns(new) == declared()
