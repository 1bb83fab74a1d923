"""One on-policy distillation round: gndpo against TRL's GKDTrainer, on the same work, in the same run.

Same student and teacher, prompts, samples per prompt, response length, optimizer steps, learning rate
and objective: gndpo's ``reverse_kl`` (on the teacher's top-16) against GKD with ``lmbda=1, beta=1``
(reverse KL, sampled from the student every step). Both in fp32 on CPU, each as the whole process a user
would start:

* gndpo: ``gndpo init`` (not timed), then ``gndpo run RUN --rounds 1`` timed from start to exit: the
  vLLM engine start, rollout, score, normalize, train and the export of the new student, with the
  stages committed to the run folder as always;
* TRL: ``bench/trl_gkd.py`` timed from start to exit (imports, models, ``train()``, saving).

Afterwards (not timed) both students are evaluated by the same ``gndpo eval`` on the held-out prompts,
where the workload has an accuracy (the toy demo's; W's random-weight models have none).

Each process's peak memory is sampled from /proc with its descendants (vLLM's engine processes, train's
ranks): :func:`common.run_measured`.

Workloads: ``demo`` (1024 prompts x 8 samples, 8 tokens, 32 steps of 256 sequences, lr 1e-4), ``w``
(:mod:`bench.workload`: 64 prompts x 4 samples x 64 tokens on CPU, one step), and ``smollm2``
(SmolLM2-135M-Instruct as student and, the same folder, as teacher; 32 short chat questions x 2 samples
x 24 tokens, 2 steps of 32 sequences, lr 1e-6), and ``smollm2-seeds``, the seeds' shape on the same
model: 8 of those questions, each behind an eight-example few-shot preamble (about 5x the response's
length), x 8 samples x 24 tokens, 2 steps of 32 sequences. Run standalone or from ``run_all.py``; writes
``results/round_vs_trl.json`` (demo, w) and the ``round`` entry of ``results/smollm2.json`` (smollm2,
whose run folder ``smollm2_throughput.py`` then reads) or its ``round_seeds_shape`` entry.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from gndpo.pipeline.exec.status import phase_rows
from gndpo.pipeline.run.products import POLICY
from gndpo.pipeline.run.run import open_run

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, gndpo_cmd, run_measured, save_json  # noqa: E402
from workload import (  # noqa: E402
    CPU_SCALE,
    FULL_SCALE,
    SEEDS_SCALE,
    SEEDS_STEPS,
    SMOLLM2_SCALE,
    SMOLLM2_STEPS,
    build_seeds_workload,
    build_smollm2_workload,
    build_workload,
    smollm2_config,
    workload_config,
    write_config,
)


def demo_workload(folder: Path) -> dict:
    """The demo's round with method reverse_kl; returns the config dict and TRL's arguments."""
    from gndpo.apps.demo import write_demo_config
    from gndpo.apps.demos.arithmetic import ensure_toy_assets

    assets = ensure_toy_assets(log=lambda *_: None)
    cfg = yaml.safe_load(write_demo_config(folder / "base", assets).read_text())
    cfg["method"] = {"name": "reverse_kl"}
    cfg["rollout"]["eval_heldout"] = False
    rc, tc = cfg["rollout"], cfg["train"]
    trl = {"student": cfg["student"], "teacher": cfg["teacher"], "prompts": cfg["data"]["train"], "count": rc["prompts_per_round"],
           "n": rc["n"], "max-new-tokens": rc["max_tokens"], "steps": tc["optimizer_steps"],
           "batch": rc["prompts_per_round"] * rc["n"] // tc["optimizer_steps"], "micro": tc["micro_batch_size"], "lr": tc["lr"]}
    return {"config": cfg, "trl": trl, "heldout": cfg["data"]["heldout"], "eval_tokens": rc["max_tokens"]}


def w_workload(scale) -> dict:
    assets = build_workload()
    cfg = workload_config(assets, scale)
    trl = {"student": cfg["student"], "teacher": cfg["teacher"], "prompts": cfg["data"]["train"], "count": scale.prompts,
           "n": scale.n, "max-new-tokens": scale.max_tokens, "steps": 1, "batch": scale.prompts * scale.n,
           "micro": cfg["train"]["micro_batch_size"], "lr": cfg["train"]["lr"]}
    return {"config": cfg, "trl": trl, "heldout": None, "eval_tokens": scale.max_tokens}


def smollm2_workload(seeds_shape: bool = False, rounds: int = 1) -> dict:
    """SmolLM2-135M-Instruct against itself on 32 chat questions (:func:`workload.build_smollm2_workload`),
    or, with ``seeds_shape``, on 8 of them behind a few-shot preamble, 8 samples each
    (:func:`workload.build_seeds_workload`). Over ``rounds`` rounds gndpo writes its optimizer state
    once (``train.state_every``), and TRL takes the rounds' steps over their prompts in one run."""
    assets = build_seeds_workload() if seeds_shape else build_smollm2_workload()
    scale, steps = (SEEDS_SCALE, SEEDS_STEPS) if seeds_shape else (SMOLLM2_SCALE, SMOLLM2_STEPS)
    cfg = smollm2_config(assets, scale, steps)
    cfg["train"]["state_every"] = rounds
    batch = scale.prompts * scale.n // steps
    trl = {"student": cfg["student"], "teacher": cfg["teacher"], "prompts": cfg["data"]["train"], "count": scale.prompts * rounds,
           "n": scale.n, "max-new-tokens": scale.max_tokens, "steps": steps * rounds, "batch": batch,
           "micro": cfg["train"]["micro_batch_size"], "lr": cfg["train"]["lr"], "check-prompts": True}
    return {"config": cfg, "trl": trl, "heldout": None, "eval_tokens": scale.max_tokens, "rounds": rounds}


