"""The real-model tier: SmolLM2-135M-Instruct and Gemma 3 270M, converted from the GGUF files their
packages ship (the real-models extra; skipped with the reason printed where it is not installed).

Every test shares one converted folder per model, cached like the toys (conversion takes 25 s for
SmolLM2 and a minute for Gemma the first time)."""

from __future__ import annotations

import importlib.util
import logging
import sys

import numpy as np
import pytest
import torch

from gndpo.pipeline.toy import cache_root

pytestmark = [pytest.mark.slow, pytest.mark.real]

# The user's cache, read before conftest's fixtures point GNDPO_CACHE at a temporary folder: the
# converted models are deterministic and large, so they are shared between test runs.
ROOT = cache_root()
QUESTIONS = [
    "What is the capital of France?", "How many legs does a spider have?", "What color is the sky on a clear day?",
    "Name a fruit that is yellow.", "What is 12 plus 30?", "Who wrote Romeo and Juliet?",
    "What is the largest planet in the solar system?", "What do bees make?",
]


def real_model(name: str):
    from gndpo.errors import GndpoError
    from gndpo.pipeline.real_models import PACKAGED, ensure_real_model

    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec(PACKAGED[name]) is None:
        pytest.skip(f"{name}: the real-models packages are not installed (make real-models)")
    try:
        return ensure_real_model(name, log=lambda *_: None, root=ROOT)
    except GndpoError as exc:
        pytest.skip(f"{name}: {exc}")


@pytest.fixture(scope="session")
def smollm2():
    return real_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3():
    return real_model("gemma3-270m")


def prompt_ids(tok, question: str) -> list[int]:
    """The ids a user's question becomes: through the chat template where the model has one, else
    the plain text with the tokenizer's special tokens (Gemma's <bos>)."""
    if tok.chat_template:
        return list(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    return list(tok(f"Question: {question}\nAnswer:")["input_ids"])


def greedy(model, ids: list[int], new_tokens: int = 12) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=model.generation_config.pad_token_id)
    return out[0, len(ids):].tolist()


def greedy_batch(model, prompts: list[list[int]], pad_id: int, new_tokens: int = 12) -> list[list[int]]:
    """Greedy continuations of left-padded prompts, in one generate call."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    return out[:, width:].tolist()


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_converted_folder_loads_without_gguf_and_generates_what_the_gguf_does(name, monkeypatch, request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gndpo.pipeline.real_models import load_gguf, packaged_gguf

    folder = request.getfixturevalue("smollm2" if name.startswith("smollm2") else "gemma3")
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "gguf", None)  # any import of gguf now fails
        tok = AutoTokenizer.from_pretrained(folder)
        converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gguf_tok, reference = load_gguf(packaged_gguf(name, ROOT))
    if name.startswith("gemma"):
        assert tok("a")["input_ids"][0] == tok.bos_token_id  # the add-BOS setting transformers' GGUF reader drops
        assert gguf_tok("a")["input_ids"][0] != gguf_tok.bos_token_id
        assert not tok.chat_template
    else:
        assert tok.chat_template and "<|im_start|>" in tok.chat_template
    prompts = [prompt_ids(tok, q) for q in QUESTIONS]
    assert greedy_batch(converted, prompts, tok.pad_token_id) == greedy_batch(reference, prompts, tok.pad_token_id)


def test_smollm2_answers_sensibly(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    answer = tok.decode(greedy(model, prompt_ids(tok, QUESTIONS[0]), 16), skip_special_tokens=True)
    assert "Paris" in answer


def perturbed_copy(folder, out, seed: int = 0, scale: float = 0.02):
    """``folder``'s model with every weight moved (what a round of training does, larger), saved with
    the probe train writes beside an export."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gndpo.stages.probe import probe_logprobs, write_probe

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    write_probe(out, probe_logprobs(model, min(len(tok), model.config.vocab_size), tok.pad_token_id or 0))
    return model, tok


def engine_vs_transformers(llm, model, tok) -> float:
    """Mean |vLLM prompt log-prob - transformers log-prob| over a real sentence."""
    from gndpo.stages.engine import response_logprobs

    ids = prompt_ids(tok, "Tell me about the Eiffel Tower and the river that runs past it.")
    engine = response_logprobs(llm, [ids[:1]], [ids[1:]], 0)["logprobs"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    hf = logp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).numpy()
    return float(np.abs(engine - hf).mean())


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_kept_engine_samples_from_the_reloaded_weights(name, request, tmp_path, caplog):
    """Tied embeddings: after loading a new round's weights into a running engine, its log-probs equal
    transformers' on those weights as closely as a fresh engine's (vLLM's own reload kept the old
    output layer: 1.9e-3 mean gap on SmolLM2); the probe metric says so, and no restart was needed."""
    from gndpo.pipeline.config import EngineConfig
    from gndpo.stages.live import LiveModels

    folder = request.getfixturevalue("smollm2" if name.startswith("smollm2") else "gemma3")
    new = tmp_path / "round1"
    model, tok = perturbed_copy(folder, new)
    cfg = EngineConfig(max_model_len=256, kv_cache_gib=1)
    live = LiveModels(keep=True, log=lambda *_: None)
    try:
        live.student_engine(str(folder), cfg, seed=0)
        llm = live.student_engine(str(new), cfg, seed=0)
        assert live.probe["engine_reloaded"] == 1 and live.probe["engine_restarted"] == 0, live.probe
        assert live.probe["engine_probe_gap_mean"] < 1e-4, live.probe
        assert engine_vs_transformers(llm, model, tok) < 1e-4
    finally:
        live.close()


def test_a_stale_kept_engine_is_replaced_by_a_fresh_one(smollm2, tmp_path, monkeypatch, caplog):
    """The fallback: a reload that leaves the engine on the old weights (here, no reload at all) fails
    the probe check; rollout gets a fresh engine, with a warning, and the metric records the restart."""
    from gndpo.pipeline.config import EngineConfig
    from gndpo.stages.live import LiveModels

    new = tmp_path / "round1"
    model, tok = perturbed_copy(smollm2, new)
    cfg = EngineConfig(max_model_len=256, kv_cache_gib=1)
    live = LiveModels(keep=True, log=lambda *_: None)
    try:
        llm = live.student_engine(str(smollm2), cfg, seed=0)
        monkeypatch.setattr(type(llm), "collective_rpc", lambda self, *a, **k: [0])  # the reload does nothing
        with caplog.at_level(logging.WARNING, logger="gndpo"):
            llm = live.student_engine(str(new), cfg, seed=0)
        assert "starting a fresh engine" in caplog.text
        assert live.probe["engine_restarted"] == 1 and live.probe["engine_probe_gap_mean"] < 1e-4, live.probe
        assert engine_vs_transformers(llm, model, tok) < 1e-4
    finally:
        live.close()
