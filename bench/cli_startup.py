"""How long a gndpo command takes to start: `--help`, `status` and `sql` on a small finished run.

Each command runs ``--repeats`` times in a fresh process (the median wall time is reported), beside two
baselines measured the same way in the same run: a bare interpreter (``python -c pass``) and one that
imports torch (what every command paid before commands imported their pipeline lazily). The run is the
tiny toy run the tests use, made once under ``--work``.

    .venv/bin/python bench/cli_startup.py

Writes results/cli_startup.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.conftest
from common import RESULTS, gndpo_cmd, save_json  # noqa: E402

OUT = RESULTS / "cli_startup"


def median_seconds(argv: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def tiny_run(work: Path) -> Path:
    """An initialized run of the tests' tiny toy config (status and sql read its plan-less folder)."""
    from gndpo.apps.demos.arithmetic import ModelSpec, ToySpec, ensure_toy_assets
    from tests.conftest import TINY, tiny_config_dict

    run = work / "run"
    if not (run / "run.yaml").exists():
        spec = ToySpec(**TINY, model=ModelSpec(layers=1, hidden=64, heads=2, max_steps=20, lr=3e-3, batch=32), student_max_steps=5)
        assets = ensure_toy_assets(spec, log=lambda *_: None)
        (work / "config.yaml").write_text(yaml.safe_dump(tiny_config_dict(assets)))
        subprocess.run(gndpo_cmd("init", str(run), "--config", str(work / "config.yaml")), check=True, capture_output=True)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "gndpo-cli-startup")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    run = str(tiny_run(args.work))
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "gndpo --help": gndpo_cmd("--help"),
        "gndpo status RUN": gndpo_cmd("status", run),
        "gndpo sql RUN 'SELECT count(*) FROM rollouts'": gndpo_cmd("sql", run, "SELECT count(*) FROM rollouts"),
    }
    seconds = {name: round(median_seconds(argv, args.repeats), 3) for name, argv in commands.items()}
    torch_import = seconds["python -c 'import torch'"]
    rows = [{"command": name, "seconds": s, "vs_import_torch": round(s / torch_import, 2)} for name, s in seconds.items()]
    save_json(OUT.with_suffix(".json"), {"repeats": args.repeats, "rows": rows})
    lines = ["| command | median wall s | / `import torch` |", "|---|---:|---:|"]
    lines += [f"| `{r['command']}` | {r['seconds']:.2f} | {r['vs_import_torch']:.2f} |" for r in rows]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
