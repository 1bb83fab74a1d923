import typer

from gndpo.cli.common import echo_table, user_errors
from gndpo.pipeline.exec.status import phase_rows, stage_rows, worker_lines
from gndpo.pipeline.run.run import open_run


@user_errors
def status(
    run: str = typer.Argument(..., help="Run folder (local path or fsspec URL)."),
    phases: bool = typer.Option(False, "--phases", help="Where each stage's time went instead: seconds per phase "
                                "(setup, compute, write, checkpoint, export, state) and MB written."),
):
    """Per round and stage: units planned / claimed / stale / done, rows, tokens, time; then each live
    score worker's teacher servers (score.backend server)."""
    opened = open_run(run)
    echo_table((phase_rows if phases else stage_rows)(opened))
    for line in [] if phases else worker_lines(opened):  # what the live workers say of themselves (teacher servers)
        typer.echo(line)
