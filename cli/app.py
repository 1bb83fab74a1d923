"""The `gndpo` command: a Typer app whose commands live one per module in this package."""

from __future__ import annotations

import os
import sys

import typer

from gndpo.pipeline.observe import logs

app = typer.Typer(
    name="gndpo",
    help="Offline, resumable, round-based on-policy distillation with cached teacher scores.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def options(
    log_level: str = typer.Option(
        None, "--log-level", help="debug | info (default) | warning | error. debug also shows vLLM's and DeepSpeed's own messages."
    ),
    progress: str = typer.Option(
        None, "--progress", help="auto (default: a bar on a terminal, plain lines otherwise) | bar | lines | none."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress and only warnings and errors (--progress none --log-level warning)."),
):
    """Offline, resumable, round-based on-policy distillation with cached teacher scores."""
    if quiet:
        log_level, progress = log_level or "warning", progress or "none"
    # Also for the stage processes `gndpo run` starts: they read the same settings from the environment.
    for name, value in (("GNDPO_LOG_LEVEL", log_level), ("GNDPO_PROGRESS", progress)):
        if value is not None:
            os.environ[name] = value
    try:
        logs.configure()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None


def _register() -> None:
    # Importing a command module registers its command on `app`.
    from gndpo.cli import compare, convert, demo, eval, fork, gc, init, methods, report, run, sql, stages, status  # noqa: F401


def main() -> None:
    _register()
    app()


if __name__ == "__main__":
    main()