# A one-round gndpo run without what TRL's round leaves out too: the student's entropy metric (so score
# takes the fp32 rollout engine's log-probs instead of a student forward, score.student_logprobs auto)
# and the optimizer state for a next round (written every 2nd round: not at all in a one-round run).
LEAN = {"logging.entropy_metrics": False, "train.state_every": 2}


def lean_config(cfg: dict) -> dict:
    """``cfg`` with the :data:`LEAN` settings."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in cfg.items()}
    for key, value in LEAN.items():
        section, name = key.split(".")
        out.setdefault(section, {})[name] = value
    return out


def heldout_accuracy(target: Path, heldout: str | None, max_tokens: int, out: Path) -> float | None:
    if heldout is None:
        return None
    args = [str(target), "--out", str(out)]
    if not (target / "run.yaml").exists():
        args += ["--prompts", heldout, "--reward", "exact_match", "--max-tokens", str(max_tokens)]
    subprocess.run(gndpo_cmd("eval", *args), check=True, capture_output=True)
    return json.loads((out / "summary.json").read_text())["pass@1"]


def train_bytes(run, round_idx: int) -> int:
    """Bytes round ``round_idx``'s train wrote: its commit's files, and an optimizer state written after
    the commit (train.state_async), which the commit only names."""
    commit = run.records(round_idx, POLICY).require_manifest().only()
    pending = commit.numbers.optimizer_state.pending if commit.numbers.optimizer_state else None
    return commit.bytes + (run.fs.read_json(pending)["bytes"] if pending else 0)


def gndpo_round(work: dict, folder: Path) -> dict:
    run = folder / "run"
    subprocess.run(gndpo_cmd("init", str(run), "--config", str(write_config(folder / "config.yaml", work["config"]))),
                   check=True, capture_output=True)
    rounds = work.get("rounds", 1)
    seconds, _, memory = run_measured(gndpo_cmd("run", str(run), "--rounds", str(rounds)), folder / "gndpo-run.log")
    stages = {m["stage"]: m.get("seconds") for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    tokens = sum(open_run(str(run)).records(r, "rollout").manifest().metrics["tokens"] for r in range(rounds))
    written = [train_bytes(open_run(str(run)), r) for r in range(rounds)]
    # Where each stage's time went (`gndpo status --phases`): seconds per phase, MB written.
    phases = {row.pop("stage"): {k: v for k, v in row.items() if k != "round" and v} for row in phase_rows(open_run(str(run)))}
    return {"wall_s": round(seconds, 2), "stage_compute_s": stages, "phases": phases, "response_tokens": tokens, "memory": memory,
            "train_mb_written_per_round": [round(b / 1e6, 1) for b in written],
            "heldout_acc": heldout_accuracy(run, work["heldout"], work["eval_tokens"], folder / "eval-gndpo")}


def trl_round(work: dict, folder: Path) -> dict:
    out = folder / "trl-student"
    argv = [sys.executable, str(HERE / "trl_gkd.py"), "--out", str(out)]
    for key, value in work["trl"].items():
        argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    seconds, log, memory = run_measured(argv, folder / "trl.log")
    inner = json.loads(log.strip().splitlines()[-1])
    return {"wall_s": round(seconds, 2), **inner, "memory": memory,
            "heldout_acc": heldout_accuracy(out, work["heldout"], work["eval_tokens"], folder / "eval-trl")}


def round_brief(r: dict) -> dict:
    """The figures of an earlier smollm2 round that ``results/smollm2.json`` keeps."""
    side = lambda x: {"wall_s": x["wall_s"], **{k: x.get("memory", {}).get(k) for k in ("cpu_s", "other_cores", "peak_tree_pss_gib")}}  # noqa: E731
    return {"measured_at": r.get("measured_at"), "speedup": r["speedup"], "gndpo": side(r["gndpo"]), "trl": side(r["trl"])}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", action="append", choices=["demo", "w", "smollm2", "smollm2-seeds", "smollm2-seeds-3-rounds"],
                    help="default: w and demo")
    ap.add_argument("--full", action="store_true", help="W at its full size (256 x 4 x 256): for a GPU machine")
    ap.add_argument("--work-dir", default="/tmp/gndpo-bench/round_vs_trl")
    a = ap.parse_args(argv)
    results = {}
    for name in a.workload or ["w", "demo"]:
        folder = Path(a.work_dir) / name
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        folder.mkdir(parents=True)
        work = {"demo": lambda: demo_workload(folder), "smollm2": smollm2_workload, "smollm2-seeds": lambda: smollm2_workload(True),
                "smollm2-seeds-3-rounds": lambda: smollm2_workload(True, rounds=3),
                "w": lambda: w_workload(FULL_SCALE if a.full else CPU_SCALE)}[name]()
        t0 = time.time()
        g = gndpo_round(work, folder / "gndpo")
        t = trl_round(work, folder / "trl")
        results[name] = {"gndpo": g, "trl": t, "speedup": round(t["wall_s"] / g["wall_s"], 2),
                         "workload": {k: work["trl"][k] for k in ("count", "n", "max-new-tokens", "steps", "batch", "lr")}}
        if name == "smollm2":  # the same round without the two things TRL's round does not do either
            lean = {**work, "config": lean_config(work["config"])}
            w = gndpo_round(lean, folder / "gndpo-lean")
            results[name].update(gndpo_lean=w, lean_settings=LEAN, lean_speedup=round(t["wall_s"] / w["wall_s"], 2))
        if name == "smollm2-seeds":  # the same round reading every prompt + response whole: what shared prompts save
            whole = {**work, "config": {**work["config"], "model": {**work["config"].get("model", {}), "shared_prompts": False}}}
            w = gndpo_round(whole, folder / "gndpo-whole-sequences")
            results[name].update(gndpo_whole_sequences=w, shared_prompts_speedup=round(w["wall_s"] / g["wall_s"], 2))
        results[name]["bench_s"] = round(time.time() - t0, 1)
        print(name, json.dumps(results[name]), flush=True)
    toys = {k: v for k, v in results.items() if not k.startswith("smollm2")}
    if toys:
        save_json(RESULTS / "round_vs_trl.json", toys)
    if "smollm2" in results:
        path = RESULTS / "smollm2.json"
        previous = json.loads(path.read_text()) if path.exists() else {}
        earlier = previous.get("earlier_rounds", [])
        if "round" in previous:  # this machine's timings vary run to run: the last rounds stay beside the new one
            earlier = [*earlier, round_brief(previous["round"])][-5:]
        save_json(path, {**previous, "earlier_rounds": earlier,
                         "round": {**results["smollm2"], "measured_at": time.strftime("%Y-%m-%d %H:%M"),
                                   "run": str(Path(a.work_dir) / "smollm2" / "gndpo" / "run")}})
    for name, key in (("smollm2-seeds", "round_seeds_shape"), ("smollm2-seeds-3-rounds", "rounds_3_seeds_shape")):
        if name in results:
            path = RESULTS / "smollm2.json"
            previous = json.loads(path.read_text()) if path.exists() else {}
            save_json(path, {**previous, key: {**results[name], "measured_at": time.strftime("%Y-%m-%d %H:%M")}})
    return results


if __name__ == "__main__":
    main()
