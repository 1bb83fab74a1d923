import typer

from gndpo.cli.app import app
from gndpo.cli.common import user_errors
from gndpo.pipeline.exec.gc import collect_garbage
from gndpo.pipeline.run.run import open_run


@app.command()
@user_errors
def gc(
    run: str = typer.Argument(..., help="Run folder (local path or fsspec URL)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list what would be removed."),
):
    """Remove attempt folders that no commit record references (crashed or losing attempts)."""
    removed = collect_garbage(open_run(run), dry_run=dry_run)
    for path in removed:
        typer.echo(("would remove " if dry_run else "removed ") + path)
    typer.echo(f"{len(removed)} attempt folder(s) {'to remove' if dry_run else 'removed'}")
