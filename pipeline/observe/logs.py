"""Logging: what a person sees on the terminal, and one file per worker that keeps everything.

gndpo's own messages go through the ``gndpo`` logger. :func:`configure` (called once per process by the
CLI) sends them to stderr at the chosen level (``--log-level`` or ``GNDPO_LOG_LEVEL``), through rich
when progress bars are drawn so lines appear above the bars. Libraries (vLLM, DeepSpeed, torch,
transformers, Python warnings) are routed into the same handlers, but on the terminal only their errors
show, unless the level is DEBUG: their INFO and WARNING chatter stays out of the way, and stays in the
file.

:func:`worker_file` adds a log file for the duration of a stage or a run, named after host and pid in
the run's log folder; every line carries host, pid and the unit being computed (:func:`unit_context`).
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import os
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from gndpo.pipeline.observe import progress

LEVELS = ("debug", "info", "warning", "error")
# Libraries whose own handlers are replaced by ours (they print to stdout by default).
LIBRARY_LOGGERS = ("DeepSpeed", "deepspeed", "torch", "transformers", "accelerate", "py.warnings")
_unit = contextvars.ContextVar("gndpo_unit", default="-")
_cleanup_registered: list[str] = []
FILE_ONLY = {"terminal": False}  # ``extra=`` for a line that belongs in the worker's file, not on the terminal
log = logging.getLogger("gndpo")
# A worker file's line; vLLM's own processes write to the same file with host filled in and no unit.
FILE_FORMAT = "%(asctime)s %(levelname)s host=%(host)s pid=%(process)d unit=%(unit)s %(name)s: %(message)s"


def info(message: str) -> None:
    """Log ``message`` at INFO on the gndpo logger: the default ``log`` callback of stages and loops."""
    log.info(message)


class _Context(logging.Filter):
    """Adds host and unit to every record (pid is logging's own ``process``)."""

    host = socket.gethostname()

    def filter(self, record: logging.LogRecord) -> bool:
        record.host, record.unit = self.host, _unit.get()
        return True


class _Stderr(logging.StreamHandler):
    """A handler on whatever ``sys.stderr`` is when a record is written (test runners swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


class _TerminalFilter(logging.Filter):
    """gndpo's records at the handler's level; other libraries' only from ERROR, unless debugging."""

    def __init__(self, debug: bool):
        super().__init__()
        self.debug = debug

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or self.debug:
            return True
        ours = record.name == "gndpo" or record.name.startswith("gndpo.")
        return ours and getattr(record, "terminal", True)


def resolve_level(level: str | None = None) -> int:
    name = (level or os.environ.get("GNDPO_LOG_LEVEL", "info")).lower()
    if name not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {name!r}")
    return getattr(logging, name.upper())


# Warnings a library gives on every start that say nothing about the run: logger -> why it is harmless.
HARMLESS_WARNINGS = {
    "vllm.triton_utils.importing": "vLLM's CPU build says Triton has no CPU backend; its CPU kernels do not use Triton",
}


def silence_harmless_warnings() -> None:
    """Let only errors through :data:`HARMLESS_WARNINGS`' loggers. Called when gndpo's CLI module is
    imported, which is also the first import of every vLLM process spawned from gndpo. A filter, not a
    level: vLLM's logging configuration resets its child loggers' levels, but keeps their filters."""
    for name in HARMLESS_WARNINGS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ErrorsOnly) for f in logger.filters):
            logger.addFilter(_ErrorsOnly())


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def adopt_library_loggers() -> None:
    """Make libraries that install their own stdout handlers (vLLM, DeepSpeed) log through ours instead.
    Called again after a library is imported late (DeepSpeed in train)."""
    for name in LIBRARY_LOGGERS:
        lib = logging.getLogger(name)
        for handler in list(lib.handlers):
            lib.removeHandler(handler)
        lib.propagate = True
        if lib.level == logging.NOTSET or lib.level < logging.INFO:
            lib.setLevel(logging.INFO)


def quiet_libraries() -> None:
    """Keep libraries' chatter off the terminal, in this process and the ones it starts (vLLM's engine
    core, torchrun's ranks, the stage processes of ``gndpo run``), which read these when they start.
    vLLM's loggers follow :func:`vllm_logging_config`: errors to stderr, everything into the worker's
    log file. A variable the user set is left alone."""
    for name, value in (
        ("PYTHONWARNINGS", "ignore"),  # children's Python warnings (this process's are captured below)
        ("TORCH_CPP_LOG_LEVEL", "ERROR"),
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),  # transformers' and the hub's tqdm bars
        ("TQDM_DISABLE", "1"),  # vLLM's and DeepSpeed's own tqdm bars (tqdm reads TQDM_* as defaults)
    ):
        os.environ.setdefault(name, value)
    if "VLLM_LOGGING_CONFIG_PATH" not in os.environ:
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = vllm_logging_config(None)
    if "transformers" in sys.modules:  # imported before the variable was set: it read it already
        sys.modules["transformers"].utils.logging.disable_progress_bar()  # "Writing model shards" bars


