"""Peak resident memory of a piece of work, for the memory probes that run in a fresh process.

torch's CPU allocator is invisible to tracemalloc, so a thread samples the process's resident set
(/proc/self/statm) every 2 ms while the work runs.
"""

from __future__ import annotations

import os
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """This process's resident set, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak_above_start(work) -> tuple[dict, object]:
    """Run ``work()``; returns ({loaded_gib: resident before, extra_gib: the peak above it, seconds},
    what ``work`` returned)."""
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    base = rss()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.time()
    try:
        result = work()
    finally:
        stop.set()
        thread.join()
    seconds = time.time() - start
    peak[0] = max(peak[0], rss())
    return {"loaded_gib": base / 2**30, "extra_gib": (peak[0] - base) / 2**30, "seconds": seconds}, result
