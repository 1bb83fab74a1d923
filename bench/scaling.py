"""Round time as the work doubles twice: one gndpo round on W at 1x, 2x and 4x the prompts.

Each point is a fresh run, ``gndpo init`` then ``gndpo run RUN --rounds 1`` timed from start to exit
(so the fixed cost of a round, process and engine start-up, is in every point), with the stages' own
compute seconds from the run's metrics beside it. W's shapes (:mod:`bench.workload`) with ``--base``
prompts x 4 samples x ``--max-tokens`` tokens at 1x. Writes ``results/scaling.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, gndpo_cmd, run_timed, save_json  # noqa: E402
from workload import CPU_SCALE, build_workload, workload_config, write_config  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=int, default=8, help="prompts at 1x")
    ap.add_argument("--max-tokens", type=int, default=CPU_SCALE.max_tokens)
    ap.add_argument("--work-dir", default="/tmp/gndpo-bench/scaling")
    a = ap.parse_args(argv)
    assets = build_workload()
    points = []
    for factor in (1, 2, 4):
        scale = replace(CPU_SCALE, prompts=a.base * factor, max_tokens=a.max_tokens)
        folder = Path(a.work_dir) / f"x{factor}"
        shutil.rmtree(folder, ignore_errors=True)
        run = folder / "run"
        config = write_config(folder / "config.yaml", workload_config(assets, scale))
        subprocess.run(gndpo_cmd("init", str(run), "--config", str(config)), check=True, capture_output=True)
        seconds, _ = run_timed(gndpo_cmd("run", str(run), "--rounds", "1"), folder / "run.log")
        stages = {m["stage"]: m.get("seconds") for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
        points.append({"factor": factor, "prompts": scale.prompts, "tokens": scale.tokens(), "wall_s": round(seconds, 2),
                       "stage_compute_s": {k: round(v, 2) for k, v in stages.items() if v is not None}})
        print(points[-1], flush=True)
    base = points[0]["wall_s"]
    for p in points:
        p["wall_ratio"] = round(p["wall_s"] / base, 2)
        p["compute_ratio"] = round(sum(p["stage_compute_s"].values()) / sum(points[0]["stage_compute_s"].values()), 2)
    save_json(RESULTS / "scaling.json", {"points": points})
    return {"points": points}


if __name__ == "__main__":
    main()
