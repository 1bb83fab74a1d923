"""The `gndpo` command: a Typer app whose commands live one per module in this package."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="gndpo",
    help="Offline, resumable, round-based on-policy distillation with cached teacher scores.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    # Importing a command module registers its command on `app`.
    from gndpo.cli import compare, demo, eval, fork, gc, init, methods, run, sql, stages, status  # noqa: F401


def main() -> None:
    _register()
    app()


if __name__ == "__main__":
    main()