def vllm_logging_config(log_file: str | None) -> str:
    """A logging dictConfig file for vLLM (it applies ``VLLM_LOGGING_CONFIG_PATH`` in every process it
    starts, its engine core included): errors to stderr, and with ``log_file`` everything from INFO
    appended to it. Written to this process's own temporary file (replaced on each call, removed at
    exit: children read it when they start); returns its path."""
    import json

    handlers = {"terminal": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "level": "ERROR", "formatter": "plain"}}
    if log_file:
        handlers["file"] = {"class": "logging.FileHandler", "filename": log_file, "level": "INFO", "formatter": "file"}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s", "datefmt": "%H:%M:%S"},
            "file": {"format": FILE_FORMAT.replace("%(host)s", _Context.host).replace("%(unit)s", "-")},
        },
        "handlers": handlers,
        "loggers": {"vllm": {"handlers": list(handlers), "level": "INFO", "propagate": False}},
    }
    path = f"{tempfile.gettempdir()}/gndpo-vllm-logging-{os.getpid()}.json"
    tmp = f"{path}.{time.monotonic_ns()}"
    with open(tmp, "w") as f:
        json.dump(config, f)
    os.replace(tmp, path)  # a child starting now reads the old or the new config, never half of one
    if not _cleanup_registered:
        atexit.register(lambda: Path(path).unlink(missing_ok=True))
        _cleanup_registered.append(path)
    return path


def configure(level: str | None = None, progress_mode: str | None = None) -> None:
    """Set up this process's terminal logging and progress mode (idempotent)."""
    numeric = resolve_level(level)
    mode = progress.configure(progress_mode)
    if numeric > logging.DEBUG:
        quiet_libraries()
    logging.captureWarnings(True)
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if numeric <= logging.DEBUG else logging.INFO)
    for handler in [h for h in root.handlers if getattr(h, "_gndpo_terminal", False)]:
        root.removeHandler(handler)
    if mode == "bar":
        from rich.logging import RichHandler

        handler = RichHandler(console=progress.console(), show_path=False, show_level=numeric <= logging.DEBUG, markup=False)
        handler.setFormatter(logging.Formatter("%(message)s", datefmt="[%X]"))
    else:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))
    handler._gndpo_terminal = True
    handler.setLevel(numeric)
    handler.addFilter(_TerminalFilter(debug=numeric <= logging.DEBUG))
    root.addHandler(handler)
    # The terminal shows the chosen level; the worker's file keeps gndpo's INFO lines whatever it is.
    log.setLevel(min(numeric, logging.INFO))
    adopt_library_loggers()


@contextmanager
def worker_file(folder: str, name: str, copy_to=None):
    """Also log to ``folder/<UTC time>-<host>-<pid>-<name>.log`` (everything at the configured level,
    libraries' warnings included) until the block ends; yields the file's path. Inside another
    worker_file block (the stages of an in-process ``gndpo run``) the open file is used. ``copy_to``: a
    RunFS (a run on object storage) that receives the finished file under ``logs/``."""
    root = logging.getLogger()
    already = next((h for h in root.handlers if getattr(h, "_gndpo_worker_file", False)), None)
    if already is not None:
        yield already.baseFilename
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = f"{folder}/{stamp}-{_Context.host}-{os.getpid()}-{name}.log"
    handler = logging.FileHandler(path)
    handler._gndpo_worker_file = True
    handler.setFormatter(logging.Formatter(FILE_FORMAT))
    handler.setLevel(min(log.getEffectiveLevel(), logging.INFO))
    handler.addFilter(_Context())
    # vLLM's loggers do not propagate once vLLM configured them (imported before this block): they get
    # the file too. For a vLLM imported later (here or in a child), its logging config names the file.
    owners = [root] + [lib for lib in (logging.getLogger("vllm"),) if not lib.propagate]
    for owner in owners:
        owner.addHandler(handler)
    ours = os.environ.get("VLLM_LOGGING_CONFIG_PATH", "").startswith(f"{tempfile.gettempdir()}/gndpo-vllm-logging-")
    if ours:
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = vllm_logging_config(path)
    try:
        yield path
    finally:
        for owner in owners:
            owner.removeHandler(handler)
        handler.close()
        if ours:
            os.environ["VLLM_LOGGING_CONFIG_PATH"] = vllm_logging_config(None)
        if copy_to is not None:
            copy_to.write_new(f"logs/{Path(path).name}", Path(path).read_bytes())


@contextmanager
def unit_context(unit: str):
    """Log lines written inside the block name ``unit``."""
    token = _unit.set(unit)
    try:
        yield
    finally:
        _unit.reset(token)
