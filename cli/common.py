"""What every command shares: user errors, filesystem errors and stop signals as one line and a non-zero
exit, a traceback only when asked for (``--log-level debug``); settings written ``key=value`` after a
command's arguments, and the notice an old spelling (``--set``, ``-n``) gets."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import re
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

    The notices of old spellings the command met (:func:`notice`) follow on stderr when it succeeds.

    At ``--log-level debug`` the traceback comes first, with the exception it was raised from (``raise
    GndpoError(...) from exc``): the out-of-memory or library failure behind a one-line "cannot load a
    model" stays findable."""
    if fn is None:
        return functools.partial(user_errors, resumable=resumable)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        NOTICES.clear()
        try:
            result = fn(*args, **kwargs)
        except (GndpoError, OSError) as exc:
            NOTICES.clear()  # the error is the one line to read; an old spelling's notice comes once it runs
            _debug_traceback(exc)
            print(f"error: {exc if isinstance(exc, GndpoError) else describe_os_error(exc)}", file=sys.stderr)
            raise typer.Exit(1) from None
        except (KeyboardInterrupt, Stopped) as exc:
            NOTICES.clear()
            signum = signal_of(exc)
            _debug_traceback(exc)
            if not os.environ.get(STAGE_OF_RUN_ENV):
                print(stopped_line(signum, resumable), file=sys.stderr)
            raise typer.Exit(exit_code(signum)) from None
        for line in NOTICES:
            print(line, file=sys.stderr)
        NOTICES.clear()
        return result

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


# A setting on the command line: a dotted config key, "=", its value (YAML). Keys are identifiers (a
# teachers name may hold "-"), so a path or a compare entry (METHOD+key=value) never reads as one.
SETTING = re.compile(r"[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*=")


def is_setting(argument: str) -> bool:
    """Whether a command-line argument is a ``key=value`` setting."""
    return SETTING.match(argument) is not None


# The notices of the command running: :func:`user_errors` prints them on stderr when it ends, and drops
# them when it fails (its one-line error is then the only line) or is stopped.
NOTICES: list[str] = []


def notice(old: str, new: str) -> None:
    """The one line an old spelling gets: it still works, and this is how to write it now."""
    NOTICES.append(f"notice: {old} is deprecated; {new}")


def split_settings(arguments: list[str] | None) -> tuple[list[str], list[str]]:
    """(the arguments that are not settings, the ``key=value`` settings), each in order."""
    arguments = arguments or []
    return [a for a in arguments if not is_setting(a)], [a for a in arguments if is_setting(a)]


def settings_with(settings: list[str], old: list[str] | None, option: str = "--set") -> list[str]:
    """``settings`` (written ``key=value`` after the arguments) after those of an old repeatable
    ``option`` (which get a notice), so the new spelling wins where both set a key."""
    if old:
        notice(option, "write key=value after the arguments")
    return [*(old or []), *settings]


def rounds_of(rounds: int | None, old: int | None, default: int = 3) -> int:
    """The round count of ``--rounds`` or its old short form ``-n`` (with a notice: ``-n`` also reads
    as samples, rollout.n), else ``default``."""
    if old is None:
        return default if rounds is None else rounds
    if rounds is not None and rounds != old:
        raise GndpoError(f"--rounds {rounds} and -n {old} disagree; give --rounds once")
    notice("-n", f"write --rounds {old} (-n reads like rollout.n, the samples per prompt)")
    return old
