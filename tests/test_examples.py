"""Every config in examples/ inits and runs one round: the example file itself, with only its models and
data swapped for the toy's by key=value settings (and the scale of a round: the toy's 64-token context
and two CPU cores, not a GPU node's), so a config a user copies is one that runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gndpo.pipeline.observe.metrics import collect_metrics
from gndpo.pipeline.run.run import open_run
from gndpo.stages.models.live import LiveModels
from tests.conftest import invoke_ok, run_stages

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CONFIGS = sorted(p.name for p in EXAMPLES.glob("*.yaml"))

# A round at the toy's scale: 16 prompts x 2 samples of 5 tokens, the toy's own context, one kept engine.
TOY_SCALE = [
    "rollout.prompts_per_round=16", "rollout.n=2", "rollout.prompts_per_unit=8", "rollout.max_tokens=5",
    "engine.max_model_len=0", "engine.in_process=true", "score.engine.max_model_len=0",
]


def toy_rows(assets: Path, split: str, data: dict) -> list[dict]:
    """The toy's prompts in the example's columns: a plain prompt under its prompt_key, or a conversation
    under its messages_key; the answer under its answer_key where the example names one (an example that
    names none runs on prompts without answers)."""
    rows = [json.loads(line) for line in (assets / f"{split}.jsonl").read_text().splitlines()]
    messages, answer = data.get("messages_key"), data.get("answer_key")
    prompt = (lambda r: {messages: [{"role": "user", "content": r["prompt"]}]}) if messages else (lambda r: {data.get("prompt_key", "prompt"): r["prompt"]})
    return [{**prompt(r), **({answer: r["answer"]} if answer else {})} for r in rows]


def toy_swap(tmp_path: Path, assets: Path, example: dict) -> list[str]:
    """key=value settings that put the toy's models and prompts (in the example's columns) in place of
    the example's; the toy's character tokenizer reads no system prompt."""
    files = {}
    for split in ("train", "heldout"):
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in toy_rows(assets, split, example.get("data", {}))))
    teachers = [f"teachers.{name}={assets / 'teacher'}" for name in example.get("teachers", {})]
    teacher = [] if teachers or example.get("teacher") == "self" else [f"teacher={assets / 'teacher'}"]
    return [f"student={assets / 'student'}", *teacher, *teachers, f"data.train={files['train']}", f"data.heldout={files['heldout']}",
            "data.system_prompt=''"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_example_inits_and_runs_a_round(name, tmp_path, tiny_assets):
    example = yaml.safe_load((EXAMPLES / name).read_text())
    run_dir = tmp_path / "run"
    invoke_ok("init", run_dir, "--config", EXAMPLES / name, *toy_swap(tmp_path, tiny_assets, example), *TOY_SCALE)
    run = open_run(str(run_dir))
    assert run.cfg.method.name == example["method"]["name"]
    live = LiveModels(keep=True)
    try:
        run_stages(run_dir, "rollout", "score", "normalize", "train", live=live)
    finally:
        live.close()
    by = {m["stage"]: m for m in collect_metrics(run)}
    assert set(by) == {"rollout", "score", "normalize", "train"}, by
    assert by["train"]["model_dir"]
    # The held-out figure: accuracy where the example's prompts have answers, else the label-free one.
    assert ("heldout_accuracy" in by["rollout"]) == ("answer_key" in example.get("data", {}))
    assert ("heldout_reverse_kl" in by["score"]) != ("answer_key" in example.get("data", {}))
