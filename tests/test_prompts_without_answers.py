"""Prompts without answers: on-policy distillation needs no labels. init decides from the method, its
rewards and the teacher context whether the training prompts must have answers; without them each
round's held-out figure is label-free (the reverse-KL estimate on a sampled response, the teacher's
log-prob of the greedy one), computed by score and shown by status, the report and the metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from gndpo.pipeline.config.load import config_from_dict
from gndpo.pipeline.methods import METHODS, answer_readers
from gndpo.pipeline.observe.metrics import collect_metrics
from gndpo.pipeline.run.run import open_run
from gndpo.stages.models.live import LiveModels
from gndpo.storage.shards import read_shard
from tests.conftest import assert_one_line_error, invoke, invoke_ok, model_logprob_tol, run_stages, tiny_config_dict, write_config


def without_answers(source: Path, dest: Path, as_messages: bool = False) -> Path:
    """``source``'s prompts with their answers dropped: a ``prompt`` column only, or ``messages`` only."""
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    keep = [{"messages": [{"role": "user", "content": r["prompt"]}]} if as_messages else {"prompt": r["prompt"]} for r in rows]
    dest.write_text("".join(json.dumps(r) + "\n" for r in keep))
    return dest


def prompt_only_config(tmp_path: Path, tiny_assets: Path, as_messages: bool = False, splits=("train", "heldout"), **sections) -> Path:
    cfg = tiny_config_dict(tiny_assets, **sections)
    cfg["data"] = {split: str(without_answers(tiny_assets / f"{split}.jsonl", tmp_path / f"{split}.jsonl", as_messages))
                   for split in splits}
    return write_config(tmp_path, cfg)


def method_config(**method) -> dict:
    return config_from_dict({"method": method})


def test_what_needs_answers():
    assert answer_readers(config_from_dict({})) == ""  # GNDPO learns from the teacher alone
    for name in ("opd", "reverse_kl", "forward_kl", "tropd"):
        assert answer_readers(config_from_dict({"method": {"name": name}})) == "", name
    assert answer_readers(config_from_dict({"method": {"name": "gndpo", "tip": {"enabled": True}}})) == ""
    assert answer_readers(config_from_dict({"method": {"name": "grpo"}})) == "method.name grpo (reward exact_match)"
    # GRPO on format rewards alone reads no answer; a reward-weighted run does through the run's reward.
    assert answer_readers(config_from_dict({"method": {"name": "grpo", "outcome": {"rewards": ["math_format"]}}})) == ""
    assert answer_readers(config_from_dict({"reward": "math", "method": {"reward_beta": 0.5}})) == "method.reward_beta > 0 (reward math)"
    assert answer_readers(config_from_dict({"method": {"paced": {"enabled": True}}})).startswith("method.paced.enabled")
    context = {"messages": [{"role": "user", "content": "{prompt} (The answer is {answer}.)"}]}
    assert "teacher_context" in answer_readers(config_from_dict({"teacher": "self", "teacher_context": context}))


def test_only_the_reward_methods_need_answers():
    """docs/getting-started/models-and-data.md's table: of the methods, the outcome ones and PACED read the answer."""
    needing = {name for name in METHODS if answer_readers(config_from_dict({"method": {"name": name}}))}
    assert needing == {"grpo", "gdpo", "paced"}


def test_grpo_on_prompts_without_answers_is_refused(tmp_path, tiny_assets):
    config = prompt_only_config(tmp_path, tiny_assets)
    result = invoke("init", tmp_path / "run", "--config", config, "method.name=grpo")
    assert_one_line_error(result, "method.name grpo (reward exact_match) needs answers", "has no 'answer' column", "(columns: prompt)")
    assert not (tmp_path / "run" / "run.yaml").exists()


