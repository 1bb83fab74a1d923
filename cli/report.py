from typing import Optional

import typer

from gndpo.cli.common import user_errors


@user_errors
def report(
    folder: str = typer.Argument(..., help="A run folder, a `gndpo demo` folder, or a `gndpo compare --out` folder."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Where to write report.html and its PNGs (default: FOLDER/report)."),
):
    """One self-contained HTML page (plus PNGs): per-round curves, rollouts coloured by where the teacher
    disagrees with the student, and the config."""
    from gndpo.apps.report import build_report  # at call time: torch and transformers load only for this command

    written = build_report(folder, out or f"{folder.rstrip('/')}/report")
    typer.echo(f"report: {written['html']} ({len(written['figures'])} figures)")
