"""What the benchmark scripts share: where results go, running a timed process, the gndpo command."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def gndpo_cmd(*args: str) -> list[str]:
    """The gndpo CLI of this interpreter's environment."""
    return [sys.executable, "-m", "gndpo.cli", *args]


def run_timed(argv: list[str], log: Path) -> tuple[float, str]:
    """Run ``argv`` to completion with its output in ``log``; (wall seconds, stdout). Raises with the
    log's tail if it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.time() - t0
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({proc.returncode}); log {log}:\n{proc.stderr[-3000:]}")
    return seconds, proc.stdout


def save_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
