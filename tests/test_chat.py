"""The chat path end to end: the toy in chat format (role markers, an end-of-turn token, `messages`
prompts with system turns, `#### n` / `\\boxed{n}` answers, the `math` reward) through vLLM rollout,
score, normalize and train, once per `rollout.truncated` mode; and the one-line refusals of prompts
and templates init cannot use.

The student's final norm is zeroed, so it samples uniformly over the vocabulary: some responses end
at the end-of-turn token or EOS, others run to max_tokens, which is what stopping and truncation are
tested on (accuracy is not the point here)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from gndpo.apps.demos.arithmetic import CHAT_TEMPLATE, END_OF_TURN
from gndpo.pipeline.run.run import open_run
from gndpo.pipeline.settings.schema import DataConfig
from gndpo.stages.text.chat import render_prompt
from gndpo.storage.shards import read_shards
from tests.conftest import assert_one_line_error, float32_sum_tol, forward_terms, invoke, invoke_ok, run_stages, tiny_config_dict, write_config

pytestmark = pytest.mark.slow
MAX_TOKENS = 10
CHAT_ROLES = ("system", "user", "assistant")


def build_chat_variant(assets: Path, out: Path, seed: int = 0) -> Path:
    """The toy in chat format, written to ``out``: the toy tokenizer plus role-marker and end-of-turn
    special tokens and a chat template, both models resized to it (new embedding rows initialised
    from the old ones' mean), and ``train.jsonl`` / ``heldout.jsonl`` whose prompts are ``messages``
    (some with a system turn) and whose answers are GSM8K ``#### n`` lines or ``\\boxed{n}``, for the
    ``math`` reward. For tests of the chat path: no accuracy is claimed."""
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(assets / "student")
    tok.add_special_tokens({"additional_special_tokens": [f"<|{r}|>" for r in CHAT_ROLES] + [END_OF_TURN]})
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    for role in ("student", "teacher"):
        model = AutoModelForCausalLM.from_pretrained(assets / role)
        model.resize_token_embeddings(len(tok), mean_resizing=False)
        with torch.no_grad():  # new rows: the mean of the old ones (deterministic, no sampling)
            for matrix in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
                matrix[-(len(CHAT_ROLES) + 1):] = matrix[: -(len(CHAT_ROLES) + 1)].mean(0)
        model.save_pretrained(out / role, safe_serialization=True)
        tok.save_pretrained(out / role)
    for split in ("train", "heldout"):
        rows = [json.loads(line) for line in (assets / f"{split}.jsonl").read_text().splitlines()]
        with open(out / f"{split}.jsonl", "w") as f:
            for i, r in enumerate(rows):
                turns = [{"role": "user", "content": r["prompt"]}]
                if i % 3 == 0:
                    turns.insert(0, {"role": "system", "content": "0="})  # toy characters only
                answer = f"#### {r['answer']}" if i % 2 else f"\\boxed{{{r['answer']}}}"
                f.write(json.dumps({"messages": turns, "answer": answer}) + "\n")
    return out


@pytest.fixture(scope="module")
def chat_assets(tmp_path_factory, tiny_assets):
    out = build_chat_variant(tiny_assets, tmp_path_factory.mktemp("chat") / "assets")
    weights = out / "student" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.norm.weight"].zero_()  # uniform next-token distribution
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return out


def chat_config(folder, assets, **sections):
    cfg = tiny_config_dict(assets, reward="math", **sections)
    cfg["data"].update({"train": str(assets / "train.jsonl"), "heldout": str(assets / "heldout.jsonl")})
    cfg["rollout"].update({"max_tokens": MAX_TOKENS, "prompts_per_round": 16, "n": 2})
    return write_config(folder, cfg)


@pytest.fixture(scope="module")
def chat_rollout(tmp_path_factory, chat_assets):
    folder = tmp_path_factory.mktemp("chat-rollout")
    invoke_ok("init", folder / "run", "--config", chat_config(folder, chat_assets))
    run_stages(folder / "run", "rollout")
    return folder / "run"


@pytest.fixture(scope="module", params=["keep", "mask", "drop"])
def chat_round(request, tmp_path_factory, chat_assets, chat_rollout):
    """score, normalize and train of the same rollouts under one rollout.truncated mode."""
    folder = tmp_path_factory.mktemp(f"chat-{request.param}")
    run = folder / "run"
    invoke_ok("init", run, "--config", chat_config(folder, chat_assets, rollout={"truncated": request.param}))
    shutil.copytree(chat_rollout / "rounds" / "r0000" / "rollout", run / "rounds" / "r0000" / "rollout")
    run_stages(run, "score", "normalize", "train")
    return request.param, open_run(str(run))


def rollout_rows(run):
    rows = read_shards(run.fs, run.records(0, "rollout").require_manifest().row_files()).to_pylist()
    assert rows
    return rows


def test_rollout_renders_messages_and_stops_at_end_of_turn(chat_rollout, chat_assets):
    from transformers import AutoTokenizer

    run = open_run(str(chat_rollout))
    tok = AutoTokenizer.from_pretrained(chat_assets / "student")
    end, eos = tok.convert_tokens_to_ids(END_OF_TURN), tok.eos_token_id
    by_id = {p["prompt_id"]: p for p in run.prompts("train")}
    rows = rollout_rows(run)
    for r in rows:
        prompt = by_id[r["prompt_id"]]
        rendered = render_prompt(tok, prompt, DataConfig())
        assert r["prompt_token_ids"] == rendered.token_ids and r["prompt"] == rendered.text
        # The conversation's turns, rendered with role markers, ending in the generation prompt.
        turns = json.loads(prompt["messages"])
        assert rendered.text.endswith(f"<|user|>{turns[-1]['content']}{END_OF_TURN}<|assistant|>")
        assert rendered.text.startswith("<s><|system|>0=<|end|>") == (turns[0]["role"] == "system")
        ids = r["response_token_ids"]
        assert not set(ids[:-1]) & {end, eos}  # nothing is generated after a stop token
        if r["finish_reason"] == "stop":
            assert ids[-1] in (end, eos) and len(ids) <= MAX_TOKENS
        else:
            assert r["finish_reason"] == "length" and len(ids) == MAX_TOKENS and ids[-1] not in (end, eos)
        assert r["rewards"] is not None and set(dict(r["rewards"])) >= {"math", "math_format"}
    reasons = [r["finish_reason"] for r in rows]
    assert "stop" in reasons and "length" in reasons
    assert any(r["response_token_ids"][-1] == end for r in rows), "no response ended at the end-of-turn token"
    assert any(p["messages"] and json.loads(p["messages"])[0]["role"] == "system" for p in by_id.values())


def test_teacher_scores_the_generated_ids_after_the_rendered_prompt(chat_round, chat_assets):
    import torch
    from transformers import AutoModelForCausalLM

    mode, run = chat_round
    if mode != "keep":
        pytest.skip("scores do not depend on the truncation mode; checked once")
    teacher = AutoModelForCausalLM.from_pretrained(chat_assets / "teacher").eval()
    scores = {s["rollout_id"]: s for s in read_shards(run.fs, run.records(0, "score").require_manifest().files()).to_pylist()}
    for r in rollout_rows(run)[:8]:
        prompt, response = r["prompt_token_ids"], r["response_token_ids"]
        with torch.no_grad():
            logits = teacher(input_ids=torch.tensor([prompt + response])).logits[0].double()
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        want = logp[torch.arange(len(response)), torch.tensor(response)].numpy()
        # Two float32 forwards (score's batch, this one alone): within the chain's rounding at the log-probs' size.
        tol = float32_sum_tol(forward_terms(teacher.config, len(prompt) + len(response)), float(logp.abs().max()))
        np.testing.assert_allclose(scores[r["rollout_id"]]["teacher_logprobs"], want, **tol)


def test_truncated_modes(chat_round):
    mode, run = chat_round
    rows = rollout_rows(run)
    cut = [r for r in rows if r["finish_reason"] == "length"]
    kept = [r for r in rows if r["finish_reason"] != "length"]
    stats = run.records(0, "normalize").require_manifest().metrics
    train = run.records(0, "train").require_manifest().units[0]
    assert stats["truncated_fraction"] == pytest.approx(len(cut) / len(rows))
    in_stats = kept if mode == "drop" else rows
    assert stats["token_count"] == sum(sum(r["loss_mask"]) for r in in_stats)
    assert stats["responses"] == len(in_stats)
    assert train.numbers.responses == (len(rows) if mode == "keep" else len(kept))
    assert all(np.isfinite(s["loss"]) for s in train.numbers.steps)


def write_messages(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "rows, fragment",
    [
        ([{"messages": "12+34=", "answer": "1"}], "messages must be a list of {role, content} turns"),
        ([{"messages": [{"role": "user"}], "answer": "1"}], "turn 0 must be a dict with a string role and a content"),
        ([{"messages": [{"role": "narrator", "content": "1+2="}], "answer": "1"}], "unknown role 'narrator'"),
        ([{"messages": [{"role": "system", "content": "0="}], "answer": "1"}], "has no user turn"),
        ([{"messages": [], "answer": "1"}], "non-empty list"),
    ],
)
def test_init_refuses_bad_messages(tmp_path, chat_assets, rows, fragment):
    cfg = yaml.safe_load(chat_config(tmp_path, chat_assets).read_text())
    cfg["data"]["train"] = str(write_messages(tmp_path / "bad.jsonl", rows))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert_init_refused(tmp_path, fragment)


def assert_init_refused(folder, fragment, *overrides):
    run = folder / "run"
    assert_one_line_error(invoke("init", run, "--config", folder / "config.yaml", *overrides), fragment)
    assert not run.exists()


def test_init_refuses_what_the_template_cannot_render_and_too_long_prompts(tmp_path, chat_assets):
    strict = tmp_path / "strict"
    for role in ("student", "teacher"):
        shutil.copytree(chat_assets / role, strict / role)
        # A template that refuses system turns, as some instruction models' templates do.
        (strict / role / "chat_template.jinja").write_text(
            "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
            "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
        )
    for name in ("train", "heldout"):
        shutil.copy(chat_assets / f"{name}.jsonl", strict / f"{name}.jsonl")
    chat_config(tmp_path, strict)
    assert_init_refused(tmp_path, "the chat template cannot render prompt")
    chat_config(tmp_path, chat_assets)
    assert_init_refused(tmp_path, "data.chat_template is none", "data.chat_template=none")
    assert_init_refused(tmp_path, "more than max_model_len", "engine.max_model_len=16")
