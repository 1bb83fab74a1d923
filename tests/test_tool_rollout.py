"""Multi-turn tool use through the real stages: vLLM rollouts with the calculator, teacher scoring,
normalize, and the train loss, on a small build of the tool-use toy.

One reference run goes through rollout, score and normalize; a second run with the same config is
SIGKILLed after the second turn of its first unit and rerun, and must end with exactly the reference's
rows. The train loss on the reference's rows must have exactly zero gradient at every position that
predicts a prompt, tool or template token.
"""

import signal

import numpy as np
import pytest
import torch
import yaml

from gndpo.apps.demos.arithmetic import ModelSpec
from gndpo.pipeline.run.run import open_run
from gndpo.pipeline.tasks.rewards import math_answer, tool_correctness, tool_format
from tests.conftest import (
    assert_one_line_error,
    committed_rows,
    float32_sum_tol,
    forward_terms,
    gndpo_killed,
    invoke,
    invoke_ok,
    logprob_tol,
    model_logprobs,
    round_share,
    run_stages,
    write_config,
)

pytestmark = pytest.mark.slow
ROUND = ("--round", "0")


@pytest.fixture(scope="module")
def tool_assets(cache_dir):
    """The tool-use toy, small: a student that calls the calculator on about half of its samples."""
    from gndpo.apps.demos.tool_task import ToolToySpec, ensure_tool_toy_assets

    spec = ToolToySpec(
        n_train_prompts=64, n_heldout=12, teacher_target=0.5, student_tool_share=0.5, student_call_share=0.6, student_max_steps=60,
        model=ModelSpec(layers=2, hidden=64, heads=2, max_steps=120, lr=3e-3, batch=64),
    )
    return ensure_tool_toy_assets(spec, log=lambda *_: None)


def tool_config(folder, assets):
    cfg = {
        "student": str(assets / "student"), "teacher": str(assets / "teacher"), "reward": "math",
        # GNDPO with GRPO's outcome advantage mixed in, from GDPO's tool-use rewards and the answer.
        "method": {"name": "gndpo", "outcome": {"rewards": ["tool_format", "tool_correctness", "math"], "coef": 0.5}},
        "data": {"train": str(assets / "train.jsonl"), "heldout": str(assets / "heldout.jsonl")},
        "rollout": {"prompts_per_round": 16, "n": 3, "prompts_per_unit": 8, "max_tokens": 20, "tools": ["calculator"],
                    "max_turns": 3, "max_tool_response_tokens": 48},
        "score": {"rows_per_chunk": 16},
        "train": {"lr": 1e-3, "optimizer_steps": 1, "micro_batch_size": 64},
        "engine": {"max_model_len": 128, "in_process": True},
    }
    return write_config(folder, cfg)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tool_assets):
    folder = tmp_path_factory.mktemp("tools-reference")
    run = folder / "run"
    invoke_ok("init", run, "--config", tool_config(folder, tool_assets))
    run_stages(run, "rollout", "score", "normalize")
    return run


@pytest.fixture(scope="module")
def tok(tool_assets):
    from gndpo.stages.models.loading import load_tokenizer

    return load_tokenizer(str(tool_assets / "student"))


def mask_zero_stretches(mask):
    """[start, end) of each run of 0s in a loss mask."""
    edges = np.flatnonzero(np.diff(np.r_[1, np.asarray(mask), 1] == 0))
    return list(zip(edges[::2], edges[1::2]))


