"""LoRA against full fine-tuning on the self-distillation demo: the same 3 rounds of SmolLM2-135M-Instruct
(`gndpo demo --task self-distill`), once training every weight and once training adapters only
(``model.lora``), in the same bench run.

Per run: wall time, the peak memory of the demo's process tree (PSS, sampled every 0.5 s), the bytes
each round's train wrote (its commit's files and an optimizer state written after the commit), the
trainable parameters, and the held-out score after every round.

    .venv/bin/python bench/lora_vs_full.py                       # about 12 minutes on 2 cores
    .venv/bin/python bench/lora_vs_full.py --lora-lr 1e-3 --serve merged --serve adapters

Writes ``results/lora_vs_full.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, gndpo_cmd, machine, run_measured, save_json  # noqa: E402
from round_vs_trl import train_bytes  # noqa: E402

from gndpo.apps.compare import method_row  # noqa: E402
from gndpo.pipeline.run.run import open_run  # noqa: E402

LORA = ["model.lora.enabled=true", "model.lora.rank=16", "model.lora.alpha=32"]


def demo_run(folder: Path, overrides: list[str]) -> dict:
    """One self-distillation demo with ``overrides``; its figures."""
    shutil.rmtree(folder, ignore_errors=True)
    argv = gndpo_cmd("-q", "demo", str(folder), "--task", "self-distill")
    for o in overrides:
        argv += ["--set", o]
    seconds, _, memory = run_measured(argv, folder.parent / f"{folder.name}.log")
    run_url = str(folder / "run")
    final = json.loads((folder / "eval" / "summary.json").read_text())["pass@1"]
    row, _ = method_row(folder.name, run_url, final)
    run = open_run(run_url)
    rounds = sum(1 for k in row if k.startswith("acc_r")) - 1
    return {"overrides": overrides, "wall_s": round(seconds, 1), "peak_tree_pss_gib": memory["peak_tree_pss_gib"],
            "heldout": [row[f"acc_r{r}"] for r in range(rounds + 1)],
            "train_mb_written": [round(train_bytes(run, r) / 1e6, 1) for r in range(rounds)],
            "grad_norm_max": row["grad_norm_max"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lora-lr", action="append", type=float, help="LoRA runs' train.lr (repeatable; default 1e-3)")
    ap.add_argument("--serve", action="append", choices=["merged", "adapters"],
                    help="what rollout's engine runs in the LoRA runs, model.lora.serve (repeatable; default merged, the CPU's auto)")
    ap.add_argument("--work-dir", default="/tmp/gndpo-bench/lora_vs_full")
    a = ap.parse_args(argv)
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    runs = {"full": demo_run(work / "full", [])}
    for lr in a.lora_lr or [1e-3]:
        for serve in a.serve or ["merged"]:
            runs[f"lora lr {lr:g}, served {serve}"] = demo_run(work / f"lora-{lr:g}-{serve}", [*LORA, f"train.lr={lr:g}", f"model.lora.serve={serve}"])
    result = {"cpu": machine(), "measured_at": time.strftime("%Y-%m-%d %H:%M"), "bench_s": round(time.time() - t0, 1), "runs": runs}
    path = RESULTS / "lora_vs_full.json"
    earlier = json.loads(path.read_text()).get("bench_runs", []) if path.exists() else []
    save_json(path, {"bench_runs": [*earlier, result][-4:]})  # each a full run beside LoRA ones, in the same run
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
