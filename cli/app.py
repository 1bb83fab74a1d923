"""The `gndpo` command: a Typer app whose commands live one per module in this package.

Each command module exports plain functions (their parameters are the command's options) and knows
nothing of ``app``; :func:`register` adds them here, in the order ``gndpo --help`` lists them. The
entry points (``gndpo``, ``python -m gndpo``) call :func:`main`, which registers first.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from importlib import metadata
from typing import NoReturn

import typer
import typer.core

# Typer (0.26.0 and later) ships its own copy of click, whose exception classes only this module names.
from typer._click import exceptions as click_errors

from gndpo.pipeline.exec.signals import follow_owner, stop_on_signals
from gndpo.pipeline.observe import logs

# A vLLM engine process spawned from `gndpo` imports this module first (as its main module's import):
# from then on it dies with the gndpo process it serves. Anywhere else this does nothing.
follow_owner()
logs.silence_harmless_warnings()


class OneLineErrors(typer.core.TyperGroup):
    """The ``gndpo`` group, whose usage mistakes (an unknown command or option, a missing argument, a
    value that does not parse) are one ``error:`` line with click's "did you mean" and a pointer to
    ``--help``, exit 2, instead of a framed usage block. Commands' own failures are
    :func:`gndpo.cli.common.user_errors`'."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_errors.NoArgsIsHelpError as exc:
            # The error is built from ctx.get_help(), which draws the help itself where rich formats it
            # (and returns ""): showing ctx.get_help() here as well drew it twice.
            if exc.format_message():
                typer.echo(exc.format_message())
            code = 2
        except click_errors.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "gndpo"
            message = " ".join(exc.format_message().split())
            print(f"error: {message} (see {where} --help)", file=sys.stderr)
            code = exc.exit_code
        except click_errors.ClickException as exc:
            print(f"error: {' '.join(exc.format_message().split())}", file=sys.stderr)
            code = exc.exit_code
        except typer.Abort:  # Ctrl-C before a command started
            print("stopped by SIGINT", file=sys.stderr)
            code = 130
        code = code if isinstance(code, int) else 0  # a command's return value is not an exit code
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=OneLineErrors,
    name="gndpo",
    help="Offline, resumable, round-based on-policy distillation with cached teacher scores.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def version_of(package: str = "gndpo") -> str:
    """The installed package's version (its metadata), or "unknown" for a source tree that is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def print_version(asked: bool) -> None:
    """``gndpo --version``: print ``gndpo X.Y.Z`` and exit before any command runs."""
    if asked:
        typer.echo(f"gndpo {version_of()}")
        raise typer.Exit(0)


@app.callback()
def options(
    log_level: str = typer.Option(
        None, "--log-level", help="debug | info (default) | warning | error. debug also shows vLLM's and DeepSpeed's own messages."
    ),
    progress: str = typer.Option(
        None, "--progress", help="auto (default: a bar on a terminal, plain lines otherwise) | bar | lines | none."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress and only warnings and errors (--progress none --log-level warning)."),
    version: bool = typer.Option(False, "--version", is_eager=True, expose_value=False, callback=print_version, help="Print gndpo's version and exit."),
):
    """Offline, resumable, round-based on-policy distillation with cached teacher scores."""
    if quiet:
        log_level, progress = log_level or "warning", progress or "none"
    stop_on_signals()  # SIGTERM and SIGUSR1 unwind like Ctrl-C: leases released, one line (cli.common)
    try:
        logs.configure(log_level, progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    # Also for the stage processes `gndpo run` starts: they read the same settings from the environment.
    for name, value in (("GNDPO_LOG_LEVEL", log_level), ("GNDPO_PROGRESS", progress)):
        if value is not None:
            os.environ[name] = value


def register() -> None:
    """Add every command to ``app`` (once; calling it again does nothing)."""
    if app.registered_commands:
        return
    # Imported here rather than at the top: vLLM's engine processes re-import the entry module (this
    # one, through cli.__main__ or the package's __main__) and must not pay for every command's imports.
    from gndpo.cli import compare, config, convert, demo, eval, export, fork, gc, init, methods, recipe, report, run, sql, stages, status

    commands = [
        ("init", init.init), *stages.STAGE_COMMANDS.items(), ("run", run.run), ("status", status.status), ("sql", sql.sql),
        ("eval", eval.eval_command), ("report", report.report), ("demo", demo.demo), ("compare", compare.compare),
        ("recipe", recipe.recipe), ("fork", fork.fork), ("export", export.export), ("gc", gc.gc), ("convert", convert.convert),
        ("methods", methods.methods),
    ]
    for name, function in commands:
        app.command(name=name)(function)
    config_group = typer.Typer(name="config", help="The config: the whole of one (show), every key there is (keys).", no_args_is_help=True)
    config_group.command(name="show")(config.show)
    config_group.command(name="keys")(config.keys)
    app.add_typer(config_group, name="config")


def main() -> None:
    """The ``gndpo`` program: the command's exit status, once its exit handlers have run."""
    register()
    exit_without_teardown(app(standalone_mode=False))


def exit_without_teardown(code: int) -> NoReturn:
    """End the process with ``code`` as the interpreter would, less its last step. The interpreter waits
    for non-daemon threads, runs the exit handlers (logging's shutdown, W&B's finish, vLLM's engine
    shutdown, multiprocessing's children), flushes stdout and stderr, and then tears every module down
    one by one: with torch, vLLM and DeepSpeed loaded that last step alone takes about 3 s of a
    stage process's life, and nothing depends on it (a command returns only after what it wrote is
    closed and committed). So this does the first three and skips the fourth."""
    threading._shutdown()  # what the interpreter does first at exit: join non-daemon threads, stop executors
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (| head), a stream already closed
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
