"""What progress inside a unit costs: the time of one ``Task.advance`` in each drawing mode, and what
that adds to a demo round, whose rollout advances once per finished response and whose score advances
once per forward batch.

Each mode draws as a stage process would: ``bar`` to a terminal (a rich console forced to act as one,
writing to /dev/null, its live display refreshing in its thread as on a real terminal), ``lines`` to a
log (a line at most every 10 s), ``none``. Writes results/progress_overhead.{json,md}.

    .venv/bin/python bench/progress_overhead.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, save_json  # noqa: E402

from gndpo.pipeline.observe import progress  # noqa: E402

CALLS = 200_000
# The embedded demo's round (apps/demo.yaml): 2048 prompts x 8 samples; rollout advances once
# per response (and its stage task once per unit), score once per batch of responses.
DEMO_ADVANCES_PER_ROUND = 2048 * 8 + 33


def time_advance(mode: str) -> float:
    """Seconds per ``advance`` of a transient per-unit task, as rollout calls it (one response, its tokens)."""
    progress.configure(mode, interval=10.0)
    if mode == "bar":
        progress._terminal.console = Console(file=open(os.devnull, "w"), force_terminal=True, width=120)
    with progress.task("rollout r0 u00000", total=CALLS, unit="responses", transient=True) as bar:
        t0 = time.perf_counter()
        for _ in range(CALLS):
            bar.advance(1, tokens=5)
        seconds = time.perf_counter() - t0
    progress._terminal.console = None
    return seconds / CALLS


def main() -> None:
    rows = []
    for mode in ("none", "lines", "bar"):
        per_call = time_advance(mode)
        rows.append({"mode": mode, "us_per_advance": round(per_call * 1e6, 2),
                     "seconds_per_demo_round": round(per_call * DEMO_ADVANCES_PER_ROUND, 3)})
        print(rows[-1], flush=True)
    result = {"machine": machine(), "calls": CALLS, "demo_advances_per_round": DEMO_ADVANCES_PER_ROUND, "rows": rows}
    save_json(RESULTS / "progress_overhead.json", result)
    lines = [f"CPU: {result['machine']}; {CALLS:,} advances per mode; a demo round advances {DEMO_ADVANCES_PER_ROUND:,} times.", "",
             "| mode | µs per advance | seconds per demo round |", "|---|---:|---:|"]
    lines += [f"| {r['mode']} | {r['us_per_advance']:.2f} | {r['seconds_per_demo_round']:.3f} |" for r in rows]
    (RESULTS / "progress_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