def test_rows_masks_and_turns(reference, tok):
    rows = committed_rows(reference)
    assert len(rows) == 48
    multi = [r for r in rows if r["num_turns"] > 1]
    assert multi, "the small student should call the calculator in some of 48 samples"
    for r in rows:
        ids, mask, lps = r["response_token_ids"], r["loss_mask"], r["sampler_logprobs"]
        assert len(ids) == len(mask) == len(lps) <= 48
        assert r["finish_reason"] in ("stop", "length", "max_turns")
        executed = [c for c in r["tool_calls"] if c["result"] is not None]
        # Each executed call adds one tool turn (mask 0); each student turn is a stretch of 1s.
        stretches = mask_zero_stretches(mask)
        assert len(stretches) == len(executed)
        assert r["num_turns"] == len(mask_zero_stretches([1 - m for m in mask]))
        for (a, b), call in zip(stretches, executed):
            shown = tok.decode(ids[a:b])
            full = f"<|end|><|tool|>{call['result']}<|end|><|assistant|>"
            assert shown == full or (b == len(ids) and full.startswith(shown) and r["finish_reason"] == "length")
            assert all(lp == 0.0 for lp in lps[a:b])
        assert all(lp <= 0 for lp, m in zip(lps, mask) if m)
        if r["finish_reason"] == "max_turns":
            assert r["tool_calls"][-1]["result"] is None and r["num_turns"] == 3
    manifest = open_run(str(reference)).records(0, "rollout").manifest()
    metrics = manifest.metrics
    llm = sum(sum(r["loss_mask"]) for r in rows)
    tool = sum(len(r["loss_mask"]) - sum(r["loss_mask"]) for r in rows)
    assert metrics["tool_mask/llm_tokens"] == pytest.approx(llm / 48)
    assert metrics["tool_mask/tool_tokens"] == pytest.approx(tool / 48)
    assert metrics["tool_mask/tool_ratio"] == pytest.approx(tool / (llm + tool))
    assert metrics["num_turns/mean"] == pytest.approx(sum(r["num_turns"] for r in rows) / 48)
    assert metrics["num_turns/max"] == max(r["num_turns"] for r in rows)
    assert "heldout_accuracy" in metrics


def test_the_hf_rollout_backend_calls_the_calculator_and_masks_its_turns(tool_assets, tok, tmp_path):
    """rollout.backend hf on the same config: the student's module stops each turn at the call's closing
    tag, the calculator answers, the student continues; every tool turn is masked with log-prob 0, and
    every student token's stored log-prob is a full forward's over the whole conversation before it."""
    config = tool_config(tmp_path, tool_assets)
    cfg = yaml.safe_load(config.read_text())
    cfg["rollout"]["backend"] = "hf"
    config.write_text(yaml.safe_dump(cfg))
    invoke_ok("init", tmp_path / "run", "--config", config)
    run_stages(tmp_path / "run", "rollout")
    rows = committed_rows(tmp_path / "run")
    called = [r for r in rows if any(c["result"] is not None for c in r["tool_calls"])]
    assert len(rows) == 48 and called, "the small student should call the calculator in some of 48 samples"
    student = str(tool_assets / "student")
    for r in called[:4]:
        ids, mask, lps = r["response_token_ids"], r["loss_mask"], r["sampler_logprobs"]
        assert len(mask_zero_stretches(mask)) == sum(c["result"] is not None for c in r["tool_calls"])
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m)
        want = model_logprobs(student, r["prompt_token_ids"], ids)
        got = np.asarray(lps)[np.asarray(mask) == 1]
        np.testing.assert_allclose(got, want[np.asarray(mask) == 1], **logprob_tol(student, r["prompt_token_ids"], ids))


def test_rewards_read_the_students_turns(reference, tok):
    prompts = {r["prompt_id"]: r for r in open_run(str(reference)).prompts("train")}
    for r in committed_rows(reference):
        ids, mask = r["response_token_ids"], r["loss_mask"]
        spans, start = [], None
        for i, m in enumerate(list(mask) + [0]):
            if m and start is None:
                start = i
            if not m and start is not None:
                spans.append(tok.decode(ids[start:i], skip_special_tokens=True))
                start = None
        text, prompt = "\n".join(spans), prompts[r["prompt_id"]]
        assert r["reward"] == math_answer(text, prompt)
        rewards = dict(r["rewards"])  # a Parquet map reads back as (key, value) pairs
        assert rewards["tool_format"] == tool_format(text, prompt)
        assert rewards["tool_correctness"] == tool_correctness(text, prompt)


def test_scores_and_statistics_cover_student_tokens_only(reference):
    run = open_run(str(reference))
    rows = {r["rollout_id"]: r for r in committed_rows(reference)}
    scores = committed_rows(reference, "score")
    assert len(scores) == len(rows)
    n_valid = 0
    for s in scores:
        r = rows[s["rollout_id"]]
        assert len(s["teacher_logprobs"]) == len(r["response_token_ids"])  # every token scored in context
        assert s["n_valid"] == sum(r["loss_mask"])
        n_valid += s["n_valid"]
    stats = run.records(0, "normalize").manifest().metrics
    assert stats["token_count"] == n_valid


