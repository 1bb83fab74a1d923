import typer

from gndpo.cli.app import app
from gndpo.cli.common import echo_table, user_errors
from gndpo.pipeline.run.run import open_run
from gndpo.pipeline.exec.status import stage_rows


@app.command()
@user_errors
def status(run: str = typer.Argument(..., help="Run folder (local path or fsspec URL).")):
    """Per round and stage: units planned / claimed / stale / done, rows, tokens, time."""
    echo_table(stage_rows(open_run(run)))