def teacher_logprob_of(model_dir: Path, prompt: list[int], response: list[int]) -> np.ndarray:
    """An independent forward of the teacher: log p(response token | prefix) per response token."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
    return logp[len(prompt) - 1 :, :].gather(1, torch.tensor(response)[:, None]).squeeze(1).numpy()


@pytest.mark.slow
def test_two_rounds_of_gndpo_on_prompts_only(tmp_path, tiny_assets):
    """`gndpo run` trains 2 rounds on one prompt-only file (data.train alone: init holds a few of its
    prompts out); each round's score stage reports the held-out reverse-KL estimate and the teacher's
    log-prob of the greedy responses, which equal a re-derivation from the stored held-out rows and an
    independent teacher forward; status, the metrics and the report show them."""
    run_dir = tmp_path / "run"
    invoke_ok("init", run_dir, "--config", prompt_only_config(tmp_path, tiny_assets, splits=("train",)), "data.heldout_share=0.1")
    assert 0 < len(open_run(str(run_dir)).prompts("heldout")) < 24
    invoke_ok("run", run_dir, "--rounds", 2)
    run = open_run(str(run_dir))
    assert run.heldout_measure() == "label_free"
    by = {(m["round"], m["stage"]): m for m in collect_metrics(run)}
    for r in (0, 1):
        assert "heldout_accuracy" not in by[(r, "rollout")] and by[(r, "rollout")]["reward_mean"] is None
        assert np.isfinite(by[(r, "score")]["heldout_reverse_kl"]) and by[(r, "score")]["heldout_teacher_logprob"] < 0

    # Round 0's figures from its stored held-out rows: sampler log-probs (fp32 engine) and the teacher.
    files = [f for u in run.records(0, "rollout").manifest().units if not u.is_work for f in u.files]
    rows = read_shard(run.fs, files[0]).to_pylist()
    assert sorted({r["sample_idx"] for r in rows}) == [0, 1] and len(rows) == 2 * len(run.prompts("heldout"))
    kl, greedy = [], []
    for row in rows:
        teacher = teacher_logprob_of(tiny_assets / "teacher", row["prompt_token_ids"], row["response_token_ids"])
        if row["sample_idx"] == 1:
            kl += list(np.asarray(row["sampler_logprobs"]) - teacher)
        else:
            greedy += list(teacher)
    # Means of the teacher's log-probs (score's forward against this one), each within atol + rtol *
    # |lp| <= 2 * atol of two float32 forwards' rounding (tests/conftest.py).
    tol = model_logprob_tol(tiny_assets / "teacher")
    assert by[(0, "score")]["heldout_reverse_kl"] == pytest.approx(np.mean(kl), abs=2 * tol["atol"])
    assert by[(0, "score")]["heldout_teacher_logprob"] == pytest.approx(np.mean(greedy), abs=2 * tol["atol"])

    status = invoke_ok("status", run_dir).output
    assert "heldout_kl" in status and f"{by[(1, 'score')]['heldout_reverse_kl']:.4g}"[:5] in status
    invoke_ok("report", run_dir, "--out", tmp_path / "report")
    page = (tmp_path / "report" / "report.html").read_text()
    assert 'alt="heldout_kl"' in page and 'alt="heldout_teacher_logprob"' in page and "heldout_reverse_kl" in page  # figures, table
    assert (tmp_path / "report" / "heldout_kl.png").stat().st_size > 1000


@pytest.mark.slow
def test_messages_only_prompts_run_two_rounds(tmp_path, tiny_assets):
    """A prompts file with only ``messages`` (and held-out prompts alike) inits and trains 2 rounds of
    GNDPO in this process on kept engines, with the label-free held-out measure each round."""
    run_dir = tmp_path / "run"
    invoke_ok("init", run_dir, "--config", prompt_only_config(tmp_path, tiny_assets, as_messages=True))
    live = LiveModels(keep=True)
    try:
        for r in (0, 1):
            run_stages(run_dir, "rollout", "score", "normalize", "train", round_idx=r, live=live)
    finally:
        live.close()
    by = {(m["round"], m["stage"]): m for m in collect_metrics(open_run(str(run_dir)))}
    assert all(np.isfinite(by[(r, "score")]["heldout_reverse_kl"]) for r in (0, 1))
    assert (run_dir / "rounds" / "r0001" / "train" / "_MANIFEST.json").exists()
