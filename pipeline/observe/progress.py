"""Progress of long steps, for a person at a terminal and for a log file.

A step opens a :func:`task` (what it is, how many of what it will do) and advances it; counts it passes
(tokens, responses) are summed and shown with their rate, values it shows (loss, grad norm) replace the
previous ones. How that is drawn is decided once per process by :func:`configure`:

* ``bar``: a live rich progress bar on stderr (ETA, rates), log lines printed above it;
* ``lines``: a plain line at most every ``interval`` seconds and when the task ends, for CI and Slurm
  logs, where a redrawn bar would be garbage;
* ``none``: nothing;
* ``auto`` (default): ``bar`` when stderr is a terminal, else ``lines``.

The mode and interval also come from ``GNDPO_PROGRESS`` / ``GNDPO_PROGRESS_INTERVAL``, so the stage
processes ``gndpo run`` starts draw the way their parent was told to.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column

from gndpo.dist import Dist

MODES = ("auto", "bar", "lines", "none")
_log = logging.getLogger("gndpo.progress")


class _Terminal:
    """This process's stderr, as progress draws on it. One per process, and only that: there is one
    stderr, and rich draws one live display per console, so every open task's bar shares ``bar``.

    * ``mode``, ``interval``: how tasks are drawn, set by :func:`configure` (None until then: the first
      task configures from ``GNDPO_PROGRESS``);
    * ``console``: the rich console on stderr that bars and log lines share (made on first use);
    * ``bar``, ``open``: the live display and the ids of its tasks still open; the last task to close
      stops it."""

    def __init__(self):
        self.mode: str | None = None
        self.interval = 10.0
        self.console: Console | None = None
        self.bar: Progress | None = None
        self.open: set = set()


_terminal = _Terminal()


def console() -> Console:
    """The rich console on stderr that bars and log lines share."""
    if _terminal.console is None:
        _terminal.console = Console(stderr=True)
    return _terminal.console


def resolve_mode(mode: str | None = None) -> str:
    """``mode`` (or ``GNDPO_PROGRESS``) with ``auto`` decided by whether stderr is a terminal."""
    mode = mode or os.environ.get("GNDPO_PROGRESS", "auto")
    if mode not in MODES:
        raise ValueError(f"progress mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not Dist.from_env().main:  # one train rank draws for all of them
        return "none"
    if mode == "auto":
        mode = "bar" if sys.stderr.isatty() else "lines"
    return mode


def configure(mode: str | None = None, interval: float | None = None) -> str:
    """Choose how tasks are drawn in this process; returns the resolved mode."""
    _terminal.mode = resolve_mode(mode)
    _terminal.interval = float(interval if interval is not None else os.environ.get("GNDPO_PROGRESS_INTERVAL", 10.0))
    return _terminal.mode


def mode() -> str:
    if _terminal.mode is None:
        configure()
    return _terminal.mode


def _format_number(value) -> str:
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.4g}"
    return f"{int(value):,}"


def _format_rate(per_second: float) -> str:
    """``1,234/s``; below 10 per second two significant digits (``0.29/s``, ``4.5/s``), so a slow
    count shows its rate instead of ``0/s``; per minute below one per second is not worth the switch."""
    return f"{per_second:,.0f}/s" if per_second >= 10 else f"{per_second:.2g}/s"


class Task:
    """One long step: ``done`` of ``total`` ``unit``, summed counts, the latest shown values."""

    def __init__(self, description: str, total: int | None, unit: str, bar: bool = True, transient: bool = False):
        self.description, self.total, self.unit, self.transient = description, total, unit, transient
        self.done, self.counts, self.shown = 0, {}, {}
        self.started = self._last_line = time.monotonic()
        self._bar_id = None
        if mode() == "bar" and bar:
            if _terminal.bar is None:
                # Every column keeps its natural width but the details, which take what is left and are
                # cut short first: at 80 columns the names, counts and times stay readable.
                fixed = Column(no_wrap=True)
                _terminal.bar = Progress(
                    TextColumn("[bold]{task.description}", table_column=fixed), BarColumn(bar_width=16),
                    MofNCompleteColumn(table_column=Column(no_wrap=True)), TextColumn("{task.fields[unit]}", table_column=Column(no_wrap=True)),
                    TimeElapsedColumn(table_column=Column(no_wrap=True)), TextColumn("ETA", table_column=Column(no_wrap=True)),
                    TimeRemainingColumn(table_column=Column(no_wrap=True)),
                    TextColumn("{task.fields[details]}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
                    console=console(), transient=False, expand=True,
                )
                _terminal.bar.start()
            self._bar_id = _terminal.bar.add_task(description, total=total, unit=unit, details="")
            _terminal.open.add(self._bar_id)

    def advance(self, n: int = 1, **counts) -> None:
        """``n`` more done; ``counts`` (tokens, responses, ...) are added to the task's sums."""
        self.done += n
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0) + value
        self._draw()

    def show(self, **values) -> None:
        """Values to display as they are now (loss, grad norm), replacing the previous ones."""
        self.shown.update(values)
        self._draw()

    def details(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        parts = [f"{key} {_format_number(value)} ({_format_rate(value / elapsed)})" for key, value in self.counts.items()]
        parts += [f"{key} {_format_number(value)}" for key, value in self.shown.items()]
        return ", ".join(parts)

    def line(self) -> str:
        """The plain-text state: ``rollout r0: 8/16 units, tokens 40,960 (1,234/s), ETA 0:00:12``."""
        of = f"/{self.total}" if self.total is not None else ""
        text = f"{self.description}: {self.done}{of} {self.unit}"
        details = self.details()
        if details:
            text += f", {details}"
        elapsed = time.monotonic() - self.started
        if self.total and 0 < self.done < self.total:
            eta = elapsed / self.done * (self.total - self.done)
            text += f", ETA {int(eta // 3600)}:{int(eta % 3600 // 60):02d}:{int(eta % 60):02d}"
        return text + f", {elapsed:.1f}s"

    def _draw(self, final: bool = False) -> None:
        if self._bar_id is not None:
            _terminal.bar.update(self._bar_id, completed=self.done, details=self.details())
        elif mode() != "none":
            now = time.monotonic()
            finished = self.total is not None and self.done >= self.total
            # The finished state is written once, by close(): not also by the advance that reached it.
            if final or (not finished and now - self._last_line >= _terminal.interval):
                self._last_line = now
                _log.info(self.line())

    def close(self) -> None:
        if self._bar_id is not None:
            bar = _terminal.bar
            bar.update(self._bar_id, completed=self.done, details=self.details())
            bar.stop_task(self._bar_id)
            if self.transient:
                bar.remove_task(self._bar_id)
            _terminal.open.discard(self._bar_id)
            if not _terminal.open:  # the last open task: leave the finished bars on screen, stop redrawing
                bar.stop()
                _terminal.bar = None
        elif not self.transient:
            self._draw(final=True)


@contextmanager
def task(description: str, total: int | None = None, unit: str = "steps", draw: bool = True, transient: bool = False):
    """A :class:`Task` drawn as this process was configured, closed (its last line written) on exit.
    ``draw`` False: as plain lines even on a terminal (while child processes draw on it). ``transient``:
    a part of an enclosing task (one unit of a stage), whose bar goes and whose last line is not
    written when it ends: the enclosing task reports that."""
    t = Task(description, total, unit, bar=draw, transient=transient)
    try:
        yield t
    finally:
        t.close()
