"""What a stage process costs from start to exit, with and without the interpreter's module teardown.

`gndpo` ends through ``gndpo.cli.app.exit_without_teardown``: threads joined, exit handlers run, streams
flushed, then ``os._exit``. The baseline is the same command through the same Typer app ending with
``sys.exit``, so the interpreter then tears every loaded module down (torch, vLLM, DeepSpeed). Each
repeat makes two fresh runs of the tests' tiny toy config and runs one round's four stage commands in
each, alternating which goes first; the median wall time per stage is reported with the ratio.

    .venv/bin/python bench/process_exit.py

Writes results/process_exit.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.conftest
from common import RESULTS, gndpo_cmd, machine, save_json  # noqa: E402

OUT = RESULTS / "process_exit"
STAGES = ("rollout", "score", "normalize", "train")
# The same app, ended by sys.exit: the interpreter's own exit, module teardown included.
FULL_EXIT = [sys.executable, "-c", "import sys; from gndpo.cli.app import app, register; register(); sys.argv[0] = 'gndpo'; app()"]


def tiny_config(work: Path) -> Path:
    from gndpo.apps.demos.arithmetic import ModelSpec, ToySpec, ensure_toy_assets
    from tests.conftest import TINY, tiny_config_dict

    spec = ToySpec(**TINY, model=ModelSpec(layers=1, hidden=64, heads=2, max_steps=20, lr=3e-3, batch=32), student_max_steps=5)
    assets = ensure_toy_assets(spec, log=lambda *_: None)
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(assets)))
    return path


def round_seconds(prefix: list[str], config: Path, run: Path) -> dict[str, float]:
    """Wall seconds of each stage command of round 0 on a new run at ``run``."""
    subprocess.run(gndpo_cmd("init", str(run), "--config", str(config)), check=True, capture_output=True)
    seconds = {}
    for stage in STAGES:
        t0 = time.perf_counter()
        subprocess.run([*prefix, stage, str(run), "--round", "0"], check=True, capture_output=True)
        seconds[stage] = time.perf_counter() - t0
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="gndpo-process-exit-"))
    work.mkdir(parents=True, exist_ok=True)
    config = tiny_config(work)
    ways = {"entry point (no teardown)": gndpo_cmd(), "interpreter exit (teardown)": FULL_EXIT}
    measured: dict[str, list[dict]] = {way: [] for way in ways}
    for repeat in range(args.repeats):
        order = list(ways) if repeat % 2 == 0 else list(reversed(ways))
        for way in order:
            measured[way].append(round_seconds(ways[way], config, work / f"r{repeat}-{len(measured[way])}-{way.split()[0]}"))
    rows = []
    for stage in STAGES:
        fast, full = (statistics.median(m[stage] for m in measured[way]) for way in ways)
        rows.append({"stage": stage, "entry_point_s": round(fast, 2), "full_exit_s": round(full, 2), "ratio": round(fast / full, 3)})
    fast, full = (statistics.median(sum(m.values()) for m in measured[way]) for way in ways)
    rows.append({"stage": "round (4 processes)", "entry_point_s": round(fast, 2), "full_exit_s": round(full, 2), "ratio": round(fast / full, 3)})
    today = datetime.date.today().isoformat()
    save_json(OUT.with_suffix(".json"), {"date": today, "machine": machine(), "repeats": args.repeats, "rows": rows, "raw": measured})
    lines = [f"{today}, {machine()}: median of {args.repeats} repeats, one toy round's stage commands each.", "",
             "| stage command | entry point s | interpreter exit s | ratio |", "|---|---:|---:|---:|"]
    lines += [f"| `gndpo {r['stage']}` | {r['entry_point_s']:.2f} | {r['full_exit_s']:.2f} | {r['ratio']:.3f} |" if r["stage"] in STAGES
              else f"| {r['stage']} | {r['entry_point_s']:.2f} | {r['full_exit_s']:.2f} | {r['ratio']:.3f} |" for r in rows]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
