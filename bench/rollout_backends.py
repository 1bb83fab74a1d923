"""Rollout on vLLM against rollout on the student's own module (``rollout.backend: vllm`` / ``hf``).

For each workload one run per backend, identical but for ``rollout.backend``: ``gndpo init`` (not
timed), then ``gndpo run RUN --rounds 1`` timed from start to exit as its own process, as a user starts
it (imports, the engine start or the model load, rollout, score, normalize, train, the export). From the
run's records: rollout's set-up (vLLM's engine start, or the model load) and compute seconds
(``gndpo status --phases``), its response tokens and tokens per second of compute, and the round's other
stages. Both backends run in the same invocation, one after the other, on the same machine.

Workloads:

* ``toy``: the demo's round (2,048 addition prompts x 8 samples, up to 8 tokens, 64 steps), the toy
  the demo builds; the held-out evaluation off, so rollout only samples the round.
* ``smollm2``: SmolLM2-135M-Instruct against itself, 32 chat questions x 2 samples x up to 24 tokens,
  2 steps (``bench.workload.smollm2_config``).
* ``gemma``: Gemma 3 270M (a 262,144-token vocabulary) against itself, 8 prompts x 4 samples x up to
  24 tokens, 2 steps of 16: the short job where the engine start is the largest fixed cost.

Writes ``results/rollout_backends.{json,md}`` (the table docs/how-to/rollout-backends.md includes).

    .venv/bin/python bench/rollout_backends.py                 # all three, about 12 minutes on 2 cores
    .venv/bin/python bench/rollout_backends.py --workloads toy
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, gndpo_cmd, machine, run_measured, run_timed, save_json  # noqa: E402
from round_vs_trl import demo_workload  # noqa: E402
from workload import SMOLLM2_SCALE, SMOLLM2_STEPS, Scale, build_smollm2_workload, smollm2_config, write_config  # noqa: E402

from gndpo.pipeline.exec.status import phase_rows  # noqa: E402
from gndpo.pipeline.run.run import open_run  # noqa: E402

BACKENDS = ("vllm", "hf")
GEMMA_SCALE, GEMMA_STEPS = Scale(prompts=8, n=4, max_tokens=24), 2


def toy_config(folder: Path) -> dict:
    cfg = demo_workload(folder)["config"]
    cfg["method"] = {"name": "gndpo"}
    return cfg


def smollm2(folder: Path) -> dict:
    return smollm2_config(build_smollm2_workload(), SMOLLM2_SCALE, SMOLLM2_STEPS)


def gemma(folder: Path) -> dict:
    """Gemma 3 270M as student and teacher on SmolLM2's workload's first 8 questions (no chat template:
    the question is the prompt)."""
    from gndpo.apps.demos.real_models import ensure_real_model

    assets = build_smollm2_workload()
    cfg = smollm2_config({**assets, "model": ensure_real_model("gemma3-270m", log=lambda *_: None)}, GEMMA_SCALE, GEMMA_STEPS)
    cfg["engine"] = {"max_model_len": 256, "kv_cache_gib": 0.5}
    return cfg


WORKLOADS = {"toy": toy_config, "smollm2": smollm2, "gemma": gemma}


def one_round(cfg: dict, backend: str, folder: Path) -> dict:
    """``gndpo run --rounds 1`` of ``cfg`` with ``rollout.backend`` ``backend``, timed as its own process."""
    cfg = {**cfg, "rollout": {**cfg["rollout"], "backend": backend}}
    run = folder / "run"
    run_timed(gndpo_cmd("init", str(run), "--config", str(write_config(folder / "config.yaml", cfg))), folder / "init.log")
    seconds, _, memory = run_measured(gndpo_cmd("run", str(run), "--rounds", "1"), folder / "run.log")
    opened = open_run(str(run))
    phases = {row["stage"]: row for row in phase_rows(opened)}
    rollout = opened.records(0, "rollout").manifest().metrics
    compute = phases["rollout"]["compute s"]
    return {
        "round_wall_s": round(seconds, 1), "peak_tree_pss_gib": memory["peak_tree_pss_gib"],
        "rollout_setup_s": phases["rollout"]["setup s"], "rollout_compute_s": compute, "tokens": rollout["tokens"],
        "tokens_per_s": round(rollout["tokens"] / compute, 1),
        "other_stages_s": {s: round(phases[s]["setup s"] + phases[s]["compute s"], 2) for s in ("score", "normalize", "train")},
    }


def markdown(data: dict) -> str:
    lines = [f"### rollout.backend vllm and hf ({data['machine']}, {data['date']})", "",
             "One round as its own process (`gndpo run --rounds 1`), a workload's two backends one after the other in the same "
             "invocation. Set-up: vLLM's engine start, or the module's load; tokens per second of rollout's compute; peak: the "
             "process tree's summed PSS.", "",
             "| workload | backend | round s | rollout set-up s | rollout compute s | tokens | tokens/s | peak GiB | round / vllm's |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, by in data["workloads"].items():
        for backend, r in by.items():
            ratio = r["round_wall_s"] / by["vllm"]["round_wall_s"]
            lines.append(f"| {name} | {backend} | {r['round_wall_s']} | {r['rollout_setup_s']} | {r['rollout_compute_s']} | {r['tokens']} | "
                         f"{r['tokens_per_s']} | {r['peak_tree_pss_gib']} | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    a = ap.parse_args(argv)
    root = Path(a.out or tempfile.mkdtemp(prefix="rollout-backends-"))
    data = {"machine": machine(), "date": datetime.date.today().isoformat(), "workloads": {}}
    saved = RESULTS / "rollout_backends.json"
    if saved.exists() and json.loads(saved.read_text())["machine"] == data["machine"]:
        # The workloads not run this time keep their figures from the same CPU type.
        data["workloads"] = json.loads(saved.read_text())["workloads"]
    for name in a.workloads:
        cfg = WORKLOADS[name](root / name)
        data["workloads"][name] = {backend: one_round(cfg, backend, root / name / backend) for backend in BACKENDS}
        print(name, data["workloads"][name], flush=True)
    save_json(RESULTS / "rollout_backends.json", data)
    (RESULTS / "rollout_backends.md").write_text(markdown(data))
    return data


if __name__ == "__main__":
    main()