def test_a_teacher_of_another_tokenizer_reads_each_tool_answer_through_its_own_template(reference, tool_assets, tok, tmp_path):
    """score.cross_tokenizer on the tool rollouts: the teacher (the toy's template, its tokenizer with
    merged "12", "34", "56", random weights) reads its own rendering of the prompt, its own tokens of
    each student turn and each tool answer through its own template; re-derived here, each student
    turn's values (special tokens sampled mid-turn aside: they have none) add up to the teacher's
    log-prob of the turn's text in that context (its end token for the last), and the tool turns'
    tokens stay masked with no value."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gndpo.apps.demos.arithmetic import new_model

    path = tmp_path / "cross-teacher"
    teacher_tok = AutoTokenizer.from_pretrained(str(tool_assets / "teacher"))
    teacher_tok.add_tokens(["12", "34", "56"])
    torch.manual_seed(7)
    new_model(ModelSpec(layers=1, hidden=64, heads=2, max_steps=0, lr=0.0), len(teacher_tok), context=256).save_pretrained(path)
    teacher_tok.save_pretrained(path)
    run = tmp_path / "run"
    invoke_ok("fork", reference, run, "--from-round", "0", f"teacher={path}", "score.cross_tokenizer=true")
    run_stages(run, "score", "normalize", "train")
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    prompts = {p["prompt_id"]: p for p in open_run(str(run)).prompts("train")}
    rollouts = {r["rollout_id"]: r for r in committed_rows(reference)}
    end = teacher_tok.convert_tokens_to_ids("<|end|>")
    multi = 0
    for s in committed_rows(run, "score"):
        r = rollouts[s["rollout_id"]]
        user = [{"role": "user", "content": prompts[r["prompt_id"]]["prompt"]}]
        rendered = teacher_tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        sequence = teacher_tok(rendered, add_special_tokens=False)["input_ids"]
        answers = iter(c["result"] for c in r["tool_calls"] if c["result"] is not None)
        pieces = []  # (student token range, teacher token range) of each student turn
        for start, stop in turn_runs(r["loss_mask"]):
            if r["loss_mask"][start] == 0:  # a tool turn: the teacher's template around the tool's answer
                probe = teacher_tok.apply_chat_template(user + [{"role": "assistant", "content": "PROBE"}, {"role": "tool", "content": next(answers)}],
                                                        tokenize=False, add_generation_prompt=True)
                sequence += teacher_tok(probe[probe.rfind("PROBE") + 5:], add_special_tokens=False)["input_ids"]
                continue
            ids = r["response_token_ids"][start:stop]
            own = teacher_tok(tok.decode(ids, skip_special_tokens=True), add_special_tokens=False)["input_ids"]
            own += [end] if stop == len(r["loss_mask"]) and ids[-1] in (tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")) else []
            pieces.append((range(start, stop), range(len(sequence), len(sequence) + len(own))))
            sequence += own
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([sequence])).logits[0].double(), -1)
        lp = [0.0] + [float(logp[i - 1, t]) for i, t in enumerate(sequence) if i > 0]
        # Sums of the teacher's log-probs of a turn, each within two float32 forwards' rounding
        # (atol + rtol * |lp| <= 2 * atol at the log-probs' size, tests/conftest.py).
        tol = float32_sum_tol(forward_terms(model.config, len(sequence)), float(logp.abs().max()))
        for students, teachers in pieces:
            aligned = np.asarray(s["aligned"][students.start : students.stop]) == 1  # special tokens mid-turn have no value
            got = float(np.sum(np.asarray(s["teacher_logprobs"], np.float64)[students.start : students.stop][aligned]))
            assert got == pytest.approx(sum(lp[i] for i in teachers), abs=2 * tol["atol"] * len(teachers))
        masked = np.asarray(r["loss_mask"]) == 0
        if r["num_turns"] > 1:
            multi += 1
            assert not np.asarray(s["aligned"])[masked][r["teacher_prefix_len"]:].any()
    assert multi > 0
    assert open_run(str(run)).records(0, "train").manifest() is not None


def turn_runs(mask):
    """[start, end) of each run of equal loss-mask values."""
    edges = [0, *(np.flatnonzero(np.diff(np.asarray(mask))) + 1), len(mask)]
    return list(zip(edges, edges[1:]))


def test_sigkill_mid_conversation_then_rerun_gives_identical_rows(reference, tool_assets, tmp_path):
    run = tmp_path / "run"
    invoke_ok("init", run, "--config", tool_config(tmp_path, tool_assets))
    code = gndpo_killed("rollout", run, *ROUND, env={"GNDPO_CRASH_AT": "agent.turn", "GNDPO_CRASH_AFTER": "1"}, log=tmp_path / "crash.log")
    assert code == -signal.SIGKILL, (tmp_path / "crash.log").read_text()[-2000:]
    assert open_run(str(run)).records(0, "rollout").manifest() is None
    run_stages(run, "rollout")  # the rerun, in this process
    assert committed_rows(run) == committed_rows(reference)


def test_no_gradient_at_prompt_tool_or_template_positions(reference, tool_assets, monkeypatch):
    """d loss / d (last hidden state) at a position is zero iff the loss ignores what the model predicts
    there: the last hidden state of a position feeds only that position's logits."""
    from transformers import AutoModelForCausalLM

    from gndpo.pipeline.methods import policy_settings
    from gndpo.stages.models import logprobs
    from gndpo.stages.training.objective import Objective

    run = open_run(str(reference))
    with round_share(run, 0) as share:
        micro = share.all_rows()
    assert any((row.mask == 0).any() for row in micro)
    policy_loss, loss_agg = policy_settings(run.cfg.method)
    # Whole sequences, so that the captured hidden states are one [B, T] grid of prompt + response.
    objective = Objective(run.cfg, policy_loss, loss_agg, divergence=None, pad_id=0, device=torch.device("cpu"), share_prompts=False)
    model = AutoModelForCausalLM.from_pretrained(str(tool_assets / "student"))

    captured = {}

    def response_hidden(model, batch):
        out = model.get_decoder()(input_ids=batch.ids, attention_mask=batch.attention_mask, use_cache=False)
        full = out.last_hidden_state
        full.retain_grad()
        captured["full"], captured["batch"] = full, batch
        return full[batch.rows, batch.cols]

    monkeypatch.setattr(logprobs, "response_hidden", response_hidden)
    n_tokens = int(sum(row.mask.sum() for row in micro))
    loss, _ = objective.micro_batch_loss(model, micro, 0, len(micro), n_tokens, float(len(micro)))
    loss.backward()
    grad = captured["full"].grad.abs().sum(-1)  # [B, T]
    trained = torch.zeros_like(grad, dtype=torch.bool)
    for b, row in enumerate(micro):
        p = len(row.prompt)
        for j in np.flatnonzero(row.mask):  # response token j is predicted at position p + j - 1
            trained[b, p + j - 1] = True
    assert (grad[~trained] == 0).all()
    assert (grad[trained] > 0).float().mean() > 0.9


def test_demo_tools_task_on_prebuilt_assets(tmp_path, tool_assets):
    out = invoke_ok(  # in this process: the demo command's computation, not its process, is under test here
        "demo", tmp_path / "demo", "--task", "tools", "--rounds", "1", "--assets", tool_assets,
        "--set", "rollout.prompts_per_round=8", "--set", "rollout.n=2", "--set", "train.optimizer_steps=2",
        "--set", "engine.in_process=true",
    ).stdout
    assert "teacher" in out and "student (start)" in out and "student after round 1" in out
    metrics = open_run(str(tmp_path / "demo" / "run")).records(0, "rollout").manifest().metrics
    assert {"tool_mask/llm_tokens", "tool_mask/tool_tokens", "tool_mask/tool_ratio", "num_turns/mean"} <= set(metrics)


def test_unknown_demo_task_is_one_line(tmp_path):
    assert_one_line_error(invoke("demo", tmp_path / "d", "--task", "chess"),
                          "unknown demo task 'chess' (tasks: addition, tools, cross-tokenizer, self-distill, privileged, vision)")
