"""Stopping cleanly on a signal, and never leaving a child behind.

A stage stopped by Ctrl-C (SIGINT), ``kill`` or a scheduler (SIGTERM; Slurm's pre-emption warning
with ``--signal=USR1``) unwinds like an error: the worker releases its lease, engines shut down with
the process, and the command prints one line saying that the run is resumable and how. Python turns
SIGINT into KeyboardInterrupt; :func:`stop_on_signals` makes the others raise :class:`Stopped`.

What a process starts must not outlive it either: a SIGKILL (an out-of-memory killer) runs no
handler, so the processes gndpo starts ask the kernel to signal them when it dies
(:func:`die_with_parent`, Linux's PR_SET_PDEATHSIG), vLLM's engine processes included
(:func:`follow_owner`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Loaded here, not in die_with_parent: between fork and exec a child must not load libraries.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Set in the environment of the stage processes ``gndpo run`` starts: stopped by a signal, they exit
# without a word, and the ``gndpo run`` that started them says how to resume.
STAGE_OF_RUN_ENV = "GNDPO_STAGE_OF_RUN"
# Set while a vLLM engine starts (gndpo.stages.models.vllm_engine): the pid of the gndpo process the
# engine serves, which the engine's processes inherit.
ENGINE_OWNER_ENV = "GNDPO_ENGINE_OWNER"


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
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_running(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited: a zombie (exited, not yet reaped by its parent) counts
    as exited, which :func:`pid_alive` cannot tell (Linux's /proc; elsewhere :func:`pid_alive`)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return pid_alive(pid)
    return stat[stat.rindex(")") + 2] not in "ZX"


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it, from /proc (Linux; elsewhere ``{pid}``)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in Path("/proc").iterdir() if e.name.isdigit()]
    except OSError:
        return {pid}
    for entry in entries:
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while being listed
            continue
        children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry.name))
    tree, todo = set(), [pid]
    while todo:
        tree.add(todo[-1])
        todo.extend(children.get(todo.pop(), []))
    return tree


def follow_owner() -> None:
    """Make this process die with the gndpo process whose vLLM engine it belongs to (a no-op anywhere
    else: outside an engine, or in the gndpo process itself).

    vLLM runs its engine core in a process of its own, spawned from gndpo's, and its workers under
    that: none of them runs gndpo's code or exits when gndpo is killed outright, and an engine core
    whose front-end dies keeps its memory (a GPU's too) for minutes. Two places call this, which between
    them cover every engine process from its first moments: the CLI module (a process that vLLM spawns
    from ``gndpo`` re-imports it as its main module, before anything else runs) and the worker extension
    (:mod:`gndpo.stages.models.vllm_worker`, imported where vLLM builds its workers). A child of gndpo
    asks the kernel for SIGKILL when gndpo dies; a process further down watches gndpo and, when it is
    gone, takes its parent (the engine core) and itself down."""
    owner = int(os.environ.get(ENGINE_OWNER_ENV, "0") or 0)
    if not owner or owner == os.getpid():
        return
    if os.getppid() == owner:
        die_with_parent(signal.SIGKILL)
        if os.getppid() != owner:  # gndpo died before the kernel was asked
            os._exit(1)
        return
    threading.Thread(target=_exit_with, args=(owner,), name="gndpo-owner-watch", daemon=True).start()


def _exit_with(owner: int) -> None:
    while pid_alive(owner):
        time.sleep(1.0)
    os.kill(os.getppid(), signal.SIGKILL)  # the engine core this process works for
    os._exit(1)
