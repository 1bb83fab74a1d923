"""`gndpo compare`: several methods on one demo task, same rounds, one table.

Each method runs the demo's experiment for the task (the addition toy by default, or ``--task
self-distill`` on SmolLM2; the same assets, seeds and budget) with ``method.name`` and its own
overrides, in its own folder ``<out>/<label>/``. Methods after the first are forks of the first method's
run at round 0 (:mod:`gndpo.apps.fork`): they score and train on its round-0 rollouts, not
merely on rollouts sampled with the same seeds (a method whose overrides change the rollout settings
samples its own). The table reports, per method, the held-out score of every policy version (start,
after each round) and stability figures over all optimizer steps of all rounds: the maximum, 99th
percentile and standard deviation of the pre-clip gradient norm, the share of steps whose norm the
clip (``train.grad_clip``) cut, and the range of the policy-gradient advantages (none for pure
divergence losses). ``compare.json`` also holds the same figures per round of every run. Everything is
read back from the runs' committed manifests.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gndpo.apps.demo import check_task, run_demo
from gndpo.errors import GndpoError
from gndpo.pipeline.exec.gc import prune_rounds
from gndpo.pipeline.methods import get_method
from gndpo.pipeline.observe.logs import info
from gndpo.pipeline.observe.metrics import collect_metrics, round_metrics
from gndpo.pipeline.run.products import POLICY
from gndpo.pipeline.run.run import open_run
from gndpo.stages.models.live import LiveModels


def parse_entry(entry: str) -> tuple[str, str, list[str]]:
    """``gdpo+method.outcome.rewards=[exact_match,answer_length]`` -> (label, method, overrides)."""
    name, *overrides = entry.split("+")
    get_method(name)
    for o in overrides:
        if "=" not in o:
            raise GndpoError(f"compare: {o!r} in {entry!r} is not a key=value override")
    return entry if overrides else name, name, [f"method.name={name}", *overrides]


def round_rows(run) -> tuple[list[dict], list[float]]:
    """Per round of a finished run: the held-out score of the policy it started from, the sampled
    reward and KL(student||teacher) estimate, and for a trained round its optimizer steps' stability
    figures (:func:`stability`) and advantage range; and the pre-clip gradient norms of every step of
    every round, in order."""
    rows, all_norms = [], []
    for m in round_metrics(collect_metrics(run)):
        row = {"round": m.round, "heldout_start": m.rollouts.get("heldout_accuracy"),
               "heldout_kl_start": m.scores.get("heldout_reverse_kl"),  # prompts without answers
               "reward_mean": m.statistics.get("reward_mean"), "kl_estimate": m.statistics.get("reverse_kl_estimate")}
        if m.trained:
            update = run.records(m.round, POLICY).require_manifest().only().numbers
            norms = [s["grad_norm"] for s in update.steps]
            row.update(stability(norms, run.cfg.train.grad_clip), adv_min=update.adv_min, adv_max=update.adv_max)
            all_norms += norms
        rows.append(row)
    return rows, all_norms


def stability(grad_norms: list[float], grad_clip: float) -> dict:
    """Pre-clip gradient-norm figures of some optimizer steps: max, 99th percentile (linear
    interpolation between order statistics), standard deviation, and the share of steps whose norm
    exceeded ``grad_clip`` (None without clipping)."""
    norms = np.asarray(grad_norms, dtype=np.float64)
    if not norms.size:
        return {"grad_norm_max": None, "grad_norm_p99": None, "grad_norm_std": None, "clipped_steps": None}
    return {"grad_norm_max": float(norms.max()), "grad_norm_p99": float(np.percentile(norms, 99)),
            "grad_norm_std": float(norms.std()), "clipped_steps": float(np.mean(norms > grad_clip)) if grad_clip > 0 else None}


def method_row(label: str, run_url: str, final_accuracy: float) -> tuple[dict, list[dict]]:
    """One table row from a finished run's manifests (held-out score per policy version, stability over
    every optimizer step of every round), and the run's per-round rows (:func:`round_rows`)."""
    run = open_run(run_url)
    rounds, norms = round_rows(run)
    row: dict = {"method": label, **{f"acc_r{r['round']}": r["heldout_start"] for r in rounds}, f"acc_r{len(rounds)}": final_accuracy}
    row.update(stability(norms, run.cfg.train.grad_clip))
    adv_lo = [r["adv_min"] for r in rounds if r.get("adv_min") is not None]
    adv_hi = [r["adv_max"] for r in rounds if r.get("adv_max") is not None]
    row["adv_min"] = min(adv_lo) if adv_lo else None
    row["adv_max"] = max(adv_hi) if adv_hi else None
    return row, rounds


