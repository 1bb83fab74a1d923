"""What every command shares: user errors, filesystem errors and stop signals as one line and a non-zero
exit, a traceback only when asked for (``--log-level debug``)."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import shlex
import signal
import sys
import traceback

import typer

from gndpo.errors import GndpoError
from gndpo.pipeline.exec.signals import STAGE_OF_RUN_ENV, Stopped, exit_code, signal_of


def user_errors(fn=None, *, resumable: bool = False):
    """Turn what a user can cause or fix into one line on stderr and a non-zero exit:

    * a GndpoError: ``error: ...``, exit 1;
    * an OSError from any storage backend (permissions, a read-only or full disk, a file in the way):
      what happened, the path and what to do, exit 1;
    * a stop signal (Ctrl-C, SIGTERM, Slurm's SIGUSR1): exit 128 + its number; a ``resumable`` command
      says that committed work is kept and which command resumes it. A stage process that ``gndpo run``
      started exits without a word: ``gndpo run`` says it.

    At ``--log-level debug`` the traceback comes first, with the exception it was raised from (``raise
    GndpoError(...) from exc``): the out-of-memory or library failure behind a one-line "cannot load a
    model" stays findable."""
    if fn is None:
        return functools.partial(user_errors, resumable=resumable)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (GndpoError, OSError) as exc:
            _debug_traceback(exc)
            print(f"error: {exc if isinstance(exc, GndpoError) else describe_os_error(exc)}", file=sys.stderr)
            raise typer.Exit(1) from None
        except (KeyboardInterrupt, Stopped) as exc:
            signum = signal_of(exc)
            _debug_traceback(exc)
            if not os.environ.get(STAGE_OF_RUN_ENV):
                print(stopped_line(signum, resumable), file=sys.stderr)
            raise typer.Exit(exit_code(signum)) from None

    return wrapper


def _debug_traceback(exc: BaseException) -> None:
    if logging.getLogger("gndpo").isEnabledFor(logging.DEBUG):
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)


def stopped_line(signum: int, resumable: bool) -> str:
    """The one line a command stopped by ``signum`` prints."""
    name = signal.Signals(signum).name
    if not resumable:
        return f"stopped by {name}"
    command = shlex.join(["gndpo", *sys.argv[1:]])
    return f"stopped by {name}: the run is resumable, committed work is kept; to resume, run: {command}"


# What to do about the operating-system errors a user can fix, by errno.
OS_ERROR_ADVICE = {
    errno.EACCES: "permission denied: {path} (ask its owner for access, or use a folder you can write)",
    errno.EPERM: "operation not permitted: {path} (ask its owner for access, or use a folder you can write)",
    errno.EROFS: "read-only file system: {path} (use a writable folder)",
    errno.ENOSPC: "no space left on device: {path} (free some space or use another disk)",
    errno.EDQUOT: "disk quota exceeded: {path} (free some space or use another disk)",
    errno.EEXIST: "already exists: {path} (remove it or choose another path)",
    errno.ENOTDIR: "not a folder: {path} (a file is in the way; choose another path)",
    errno.EISDIR: "is a folder: {path} (give a file path)",
    errno.ENOENT: "no such file or folder: {path}",
}


def describe_os_error(exc: OSError) -> str:
    """``exc`` in one line: what happened, to which path, and what to do."""
    path = exc.filename
    if path is not None and exc.errno in OS_ERROR_ADVICE:
        return OS_ERROR_ADVICE[exc.errno].format(path=path)
    text = (exc.strerror or str(exc) or type(exc).__name__).strip().splitlines()[0]
    return f"{text}: {path}" if path is not None else text


@contextlib.contextmanager
def stdout_kept_for_data():
    """Send everything written to stdout while the block runs to stderr: libraries' prints (DeepSpeed's
    "built successfully", its logger's "[WARNING] real_accelerator ..."), C++ build output written to
    file descriptor 1, and the same from child processes, which inherit the descriptor. stdout then
    carries only what the command prints after the block: its tables, SQL results and JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def echo_frame(df) -> None:
    """Print a polars DataFrame as an aligned text table (no truncation, no shape line)."""
    from gndpo.storage.tables import encode_frame  # polars and pyarrow: only for commands that print a table

    typer.echo(encode_frame(df, "table").decode(), nl=False)


def echo_table(rows: list[dict]) -> None:
    """Print rows as an aligned text table."""
    import polars as pl

    if not rows:
        typer.echo("(no rows)")
        return
    echo_frame(pl.DataFrame(rows))
