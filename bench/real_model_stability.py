"""GNDPO against OPD on a real model: does batch normalization keep sampled-token distillation stable?

SmolLM2-135M-Instruct distils itself reading three demonstrations (``gndpo demo --task self-distill``):
on a bare question the student starts "The capital of Denmark is ..." where the teacher, having read
the demonstrations, expects "Answer: ...", so the teacher disagrees strongly with a few sampled tokens
of every response (the first ones) and little with the rest: the outlier states where plain OPD's
per-token advantages, and so its gradients, are largest. For each learning rate (the demo's, and ten
times it, where instability is expected) this runs

    gndpo compare opd gndpo forward_kl --task self-distill --seeds 3 --rounds 3 --set train.lr=LR [shape]

(each method with rollout seeds 0, 1, 2; the second and third method fork the first one's round 0, so
all three train on the same round-0 responses) and tabulates per method, learning rate and round: the
held-out format score of the policy the round ends with (greedy, 36 questions), the sampled KL(student
|| teacher) estimate, the pre-clip gradient norm's maximum and 99th percentile over the round's steps,
the share of steps the clip (1.0) cut, and the policy-gradient advantage range (none for forward KL).
Cells are the mean over the 3 seeds (± their sample standard deviation where it says so); advantage
ranges are the lowest and highest over the seeds.

The shape is smaller than the demo's (16 questions x 2 samples x 24 tokens, 2 optimizer steps of 16
responses per round, against 64 x 2 and 4 steps of 32) so that the 18 runs fit about an hour on 2 CPU
cores.

Writes results/real_model_stability.{json,md,png}. The runs stay in ``--work`` (default under
~/.cache/gndpo/bench): rerunning finishes what is missing and re-reads what is done.

    .venv/bin/python bench/real_model_stability.py
    .venv/bin/python bench/real_model_stability.py --table-only     # re-read the runs, rewrite results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, gndpo_cmd, run_timed, save_json  # noqa: E402

METHODS = ["opd", "gndpo", "forward_kl"]
LEARNING_RATES = ["1e-4", "1e-3"]  # the self-distillation demo's, and ten times it
SEEDS, ROUNDS = 3, 3
SHAPE = ["rollout.prompts_per_round=16", "rollout.prompts_per_unit=16", "train.optimizer_steps=2", "train.micro_batch_size=16"]
WORK = Path.home() / ".cache" / "gndpo" / "bench" / "real_model_stability"
OUT = RESULTS / "real_model_stability"


def run_compare(lr: str, work: Path) -> float:
    """One learning rate's comparison (resumed where it stopped); its wall seconds."""
    # --keep-rounds 1: each run keeps only its last round's export (18 runs would otherwise keep 115 GB)
    argv = gndpo_cmd("-q", "compare", *METHODS, "--task", "self-distill", "--seeds", str(SEEDS), "--rounds", str(ROUNDS),
                     "--out", str(work / f"lr-{lr}"), "--keep-rounds", "1")
    for o in [f"train.lr={lr}", *SHAPE]:
        argv += ["--set", o]
    seconds, _ = run_timed(argv, work / f"lr-{lr}.log")
    return seconds


