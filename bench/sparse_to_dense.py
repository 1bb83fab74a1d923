"""The sparse-to-dense principle at equal compute: three ways to spend the same rounds.

Each arm spends ``--rounds`` rounds of the same size (prompts x samples x tokens, optimizer steps):

* ``grpo-student``: GRPO on the student for every round (sparse reward only);
* ``distill``: forward-KL on-policy distillation of the student from the untouched teacher, every round;
* ``recipe``: `gndpo recipe sparse-to-dense`: GRPO on the teacher for the first half of the rounds,
  then forward-KL distillation of the student from the policy that ended on.
* ``recipe-rl-lr-1e-5`` (with ``--gentle-rl``): the recipe with stage 1 at a tenth of the learning rate.

Two workloads:

* ``toy`` (default): the addition task (the demo's settings, fewer prompts a round), with the toy
  build's three checkpoints of one training run: the student (held-out exact match 0.202), the "mid"
  model (0.786, a teacher reinforcement learning can still improve) as the teacher, and the demo's
  teacher (0.978, unused here).
* ``smollm2``: a real pretrained model, SmolLM2-135M-Instruct, on the self-distillation demo's short
  factual questions, rewarded by ``answer_match`` (the "Answer: X." format and the right answer). The
  student reads the bare question; the teacher is the same pretrained model reading three
  demonstrations before it (its privileged context), which gives it the format. The recipe's stage 1
  reinforces that teacher on prompts that hold the demonstrations, so stage 2's teacher reads exactly
  what it was reinforced on. 32 questions x 4 samples x 24 tokens, 4 optimizer steps a round.

Per arm and rollout seed: the student's held-out exact match after each of its rounds (the recipe's
student trains only in its second half), the reinforced teacher's, the rollout tokens and optimizer
steps spent, and the wall time. Writes ``results/sparse_to_dense.{json,md}``.

    .venv/bin/python bench/sparse_to_dense.py                       # toy: 3 seeds, 4 rounds of 512 prompts
    .venv/bin/python bench/sparse_to_dense.py --workload smollm2 --gentle-rl   # SmolLM2: 3 seeds, 4 rounds of 32 prompts
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, gndpo_cmd, machine, run_timed, save_json  # noqa: E402

from gndpo.apps.demo import TASKS, demo_config_data  # noqa: E402
from gndpo.apps.demos.self_distill import context_messages  # noqa: E402
from gndpo.pipeline.observe.metrics import collect_metrics  # noqa: E402
from gndpo.pipeline.run.products import POLICY  # noqa: E402
from gndpo.pipeline.run.run import open_run  # noqa: E402

ARMS = ("grpo-student", "distill", "recipe")
# Recipe arms that change stage 1 (the teacher's reinforcement) only: arm -> its --rl-set overrides.
RECIPE_VARIANTS = {"recipe": [], "recipe-rl-lr-1e-5": ["train.lr=1e-5"]}


def write_yaml(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def toy_base(folder: Path, prompts: int, seed: int) -> tuple[Path, list[str]]:
    """The addition demo's config with the mid checkpoint as the teacher, ``prompts`` a round (steps
    scaled to keep 256 sequences a step) and rollout seed ``seed``; no stage-1 overrides."""
    config, ensure_assets, _, models = TASKS["addition"]
    assets = ensure_assets()
    cfg = demo_config_data(assets, config, models)
    cfg["teacher"] = str(assets / "mid")
    cfg["rollout"].update(prompts_per_round=prompts, seed=seed)
    cfg["train"]["optimizer_steps"] = prompts * cfg["rollout"]["n"] // 256
    return write_yaml(folder / "base.yaml", cfg), []


def with_demonstrations(src: Path, dst: Path) -> Path:
    """``src``'s questions as conversations that hold the teacher's demonstrations first."""
    rows = [json.loads(line) for line in src.read_text().splitlines()]
    turns = context_messages()
    dst.write_text("".join(json.dumps({"messages": [{**t, "content": t["content"].format(prompt=r["prompt"])} for t in turns],
                                       "answer": r["answer"]}) + "\n" for r in rows))
    return dst


def smollm2_base(folder: Path, prompts: int, seed: int) -> tuple[Path, list[str]]:
    """The self-distillation demo's config rewarded by ``answer_match``, with the pretrained model
    reading the demonstrations as a teacher (a model path, not ``self``, so stage 1 can reinforce it),
    ``prompts`` questions x 4 samples a round and rollout seed ``seed``; and stage 1's overrides: its
    prompts hold the demonstrations (the teacher's own view), so it needs no teacher context."""
    config, ensure_assets, _, models = TASKS["self-distill"]
    assets = ensure_assets()
    cfg = demo_config_data(assets, config, models)
    cfg["teacher"] = cfg["student"]
    cfg["reward"] = "answer_match"
    cfg["rollout"].update(prompts_per_round=prompts, prompts_per_unit=prompts, n=4, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    shown = {name: with_demonstrations(Path(cfg["data"][name]), folder / f"{name}-with-demonstrations.jsonl") for name in ("train", "heldout")}
    rl = [f"data.train={shown['train']}", f"data.heldout={shown['heldout']}", "teacher_context.messages=[]"]
    return write_yaml(folder / "base.yaml", cfg), rl


WORKLOADS = {"toy": (toy_base, 512), "smollm2": (smollm2_base, 32)}


def heldout_after_rounds(run_url: str) -> list[float]:
    """The held-out exact match of the policy each round rolled out with, then of the final policy."""
    by = {(m["round"], m["stage"]): m for m in collect_metrics(open_run(run_url))}
    scores = [by[(r, "rollout")]["heldout_accuracy"] for r in sorted(r for r, s in by if s == "rollout")]
    out = Path(run_url + "-eval")
    shutil.rmtree(out, ignore_errors=True)
    run_timed(gndpo_cmd("-q", "eval", run_url, "--out", str(out)), out.with_suffix(".log"))
    return scores + [json.loads((out / "summary.json").read_text())["pass@1"]]


def spent(run_url: str) -> dict:
    run = open_run(run_url)
    rounds = run.newest_policy_version()
    tokens = sum(run.records(r, "rollout").manifest().metrics["tokens"] for r in range(rounds))
    steps = sum(len(run.records(r, POLICY).require_manifest().only().numbers.steps) for r in range(rounds))
    return {"rounds": rounds, "rollout_tokens": tokens, "optimizer_steps": steps}


def run_arm(arm: str, folder: Path, base: Path, rl_overrides: list[str], rounds: int) -> dict:
    """One arm's runs under ``folder``, or their result where a finished arm left ``result.json``. Each
    run keeps only its newest round's policy afterwards (a SmolLM2 round writes 2 GB)."""
    if (folder / "result.json").exists():
        return json.loads((folder / "result.json").read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    t0 = time.time()
    if arm in RECIPE_VARIANTS:
        rl_overrides = [*rl_overrides, *RECIPE_VARIANTS[arm]]
        half = rounds // 2
        run_timed(gndpo_cmd("-q", "recipe", "sparse-to-dense", str(folder), "--config", str(base), "--rl-rounds", str(half),
                            "--distill-rounds", str(rounds - half), *(a for o in rl_overrides for a in ("--rl-set", o))),
                  folder.with_suffix(".log"))
        teacher, student = str(folder / "teacher-rl"), str(folder / "distill")
        result = {"teacher_heldout": heldout_after_rounds(teacher), "teacher_spent": spent(teacher)}
    else:
        student = str(folder / "run")
        method = "grpo" if arm == "grpo-student" else "forward_kl"
        run_timed(gndpo_cmd("-q", "init", student, "--config", str(base), f"method.name={method}"), folder.with_suffix(".init.log"))
        run_timed(gndpo_cmd("-q", "run", student, "--rounds", str(rounds)), folder.with_suffix(".log"))
        result = {}
    result.update(student_heldout=heldout_after_rounds(student), student_spent=spent(student), wall_s=round(time.time() - t0, 1))
    for run in {student, *([teacher] if arm in RECIPE_VARIANTS else [])}:
        run_timed(gndpo_cmd("-q", "gc", run, "--keep-rounds", "1"), Path(run + "-gc.log"))
    (folder / "result.json").write_text(json.dumps(result))
    return result


def markdown(results: dict, arms: tuple) -> str:
    lines = [f"| arm | student held-out after each of its rounds (mean ± sd over {len(results)} seeds) | final | "
             "reinforced teacher (recipe) | rollout tokens | optimizer steps | wall |", "|---|---|---:|---|---:|---:|---:|"]
    for arm in arms:
        runs = [results[s][arm] for s in results]
        curves = np.array([r["student_heldout"] for r in runs])
        mean, sd = curves.mean(0), curves.std(0)
        cells = ", ".join(f"{m:.3f}±{d:.3f}" for m, d in zip(mean, sd))
        teacher = ""
        if arm in RECIPE_VARIANTS:
            t = np.array([r["teacher_heldout"] for r in runs]).mean(0)
            teacher = " -> ".join(f"{v:.3f}" for v in t)
        tokens = sum(r["student_spent"]["rollout_tokens"] + r.get("teacher_spent", {}).get("rollout_tokens", 0) for r in runs) / len(runs)
        steps = sum(r["student_spent"]["optimizer_steps"] + r.get("teacher_spent", {}).get("optimizer_steps", 0) for r in runs) / len(runs)
        wall = sum(r["wall_s"] for r in runs) / len(runs)
        lines.append(f"| {arm} | {cells} | {mean[-1]:.3f} | {teacher} | {tokens:,.0f} | {steps:.0f} | {wall:.0f} s |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="toy")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, help="prompts a round (toy: 512, the demo's 2048; smollm2: 32)")
    ap.add_argument("--work-dir", default="/tmp/gndpo-bench/sparse_to_dense")
    ap.add_argument("--gentle-rl", action="store_true", help="also the recipe with stage 1 at a tenth of the learning rate (train.lr=1e-5)")
    a = ap.parse_args(argv)
    make_base, default_prompts = WORKLOADS[a.workload]
    arms = (*ARMS, "recipe-rl-lr-1e-5") if a.gentle_rl else ARMS
    prompts = a.prompts or default_prompts
    results = {}
    for seed in range(a.seeds):
        work = Path(a.work_dir) / a.workload / f"seed-{seed}"
        base, rl_overrides = make_base(work, prompts, seed)
        results[seed] = {arm: run_arm(arm, work / arm, base, rl_overrides, a.rounds) for arm in arms}
        print(json.dumps({"seed": seed, **{arm: r["student_heldout"] for arm, r in results[seed].items()}}), flush=True)
    table = markdown(results, arms)
    name = "sparse_to_dense" if a.workload == "toy" else f"sparse_to_dense_{a.workload}"
    save_json(RESULTS / f"{name}.json", {"machine": machine(), "workload": a.workload, "rounds": a.rounds, "prompts_per_round": prompts,
                                         "measured_at": time.strftime("%Y-%m-%d %H:%M"), "runs": results})
    (RESULTS / f"{name}.md").write_text(table)
    print(table)
    return results


if __name__ == "__main__":
    main()
