"""Where a unit's time goes: seconds by phase, and the bytes written to the run folder in each.

The executor runs each unit (and the stage's set-up before the first) under a :func:`unit_clock`; a
stage marks its own phases inside it (``with phase("export"): ...``), and every data file written
through :class:`gndpo.storage.runfs.RunFS` is charged to the phase it is written in. Data files written
outside a named phase (rollout's and score's Parquet shards) are the ``write`` phase; the rest of the
unit's time is ``compute``. A worker computes one unit at a time, so one clock per process suffices.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager

COMPUTE, WRITE = "compute", "write"
# {phase: {"seconds": s, "bytes": b}}: where a unit's time went and what each phase wrote.
Phases = dict[str, dict[str, float]]


class PhaseClock:
    """Seconds and bytes written, by phase, for one unit of work."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, int] = defaultdict(int)
        self.current = COMPUTE
        self.thread = threading.get_ident()  # the unit's own thread: a write on another one is not the unit's
        self._started = time.perf_counter()

    def charge_write(self, nbytes: int, seconds: float) -> None:
        """A data file of ``nbytes`` written in ``seconds``: charged to the open phase, or to ``write``."""
        name = WRITE if self.current == COMPUTE else self.current
        self.bytes[name] += nbytes
        if name == WRITE:
            self.seconds[WRITE] += seconds

    def breakdown(self) -> Phases:
        """``{phase: {"seconds": s, "bytes": b}}`` since the clock started; ``compute`` is the time no
        other phase took (it writes nothing of its own)."""
        seconds = dict(self.seconds)
        seconds[COMPUTE] = max(time.perf_counter() - self._started - sum(seconds.values()), 0.0)
        return {name: {"seconds": round(s, 3), "bytes": self.bytes.get(name, 0)} for name, s in sorted(seconds.items())}


_clock: PhaseClock | None = None


@contextmanager
def unit_clock():
    """A fresh :class:`PhaseClock` for the block (one unit's set-up and work)."""
    global _clock
    _clock = clock = PhaseClock()
    try:
        yield clock
    finally:
        _clock = None


@contextmanager
def phase(name: str):
    """Charge the block's time, and the data files written in it, to phase ``name`` of the running
    unit's clock (the enclosing phase gets neither); outside a unit's clock, nothing is measured."""
    clock = _clock
    if clock is None:
        yield
        return
    outer, clock.current = clock.current, name
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        clock.seconds[name] += elapsed
        if outer != COMPUTE:
            clock.seconds[outer] -= elapsed
        clock.current = outer


def charge_write(nbytes: int, seconds: float) -> None:
    """Record a data file written to the run folder (called by the storage layer's writer). Files a
    background thread writes (an earlier round's deferred optimizer state) are not the running unit's."""
    clock = _clock
    if clock is not None and clock.thread == threading.get_ident():
        clock.charge_write(nbytes, seconds)
