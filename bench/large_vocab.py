"""A short job at a 262,144-token vocabulary: `gndpo run --rounds 1` against TRL 1.16's
``DistillationTrainer`` (``trl_distill.py``) on the same work, in the same run.

The model has Gemma 3 270M's shape with random weights (``output_layer.gemma3_270m_shape``: 268M
parameters, 168M of them the tied embedding) and a byte-level BPE tokenizer trained here
(``tests.realistic``); it is its own teacher, as in self-distillation. The job: 8 prompts x 4 samples of
up to 24 and up to 384 new tokens at temperature 1 (random weights never sample the end token, so every
response runs to its maximum), 2 optimizer steps of 16, lr 1e-6, fp32 on the CPU. The loss: gndpo's
``reverse_kl`` on the teacher's top-16 against TRL's ``beta=1`` (reverse KL on the whole vocabulary).

Each side is timed as the whole process a user starts (gndpo: the vLLM engine start, the four stages,
the commits and the export; TRL: imports, models, ``train()``, saving), and its memory sampled from /proc
with its descendants (``common.run_measured``: the peak of the process tree's summed PSS). gndpo's run
also reports where its time went (`gndpo status --phases`).

    python bench/large_vocab.py [--tokens 24,384]     # writes results/large_vocab.{json,md}
    python bench/large_vocab.py --tokens 384 --repeat  # adds a repeat of the 384 row to them
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, gndpo_cmd, machine, run_measured, save_json  # noqa: E402
from output_layer import gemma3_270m_shape  # noqa: E402
from workload import CACHE, write_config  # noqa: E402

from gndpo.pipeline.exec.status import phase_rows  # noqa: E402
from gndpo.pipeline.run.run import open_run  # noqa: E402
from tests.realistic import ShapeSpec, build_tokenizer, synthetic_text  # noqa: E402

PROMPTS, SAMPLES, STEPS, LR = 8, 4, 2, 1e-6
FOLDER = CACHE / "gemma3-270m-job"


def build_model() -> Path:
    """The model folder (weights, tokenizer) and its prompts, built once."""
    if (FOLDER / "prompts.jsonl").exists():
        return FOLDER
    tok = build_tokenizer(ShapeSpec())
    model = gemma3_270m_shape()
    model.config.eos_token_id, model.config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(FOLDER, safe_serialization=True)
    tok.save_pretrained(FOLDER)
    with open(FOLDER / "prompts.jsonl", "w") as f:
        for line in synthetic_text(PROMPTS, seed=7):
            f.write(json.dumps({"prompt": line, "answer": ""}) + "\n")
    return FOLDER


def gndpo_config(folder: Path, tokens: int) -> dict:
    return {
        "student": str(folder), "teacher": str(folder), "data": {"train": str(folder / "prompts.jsonl"), "heldout_share": 0},
        "method": {"name": "reverse_kl"},
        "rollout": {"prompts_per_round": PROMPTS, "n": SAMPLES, "max_tokens": tokens, "prompts_per_unit": PROMPTS, "temperature": 1.0,
                    "eval_heldout": False},
        "score": {"teacher_topk": 16},
        "train": {"lr": LR, "optimizer_steps": STEPS, "micro_batch_size": PROMPTS * SAMPLES // STEPS, "checkpoint_every": 0},
        "engine": {"max_model_len": 512, "kv_cache_gib": 1},
        "logging": {"entropy_metrics": False},
    }


def gndpo_job(folder: Path, tokens: int, work: Path) -> dict:
    run = work / "run"
    subprocess.run(gndpo_cmd("init", str(run), "--config", str(write_config(work / "config.yaml", gndpo_config(folder, tokens)))),
                   check=True, capture_output=True)
    seconds, _, memory = run_measured(gndpo_cmd("run", str(run), "--rounds", "1"), work / "gndpo-run.log")
    phases = {row.pop("stage"): {k: v for k, v in row.items() if k != "round" and v} for row in phase_rows(open_run(str(run)))}
    state = [p for p in run.rglob("*") if "optimizer" in p.parts and p.is_file()]
    return {"wall_s": round(seconds, 2), "memory": memory, "phases": phases, "optimizer_state_files": len(state)}


def trl_job(folder: Path, tokens: int, work: Path) -> dict:
    argv = [sys.executable, str(HERE / "trl_distill.py"), "--student", str(folder), "--teacher", str(folder), "--prompts",
            str(folder / "prompts.jsonl"), "--out", str(work / "trl-student"), "--count", str(PROMPTS), "--n", str(SAMPLES),
            "--max-new-tokens", str(tokens), "--steps", str(STEPS), "--batch", str(PROMPTS * SAMPLES // STEPS),
            "--micro", str(PROMPTS * SAMPLES // STEPS), "--lr", str(LR)]
    seconds, log, memory = run_measured(argv, work / "trl.log")
    return {"wall_s": round(seconds, 2), **json.loads(log.strip().splitlines()[-1]), "memory": memory}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="24,384")
    ap.add_argument("--work-dir", default="/tmp/gndpo-bench/large_vocab")
    ap.add_argument("--repeat", action="store_true", help="add these rows to the saved ones (a repeat on the same machine) instead of replacing them")
    a = ap.parse_args()
    folder = build_model()
    saved = RESULTS / "large_vocab.json"
    rows = json.loads(saved.read_text())["measured"] if a.repeat and saved.exists() else []
    for tokens in map(int, a.tokens.split(",")):
        work = Path(a.work_dir) / str(tokens)
        subprocess.run(["rm", "-rf", str(work)], check=True)
        g = gndpo_job(folder, tokens, work / "gndpo")
        t = trl_job(folder, tokens, work / "trl")
        row = {"max_new_tokens": tokens, "date": time.strftime("%Y-%m-%d"), "machine": machine(), "gndpo": g, "trl": t,
               "speed": round(t["wall_s"] / g["wall_s"], 2), "memory_ratio": round(g["memory"]["peak_tree_pss_gib"] / t["memory"]["peak_tree_pss_gib"], 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    save(rows)


def save(rows: list[dict]) -> None:
    """results/large_vocab.{json,md} of ``rows`` (each one job pair), the md table a row each, ordered by
    the new-token count (repeats in the order they ran)."""
    rows = sorted(rows, key=lambda m: m["max_new_tokens"])  # stable: repeats keep their order
    runs = sorted({(m["date"], m["machine"]) for m in rows})
    save_json(RESULTS / "large_vocab.json", {"measured": rows})
    lines = [f"# A short job at a 262,144-token vocabulary ({'; '.join(f'{d}, {mc}' for d, mc in runs)})", "",
             "Gemma 3 270M's shape, random weights, its own teacher; 8 prompts x 4 samples, 2 optimizer steps of 16, fp32.",
             "`gndpo run --rounds 1` (reverse KL on the top-16) against TRL 1.16's DistillationTrainer (beta 1), each the whole",
             "process; memory is the peak of the process tree's summed PSS. A token count on several rows was run that many",
             "times on the machine (gndpo, then TRL, each time).", "",
             "| new tokens | date | gndpo s | TRL s | speed (TRL s / gndpo s) | gndpo GiB | TRL GiB | memory ratio |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for m in rows:
        lines.append(f"| {m['max_new_tokens']} | {m['date']} | {m['gndpo']['wall_s']} | {m['trl']['wall_s']} | {m['speed']}x | "
                     f"{m['gndpo']['memory']['peak_tree_pss_gib']} | {m['trl']['memory']['peak_tree_pss_gib']} | {m['memory_ratio']}x |")
    for tokens in sorted({m["max_new_tokens"] for m in rows}):
        runs_of = [m for m in rows if m["max_new_tokens"] == tokens]
        if len(runs_of) > 1:  # a repeated row: the median run's ratio, and every run's seconds pooled
            pooled = sum(m["trl"]["wall_s"] for m in runs_of) / sum(m["gndpo"]["wall_s"] for m in runs_of)
            lines += ["", f"{tokens} new tokens over {len(runs_of)} runs: median speed {statistics.median(m['speed'] for m in runs_of):.2f}x, "
                          f"pooled {pooled:.2f}x (every run's TRL seconds over every run's gndpo seconds)."]
    lines += ["", "gndpo's phases (seconds, `gndpo status --phases`):", ""]
    for m in rows:
        lines.append(f"- {m['max_new_tokens']} tokens ({m['date']}): " + "; ".join(
            f"{stage} " + ", ".join(f"{k} {v}" for k, v in p.items() if k.endswith(" s")) for stage, p in m["gndpo"]["phases"].items()))
    (RESULTS / "large_vocab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
