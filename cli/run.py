import typer

from gndpo.cli.app import app
from gndpo.cli.common import user_errors
from gndpo.pipeline.rounds import run_rounds


@app.command()
@user_errors
def run(
    run: str = typer.Argument(..., help="Run folder (local path or fsspec URL)."),
    rounds: int = typer.Option(3, "--rounds", "-n", help="Total number of rounds the run should have."),
):
    """Run the round loop; stages already committed are skipped, so rerunning resumes."""
    run_rounds(run, rounds, log=typer.echo)
