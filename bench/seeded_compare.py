"""What the real-model comparison benches share: run one learning rate's `gndpo compare` over seeds,
and turn its compare.json into per-round rows (seed mean ± sd), a Markdown table and a figure.

A row describes the policy a round *ends* with: its held-out score is the next round's starting score
(or the final evaluation after the last round); its KL estimate, gradient-norm figures, clip share and
advantage range are the round's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from common import gndpo_cmd, run_timed  # noqa: E402


def run_compare(methods: list[str], task: str, lr: str, seeds: int, rounds: int, shape: list[str], work: Path) -> float:
    """One learning rate's comparison in ``work/lr-<lr>`` (resumed where it stopped); its wall seconds."""
    # --keep-rounds 1: each run keeps only its last round's export (a real model's round keeps ~2 GB)
    argv = gndpo_cmd("-q", "compare", *methods, "--task", task, "--seeds", str(seeds), "--rounds", str(rounds),
                     "--out", str(work / f"lr-{lr}"), "--keep-rounds", "1", f"train.lr={lr}", *shape)
    seconds, _ = run_timed(argv, work / f"lr-{lr}.log")
    return seconds


def arguments(description: str, work: Path, learning_rates: list[str]) -> argparse.Namespace:
    """The benches' command line: --work, --table-only, --lr (repeatable)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--work", type=Path, default=work, help="where the runs go (resumable)")
    parser.add_argument("--table-only", action="store_true", help="re-read finished runs; run nothing")
    parser.add_argument("--lr", action="append", choices=learning_rates, help="run only this learning rate (repeatable); the table has all")
    return parser.parse_args()


def run_or_read(args: argparse.Namespace, methods: list[str], task: str, learning_rates: list[str], seeds: int, rounds: int,
                shape: list[str], seconds: dict[str, float]) -> dict[str, dict]:
    """Each learning rate's compare.json, after running (or resuming) its comparison unless ``args``
    says to only read it; each run's wall seconds are added to ``seconds[lr]``."""
    summaries = {}
    for lr in learning_rates:
        if not args.table_only and (not args.lr or lr in args.lr):
            t0 = time.time()
            run_compare(methods, task, lr, seeds, rounds, shape, args.work)
            seconds[lr] = seconds.get(lr, 0.0) + round(time.time() - t0, 1)
        summaries[lr] = json.loads((args.work / f"lr-{lr}" / "compare.json").read_text())
    return summaries


def mean_sd(values: list[float | None]) -> tuple[float | None, float | None]:
    """The mean and sample standard deviation of the values that are there (None, None if none are)."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def ending_scores(summary: dict, method: str, rounds: int) -> dict[int, list[float]]:
    """{round (1..rounds): each seed's held-out score of the policy that round ended with}."""
    finals = {r["seed"]: r[f"acc_r{rounds}"] for r in summary["runs"] if r["method"] == method}
    start = {(p["seed"], p["round"]): p["heldout_start"] for p in summary["per_round"] if p["method"] == method}
    return {r + 1: [start.get((seed, r + 1), finals[seed]) for seed in sorted(finals)] for r in range(rounds)}


def table_rows(lr: str, summary: dict, methods: list[str], rounds: int) -> list[dict]:
    """Per method and round, the seeds' figures (see the module's docstring)."""
    rows = []
    for method in methods:
        mine = [p for p in summary["per_round"] if p["method"] == method]
        ends = ending_scores(summary, method, rounds)
        for r in range(rounds):
            this = [p for p in mine if p["round"] == r]
            score, score_sd = mean_sd(ends[r + 1])
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


def markdown(rows: list[dict], score: str) -> str:
    """The rows as a Markdown table; ``score`` names the held-out column."""
    f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [f"| lr | method | round | {score} (mean ± sd) | KL estimate | grad-norm max (mean ± sd; worst) | grad-norm p99 "
             "| clipped steps | advantage range |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        adv = "-" if r["adv_min"] is None else f"[{r['adv_min']:.2f}, {r['adv_max']:.2f}]"
        lines.append(f"| {r['lr']} | `{r['method']}` | {r['round']} | {f(r['heldout'])} ± {f(r['heldout_sd'])} | {f(r['kl_estimate'])} | "
                     f"{f(r['grad_norm_max'], 2)} ± {f(r['grad_norm_max_sd'], 2)}; {f(r['grad_norm_max_worst'], 2)} | {f(r['grad_norm_p99'], 2)} | "
                     f"{f(r['clipped_steps'], 2)} | {adv} |")
    return "\n".join(lines) + "\n"


def figure(summaries: dict[str, dict], methods: list[str], rounds: int, path: Path, title: str, score: str) -> None:
    """Held-out score and per-round gradient-norm maximum per method: the seeds' mean, and a band from
    the lowest to the highest seed; one column per learning rate."""
    fig, axes = plt.subplots(2, len(summaries), figsize=(5 * len(summaries), 7), squeeze=False)
    for col, (lr, summary) in enumerate(summaries.items()):
        for method in methods:
            runs = [r for r in summary["runs"] if r["method"] == method]
            scores = [[r[f"acc_r{k}"] for k in range(rounds + 1)] for r in runs]
            norms = [[p["grad_norm_max"] for p in summary["per_round"] if p["method"] == method and p["seed"] == r["seed"]] for r in runs]
            for ax, curves, x in ((axes[0][col], scores, range(rounds + 1)), (axes[1][col], norms, range(1, rounds + 1))):
                line = ax.plot(list(x), [statistics.fmean(v) for v in zip(*curves)], marker="o", label=method)[0]
                ax.fill_between(list(x), [min(v) for v in zip(*curves)], [max(v) for v in zip(*curves)], color=line.get_color(), alpha=0.2)
        axes[0][col].set(title=f"lr {lr}: {score}", xlabel="policy version", ylim=(-0.05, 1.05), xticks=range(rounds + 1))
        axes[1][col].set(title=f"lr {lr}: gradient-norm max per round (pre-clip)", xlabel="round", yscale="log", xticks=range(1, rounds + 1))
        axes[0][col].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
