import typer

from gndpo.cli.common import echo_table, user_errors
from gndpo.pipeline.exec.status import phase_rows, stage_rows
from gndpo.pipeline.run.run import open_run


@user_errors
def status(
    run: str = typer.Argument(..., help="Run folder (local path or fsspec URL)."),
    phases: bool = typer.Option(False, "--phases", help="Where each stage's time went instead: seconds per phase "
                                "(setup, compute, write, checkpoint, export, state) and MB written."),
):
    """Per round and stage: units planned / claimed / stale / done, rows, tokens, time."""
    echo_table((phase_rows if phases else stage_rows)(open_run(run)))
