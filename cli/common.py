"""What every command shares: user errors as one line and a non-zero exit, never a traceback."""

from __future__ import annotations

import functools
import sys

import typer

from gndpo.errors import GndpoError


def user_errors(fn):
    """Print a GndpoError as ``error: ...`` on stderr and exit 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GndpoError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(1) from None

    return wrapper


def echo_table(rows: list[dict]) -> None:
    """Print rows as an aligned text table (polars, no truncation)."""
    import polars as pl

    if not rows:
        typer.echo("(no rows)")
        return
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, fmt_str_lengths=60, tbl_hide_dataframe_shape=True):
        typer.echo(pl.DataFrame(rows))
