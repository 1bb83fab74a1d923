"""What every command shares: user errors as one line and a non-zero exit, a traceback only when asked
for (``--log-level debug``)."""

from __future__ import annotations

import functools
import logging
import sys
import traceback

import typer

from gndpo.errors import GndpoError
from gndpo.storage.tables import encode_frame


def user_errors(fn):
    """Print a GndpoError as ``error: ...`` on stderr and exit 1. At ``--log-level debug`` its traceback
    comes first, with the exception it was raised from (``raise GndpoError(...) from exc``): the
    out-of-memory or library failure behind a one-line "cannot load a model" stays findable."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GndpoError as exc:
            if logging.getLogger("gndpo").isEnabledFor(logging.DEBUG):
                traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(1) from None

    return wrapper


def echo_frame(df) -> None:
    """Print a polars DataFrame as an aligned text table (no truncation, no shape line)."""
    typer.echo(encode_frame(df, "table").decode(), nl=False)


def echo_table(rows: list[dict]) -> None:
    """Print rows as an aligned text table."""
    import polars as pl

    if not rows:
        typer.echo("(no rows)")
        return
    echo_frame(pl.DataFrame(rows))