def mean_sd(values: list[float | None]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def table_rows(lr: str, summary: dict) -> list[dict]:
    """Per method and round, the seeds' figures: the score the round ends with (the next round's start,
    or the final evaluation after the last round), its KL estimate and its training's stability."""
    rows = []
    for method in METHODS:
        finals = {r["seed"]: r[f"acc_r{ROUNDS}"] for r in summary["runs"] if r["method"] == method}
        mine = [p for p in summary["per_round"] if p["method"] == method]
        for r in range(ROUNDS):
            this = [p for p in mine if p["round"] == r]
            ends = [next((p["heldout_start"] for p in mine if p["seed"] == q["seed"] and p["round"] == r + 1), finals[q["seed"]])
                    for q in this]
            score, score_sd = mean_sd(ends)
            norm_max, norm_max_sd = mean_sd([p["grad_norm_max"] for p in this])
            advs = [(p["adv_min"], p["adv_max"]) for p in this if p.get("adv_min") is not None]
            rows.append({
                "lr": lr, "method": method, "round": r + 1, "seeds": len(this),
                "heldout_start": mean_sd([p["heldout_start"] for p in this])[0] if r == 0 else None,
                "heldout": score, "heldout_sd": score_sd,
                "kl_estimate": mean_sd([p["kl_estimate"] for p in this])[0],
                "grad_norm_max": norm_max, "grad_norm_max_sd": norm_max_sd,
                "grad_norm_max_worst": max(p["grad_norm_max"] for p in this),
                "grad_norm_p99": mean_sd([p["grad_norm_p99"] for p in this])[0],
                "clipped_steps": mean_sd([p["clipped_steps"] for p in this])[0],
                "adv_min": min(a[0] for a in advs) if advs else None, "adv_max": max(a[1] for a in advs) if advs else None,
            })
    return rows


def markdown(rows: list[dict]) -> str:
    f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = ["| lr | method | round | held-out format (mean ± sd) | KL estimate | grad-norm max (mean ± sd; worst) | grad-norm p99 "
             "| clipped steps | advantage range |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        adv = "-" if r["adv_min"] is None else f"[{r['adv_min']:.2f}, {r['adv_max']:.2f}]"
        lines.append(f"| {r['lr']} | `{r['method']}` | {r['round']} | {f(r['heldout'])} ± {f(r['heldout_sd'])} | {f(r['kl_estimate'])} | "
                     f"{f(r['grad_norm_max'], 2)} ± {f(r['grad_norm_max_sd'], 2)}; {f(r['grad_norm_max_worst'], 2)} | {f(r['grad_norm_p99'], 2)} | "
                     f"{f(r['clipped_steps'], 2)} | {adv} |")
    return "\n".join(lines) + "\n"


def figure(summaries: dict[str, dict], path: Path) -> None:
    """Held-out format and per-round gradient-norm maximum per method: the seeds' mean, and a band from
    the lowest to the highest seed; one column per learning rate."""
    fig, axes = plt.subplots(2, len(summaries), figsize=(5 * len(summaries), 7), squeeze=False)
    for col, (lr, summary) in enumerate(summaries.items()):
        for method in METHODS:
            runs = [r for r in summary["runs"] if r["method"] == method]
            scores = [[r[f"acc_r{k}"] for k in range(ROUNDS + 1)] for r in runs]
            norms = [[p["grad_norm_max"] for p in summary["per_round"] if p["method"] == method and p["seed"] == r["seed"]] for r in runs]
            for ax, curves, x in ((axes[0][col], scores, range(ROUNDS + 1)), (axes[1][col], norms, range(1, ROUNDS + 1))):
                line = ax.plot(list(x), [statistics.fmean(v) for v in zip(*curves)], marker="o", label=method)[0]
                ax.fill_between(list(x), [min(v) for v in zip(*curves)], [max(v) for v in zip(*curves)], color=line.get_color(), alpha=0.2)
        axes[0][col].set(title=f"lr {lr}: held-out format (greedy, 36 questions)", xlabel="policy version", ylim=(-0.05, 1.05),
                         xticks=range(ROUNDS + 1))
        axes[1][col].set(title=f"lr {lr}: gradient-norm max per round (pre-clip)", xlabel="round", yscale="log", xticks=range(1, ROUNDS + 1))
        axes[0][col].legend()
    fig.suptitle(f"SmolLM2-135M-Instruct self-distillation, {SEEDS} seeds (mean, band: lowest to highest)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=WORK, help="where the runs go (resumable)")
    parser.add_argument("--table-only", action="store_true", help="re-read finished runs; run nothing")
    parser.add_argument("--lr", action="append", choices=LEARNING_RATES, help="run only this learning rate (repeatable); the table has all")
    args = parser.parse_args()
    seconds = json.loads(OUT.with_suffix(".json").read_text()).get("seconds", {}) if OUT.with_suffix(".json").exists() else {}
    summaries = {}
    for lr in LEARNING_RATES:
        if not args.table_only and (not args.lr or lr in args.lr):
            t0 = time.time()
            run_compare(lr, args.work)
            seconds[lr] = seconds.get(lr, 0.0) + round(time.time() - t0, 1)
        summaries[lr] = json.loads((args.work / f"lr-{lr}" / "compare.json").read_text())
    rows = [row for lr, summary in summaries.items() for row in table_rows(lr, summary)]
    save_json(OUT.with_suffix(".json"), {"methods": METHODS, "seeds": SEEDS, "rounds": ROUNDS, "shape": SHAPE,
                                         "seconds": seconds, "rows": rows})
    OUT.with_suffix(".md").write_text(markdown(rows))
    figure(summaries, OUT.with_suffix(".png"))
    print(markdown(rows))


if __name__ == "__main__":
    main()
