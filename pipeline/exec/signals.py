"""Stopping cleanly on a signal, and never leaving a child behind.

A stage stopped by Ctrl-C (SIGINT), ``kill`` or a scheduler (SIGTERM; Slurm's pre-emption warning
with ``--signal=USR1``) unwinds like an error: the worker releases its lease, engines shut down with
the process, and the command prints one line saying that the run is resumable and how. Python turns
SIGINT into KeyboardInterrupt; :func:`stop_on_signals` makes the others raise :class:`Stopped`.

What a process starts must not outlive it either: a SIGKILL (an out-of-memory killer) runs no
handler, so the processes gndpo starts ask the kernel to signal them when it dies
(:func:`die_with_parent`, Linux's PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Set in the environment of the stage processes ``gndpo run`` starts: stopped by a signal, they exit
# without a word, and the ``gndpo run`` that started them says how to resume.
STAGE_OF_RUN_ENV = "GNDPO_STAGE_OF_RUN"


class Stopped(BaseException):
    """Raised in the main thread when a stop signal arrives. A BaseException, like KeyboardInterrupt,
    so that ``except Exception`` handlers on the way out do not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, _frame):
    raise Stopped(signum)


def stop_on_signals() -> None:
    """Make SIGTERM and SIGUSR1 raise :class:`Stopped` in this process (main thread only: Python runs
    handlers there)."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, _raise_stopped)


def signal_of(exc: BaseException) -> int | None:
    """The signal behind ``exc`` (a KeyboardInterrupt is SIGINT), or None for anything else."""
    if isinstance(exc, Stopped):
        return exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return int(signal.SIGINT)
    return None


def exit_code(signum: int) -> int:
    """The shell's convention for a process stopped by ``signum``: 128 + its number (SIGINT 130, SIGTERM 143)."""
    return 128 + int(signum)


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``signum`` to this process when its parent dies (a ``preexec_fn`` for the
    processes gndpo starts: it runs in the child, before exec, and survives exec). SIGTERM, not SIGKILL:
    the child still releases its lease and stops its engines. A no-op where prctl does not exist."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
