"""Crash injection for the crash-safety tests: ``GNDPO_CRASH_AT=<point>`` kills the process with SIGKILL
the (``GNDPO_CRASH_AFTER`` + 1)-th time execution passes that point. Nothing happens when unset.

Points: ``rollout.generate`` (a unit's generation has started), ``storage.write`` (half of a data file
is on disk), ``units.before_commit`` (a unit's files are written, its commit record is not),
``train.step`` (an optimizer step of train has finished), ``train.state_write`` (a deferred optimizer
state's files are written, its record is not). ``GNDPO_PAUSE_AT=<point>`` stops the process
there instead (SIGSTOP), which is how the tests make a worker miss its heartbeats; ``GNDPO_DELAY_AT=<point>``
sleeps ``GNDPO_DELAY_S`` seconds there each time (a slow stage, for the tests of overlapped stages).
"""

from __future__ import annotations

import os
import signal
import time

_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    """SIGKILL (GNDPO_CRASH_AT) or SIGSTOP (GNDPO_PAUSE_AT: the whole process, heartbeat thread
    included, freezes until someone sends SIGCONT) at the point ``name``; or a sleep (GNDPO_DELAY_AT)."""
    if os.environ.get("GNDPO_DELAY_AT") == name:
        time.sleep(float(os.environ.get("GNDPO_DELAY_S", "1")))
    for variable, sig in (("GNDPO_CRASH_AT", signal.SIGKILL), ("GNDPO_PAUSE_AT", signal.SIGSTOP)):
        if os.environ.get(variable) != name:
            continue
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] == int(os.environ.get("GNDPO_CRASH_AFTER", "0")) + 1:
            os.kill(os.getpid(), sig)