def run_compare(entries: list[str], out: str, rounds: int, overrides: list[str] = (), assets: str | None = None, log=info,
                seeds: int = 1, task: str = "addition", keep_rounds: int | None = None) -> list[dict]:
    """Run every method on the demo ``task`` (resuming any that already ran) with ``seeds`` rollout
    seeds (``rollout.seed`` 0 .. seeds-1) and return the comparison table: one row per method, each
    cell the mean over seeds with its sample standard deviation beside it (``<column>_sd``) when there
    is more than one. ``keep_rounds``: as each run finishes, remove the exported policies and optimizer
    state of all its rounds but the newest ``keep_rounds`` (:func:`prune_rounds`; a real model's runs
    keep about 2 GB a round each)."""
    parsed = check_compare(entries, overrides, seeds, task, keep_rounds)
    labels = [p[0] for p in parsed]
    out_dir = Path(out).resolve()
    per_seed, per_round = [], []
    # One set of engines for all runs: each run reloads its own weights into the rollout engine (its
    # requests carry their seeds) and the teacher loads once; starting vLLM per run cost ~20 s each here.
    live = LiveModels(keep=True, log=log)
    try:
        for i, (label, _, method_overrides) in enumerate(parsed):
            for seed in range(seeds):
                log(f"compare: {label} ({i + 1}/{len(parsed)})" + (f", seed {seed} ({seed + 1}/{seeds})" if seeds > 1 else ""))
                folder = method_folder(out_dir, i, label, seed, seeds)
                seeded = [f"rollout.seed={seed}"] if seeds > 1 else []
                # Methods after the first replay its round-0 rollouts of the same seed where their
                # settings allow (`gndpo fork`), so every method starts from identical samples.
                first = str(method_folder(out_dir, 0, labels[0], seed, seeds) / "run") if i else None
                demo_rows = run_demo(str(folder), rounds, [*overrides, *seeded, *method_overrides], assets=assets, log=log,
                                     fork_from=first, task=task, live=live)
                if keep_rounds is not None:
                    prune_rounds(open_run(str(folder / "run")), keep_rounds)
                row, by_round = method_row(label, str(folder / "run"), demo_rows[-1]["heldout_acc"])
                per_seed.append({**row, "seed": seed} if seeds > 1 else row)
                per_round += [{"method": label, "seed": seed, **r} for r in by_round]
    finally:
        live.close()
    rows = [seed_mean([r for r in per_seed if r["method"] == label]) for label in labels] if seeds > 1 else per_seed
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"task": task, "rounds": rounds, "overrides": list(overrides), "seeds": seeds, "rows": rows}
    if seeds > 1:
        summary["runs"] = per_seed
    summary["per_round"] = per_round
    (out_dir / "compare.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "compare.md").write_text(markdown_table(rows))
    return rows


def check_compare(entries: list[str], overrides, seeds: int, task: str, keep_rounds: int | None) -> list[tuple[str, str, list[str]]]:
    """The parsed method entries, once every argument of a comparison is known good (before anything runs)."""
    parsed = [parse_entry(e) for e in entries]
    if not parsed:
        raise GndpoError("compare: name at least one method")
    labels = [p[0] for p in parsed]
    if len(set(labels)) != len(labels):
        raise GndpoError("compare: a method is listed twice")
    if seeds < 1:
        raise GndpoError("compare: --seeds must be at least 1")
    if keep_rounds is not None and keep_rounds < 1:
        raise GndpoError("compare: --keep-rounds must be at least 1")
    if seeds > 1 and any(o.split("=", 1)[0].strip() == "rollout.seed" for o in [*overrides, *(o for p in parsed for o in p[2])]):
        raise GndpoError("compare: --seeds sets rollout.seed for each run; leave rollout.seed out of the overrides")
    check_task(task)
    return parsed


def method_folder(out_dir: Path, index: int, label: str, seed: int, seeds: int) -> Path:
    """Where one method's demo runs: ``<out>/<index>-<method>/``, and with several seeds one
    ``seed-<s>/`` folder per seed inside it."""
    folder = out_dir / f"{index:02d}-{label.split('+')[0]}"
    return folder / f"seed-{seed}" if seeds > 1 else folder


def seed_mean(runs: list[dict]) -> dict:
    """One method's row over its seeds: each numeric column's mean, and ``<column>_sd`` its sample
    standard deviation (None where a column has no value in some seed)."""
    row: dict = {"method": runs[0]["method"], "seeds": len(runs)}
    for col in runs[0]:
        if col in ("method", "seed"):
            continue
        values = [r.get(col) for r in runs]
        if any(v is None for v in values):
            row[col], row[f"{col}_sd"] = None, None
            continue
        arr = np.asarray(values, dtype=np.float64)
        row[col], row[f"{col}_sd"] = float(arr.mean()), float(arr.std(ddof=1))
    return row


def markdown_table(rows: list[dict]) -> str:
    """The table in Markdown; a column with a ``_sd`` partner is shown as "mean ± sd"."""
    cols = [c for c in rows[0] if not c.endswith("_sd")]
    fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731

    def cell(r: dict, c: str) -> str:
        sd = r.get(f"{c}_sd")
        return f"{fmt(r.get(c))} ± {sd:.3f}" if sd is not None else fmt(r.get(c))

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r, c) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"
