"""The real-model tier: SmolLM2-135M-Instruct and Gemma 3 270M, converted from the GGUF files their
packages ship (the real-models extra; skipped with the reason printed where it is not installed).

Every test that needs a real model shares one converted folder per model, cached like the toys
(conversion takes 25 s for SmolLM2 and a minute for Gemma the first time); `gndpo convert`'s stdout is
checked on a tiny GGUF written here."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys

import numpy as np
import pytest
import torch

from tests.conftest import USER_CACHE, committed_rows, gndpo, logprob_tol, missing_component, model_logprobs, run_stages
from tests.tiny_gguf import write_tiny_gguf

pytestmark = [pytest.mark.slow, pytest.mark.real]

QUESTIONS = [
    "What is the capital of France?", "How many legs does a spider have?", "What color is the sky on a clear day?",
    "Name a fruit that is yellow.", "What is 12 plus 30?", "Who wrote Romeo and Juliet?",
    "What is the largest planet in the solar system?", "What do bees make?",
]


@pytest.fixture(scope="module", autouse=True)
def own_distributed_environment():
    """The SmolLM2 rounds train in this process (kept models, as `gndpo run` does), and the libraries
    under train may set environment variables of their own: they are undone when the module ends, so
    later tests' `gndpo` processes start from this module's environment. The one-rank process group train
    opened stays, as in a `gndpo run` process: later trains in this process join it (DeepSpeed caches
    its groups, so a destroyed one cannot be opened again in the same process)."""
    saved = dict(os.environ)
    yield
    for key in [k for k in os.environ if k not in saved and not k.startswith("GNDPO_")]:
        del os.environ[key]
    os.environ.update({k: v for k, v in saved.items() if not k.startswith("GNDPO_")})


def real_model(name: str):
    """The converted model: a skip (a failure under CI) only where its packages are missing; a converter
    error fails every test that needs the model."""
    from gndpo.apps.demos.real_models import PACKAGED, ensure_real_model

    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec(PACKAGED[name]) is None:
        missing_component(f"{name}: the real-models packages are not installed (make real-models)")
    return ensure_real_model(name, log=lambda *_: None, root=USER_CACHE)


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


def test_convert_prints_only_the_folder_on_stdout(tmp_path):
    """`M=$(gndpo convert FILE.gguf OUT)` captures the folder and nothing else: what libraries print
    while converting (DeepSpeed's accelerator warning when transformers imports it) goes to stderr.
    The claim is about a real process's file descriptor 1, so `gndpo convert` runs as one, on a tiny
    GGUF written here (:func:`tests.tiny_gguf.write_tiny_gguf`) through the same import and dequantizing path as the
    packaged models, whose conversion the fixtures above run in this process. The staged folder the
    conversion writes beside OUT is gone afterwards."""
    if importlib.util.find_spec("gguf") is None:
        missing_component("the real-models packages are not installed (make real-models)")
    source = write_tiny_gguf(tmp_path / "src" / "tiny.gguf")
    proc = gndpo("convert", source, tmp_path / "out")
    assert proc.stdout == f"{tmp_path / 'out'}\n", proc.stdout
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def reading_each_gguf_once(monkeypatch) -> None:
    """Make ``gguf.GGUFReader(path)`` return one reader per file (by real path) while ``monkeypatch``
    holds: the readers are the original class's, built on the first call. transformers'
    ``from_pretrained(gguf_file=...)`` builds a reader twice, for the config and then for the weights,
    and each parses the file's metadata in Python (3 s for SmolLM2, 10-14 s for Gemma's 262,144-token
    vocabulary); its loader reads tensors and fields only, and imports GGUFReader from gguf at call time,
    so it gets this one. The dequantizing is still transformers' own."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def shared_reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    monkeypatch.setattr(gguf, "GGUFReader", shared_reader)


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_converted_folder_loads_without_gguf_and_generates_what_the_gguf_does(name, monkeypatch, request):
    """The converted folder loads with gguf unavailable and generates, greedily, what transformers'
    reading of the GGUF file generates from the same ids. The GGUF's tokenizer is not read here
    (transformers rebuilds Gemma's 262,144 entries in Python for a minute); what the converter takes
    from it is checked on the converted tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gndpo.apps.demos.real_models import packaged_gguf

    folder = request.getfixturevalue("smollm2" if name.startswith("smollm2") else "gemma3")
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "gguf", None)  # any import of gguf now fails
        tok = AutoTokenizer.from_pretrained(folder)
        converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = packaged_gguf(name, USER_CACHE)
    with monkeypatch.context() as m:
        reading_each_gguf_once(m)  # one parse of the file instead of two; the reference is transformers' reading
        reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    if name.startswith("gemma"):
        # The file asks for a BOS token (tokenizer.ggml.add_bos_token), a setting transformers' GGUF
        # tokenizer reader drops and the converter carries over. (Reading the flag here with gguf's
        # GGUFReader parses the whole 262k-token vocabulary again: 14 s for the premise alone.)
        assert tok("a")["input_ids"][0] == tok.bos_token_id
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

    from gndpo.stages.models.probe import probe_logprobs, write_probe

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
    from gndpo.stages.models.vllm_engine import response_logprobs

    ids = prompt_ids(tok, "Tell me about the Eiffel Tower and the river that runs past it.")
    engine = response_logprobs(llm, [ids[:1]], [ids[1:]], 0)["logprobs"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    hf = logp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).numpy()
    return float(np.abs(engine - hf).mean())


def assert_reloads_exactly(live, cfg, new, model, tok) -> None:
    """Tied embeddings: after loading a new round's weights into the running engine, its log-probs equal
    transformers' on those weights as closely as a fresh engine's (vLLM's own reload kept the old
    output layer: 1.9e-3 mean gap on SmolLM2); the probe metric says so, and no restart was needed."""
    llm = live.student_engine(str(new), cfg, seed=0)
    assert live.probe["engine_reloaded"] == 1 and live.probe["engine_restarted"] == 0, live.probe
    assert live.probe["engine_probe_gap_mean"] < 1e-4, live.probe
    assert engine_vs_transformers(llm, model, tok) < 1e-4


def test_kept_engine_samples_from_the_reloaded_weights_on_gemma(gemma3, tmp_path):
    from gndpo.pipeline.settings.schema import EngineConfig
    from gndpo.stages.models.live import LiveModels

    model, tok = perturbed_copy(gemma3, tmp_path / "round1")
    cfg = EngineConfig(max_model_len=256, kv_cache_gib=1, in_process=True)
    live = LiveModels(keep=True, log=lambda *_: None)
    try:
        live.student_engine(str(gemma3), cfg, seed=0)
        assert_reloads_exactly(live, cfg, tmp_path / "round1", model, tok)
    finally:
        live.close()


def test_kept_engine_reloads_smollm2_and_a_stale_one_is_replaced(smollm2, tmp_path, monkeypatch, caplog):
    """SmolLM2's reload is exact (as Gemma's above; one engine serves both checks). Then the fallback:
    a reload that leaves the engine on the old weights (here, no reload at all) fails the probe check;
    rollout gets a fresh engine, with a warning, and the metric records the restart."""
    from gndpo.pipeline.settings.schema import EngineConfig
    from gndpo.stages.models.live import LiveModels

    cfg = EngineConfig(max_model_len=256, kv_cache_gib=1, in_process=True)
    live = LiveModels(keep=True, log=lambda *_: None)
    try:
        llm = live.student_engine(str(smollm2), cfg, seed=0)
        assert_reloads_exactly(live, cfg, tmp_path / "round1", *perturbed_copy(smollm2, tmp_path / "round1"))
        new = tmp_path / "round2"
        model, tok = perturbed_copy(smollm2, new, seed=1)
        monkeypatch.setattr(type(llm), "collective_rpc", lambda self, *a, **k: [0])  # the reload does nothing
        with caplog.at_level(logging.WARNING, logger="gndpo"):
            llm = live.student_engine(str(new), cfg, seed=0)
        assert "starting a fresh engine" in caplog.text
        assert live.probe["engine_restarted"] == 1 and live.probe["engine_probe_gap_mean"] < 1e-4, live.probe
        assert engine_vs_transformers(llm, model, tok) < 1e-4
    finally:
        live.close()


def test_an_engine_whose_precision_exceeds_the_tolerance_restarts_once_not_every_round(smollm2, tmp_path, monkeypatch, caplog):
    """A large model in bf16 is further from its trainer's forward than bf16's fixed tolerance allows
    even on exactly its weights (1B: mean 0.017 against 0.03, max 0.082). Here fp32's tolerance is set
    below SmolLM2's honest fp32 gap to show it: the first reload fails the check and restarts, the fresh
    engine's gap calibrates the check (a warning says so), and the next rounds' exact reloads pass."""
    from gndpo.pipeline.settings.schema import EngineConfig
    from gndpo.stages.models import live as live_module
    from gndpo.stages.models.live import LiveModels

    monkeypatch.setitem(live_module.TOLERANCE, "float32", 1e-12)
    cfg = EngineConfig(max_model_len=256, kv_cache_gib=1, in_process=True)
    live = LiveModels(keep=True, log=lambda *_: None)
    try:
        live.student_engine(str(smollm2), cfg, seed=0)
        restarts = []
        for round_idx in (1, 2, 3):
            perturbed_copy(smollm2, tmp_path / f"round{round_idx}", seed=round_idx)
            with caplog.at_level(logging.WARNING, logger="gndpo"):
                live.student_engine(str(tmp_path / f"round{round_idx}"), cfg, seed=0)
            restarts.append(live.probe["engine_restarted"])
            assert 1e-12 < live.probe["engine_probe_gap_mean"] < 1e-4, live.probe
        assert restarts == [1, 0, 0], restarts
        assert "the engine's precision, not a stale reload" in caplog.text
    finally:
        live.close()


# -- the stages on SmolLM2 ---------------------------------------------------------------------------
def smollm2_config(folder, student, **sections) -> dict:
    """A few short chat questions (the self-distillation demo's), SmolLM2 reading the demonstrations as
    its own teacher, ZeRO-2."""
    from gndpo.apps.demos.self_distill import context_messages, questions

    rows = questions()
    for name, part in (("train", rows[:16:2]), ("heldout", rows[1:8:2])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    cfg = {
        "student": str(student), "teacher": "self", "reward": "answer_format",
        "teacher_context": {"messages": context_messages()},
        "data": {"train": str(folder / "train.jsonl"), "heldout": str(folder / "heldout.jsonl")},
        "method": {"name": "gndpo"},
        "rollout": {"prompts_per_round": 4, "n": 2, "prompts_per_unit": 4, "max_tokens": 12},
        "score": {"teacher_topk": 8},
        "train": {"lr": 1e-5, "optimizer_steps": 1, "micro_batch_size": 8, "zero_stage": 2},
        "engine": {"max_model_len": 256, "kv_cache_gib": 1, "in_process": True},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


@pytest.fixture(scope="module")
def smollm2_round(smollm2, tmp_path_factory):
    """One GNDPO round of SmolLM2 self-distillation under ZeRO-2 in one process (`gndpo run`'s kept
    models), then round 1's rollout on the kept engine with the exported weights loaded into it."""
    from gndpo.apps.init import init_run
    from gndpo.apps.rounds import run_rounds
    from gndpo.pipeline.config.load import config_from_dict
    from gndpo.stages.models.live import LiveModels

    folder = tmp_path_factory.mktemp("smollm2-run")
    url = str(folder / "run")
    init_run(url, config_from_dict(smollm2_config(folder, smollm2)))
    live = LiveModels(keep=True, log=lambda *_: None)
    try:
        run_rounds(url, 1, log=lambda *_: None, live=live)
        run_stages(url, "rollout", round_idx=1, live=live)
    finally:
        live.close()
    return folder


def test_a_gndpo_self_distillation_round_on_smollm2(smollm2_round):
    from gndpo.pipeline.observe.metrics import collect_metrics
    from gndpo.pipeline.run.run import open_run

    run = open_run(str(smollm2_round / "run"))
    metrics = {(m["round"], m["stage"]): m for m in collect_metrics(run)}
    assert set(metrics) == {(0, s) for s in ("rollout", "score", "normalize", "train")} | {(1, "rollout")}
    rows = committed_rows(smollm2_round / "run", "rollout", 0)
    assert all(r["finish_reason"] in ("stop", "length") for r in rows) and any(r["finish_reason"] == "stop" for r in rows)
    assert all(r["response_token_ids"][-1] == 2 for r in rows if r["finish_reason"] == "stop")  # <|im_end|>
    scores = committed_rows(smollm2_round / "run", "score", 0)
    assert {s["teacher"] for s in scores} == {"self/frozen"}
    # The teacher reads the demonstrations: it disagrees with the bare student.
    assert np.mean([np.mean(np.abs(np.subtract(s["teacher_logprobs"], s["student_logprobs"]))) for s in scores]) > 0.1
    assert_stored_logprobs_are_smollm2s(smollm2_round, rows, scores)
    assert metrics[(0, "train")]["optimizer_steps"] == 1 and np.isfinite(metrics[(0, "train")]["loss_mean"])
    # Round 1 sampled from the exported student: the kept engine reloaded it and the probe agrees.
    r1 = metrics[(1, "rollout")]
    assert r1["engine_reloaded"] == 1 and r1["engine_restarted"] == 0 and r1["engine_probe_gap_mean"] < 1e-4, r1


def assert_stored_logprobs_are_smollm2s(folder, rows: list[dict], scores: list[dict]) -> None:
    """Score's stored values against a plain transformers forward of the round's student (fp32): the
    student's over [prompt | response], the frozen self-teacher's over [its context's chat-templated
    prompt | the same response], built here from the run's prompt rows and the demonstrations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gndpo.apps.demos.self_distill import context_messages
    from gndpo.pipeline.run.run import open_run

    run = open_run(str(folder / "run"))
    student = run.cfg.student
    model, tok = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32), AutoTokenizer.from_pretrained(student)
    questions = {p["prompt_id"]: p for p in run.prompts("train")}
    by_id = {s["rollout_id"]: s for s in scores}
    for r in rows[:4]:  # two float32 forwards each: within their rounding at these log-probs' size (tests/conftest.py)
        s, question = by_id[r["rollout_id"]], questions[r["prompt_id"]]
        tol = logprob_tol(model, r["prompt_token_ids"], r["response_token_ids"])
        np.testing.assert_allclose(s["student_logprobs"], model_logprobs(model, r["prompt_token_ids"], r["response_token_ids"]), **tol)
        turns = [{**t, "content": t["content"].format(prompt=question["prompt"], answer=question.get("answer", ""))} for t in context_messages()]
        teacher_prompt = tok.apply_chat_template(turns, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
        tol = logprob_tol(model, teacher_prompt, r["response_token_ids"])
        np.testing.assert_allclose(s["teacher_logprobs"], model_logprobs(model, teacher_prompt, r["response_token_ids"]), **tol)


def test_an_ema_top_k_self_distillation_round_on_smollm2(smollm2_round, tmp_path):
    """A fork of the same round: forward KL on the teacher's top-8 with point-wise clipping, an EMA
    self-teacher; train exports the average beside the model."""
    from gndpo.apps.fork import fork_run
    from gndpo.pipeline.run.run import open_run

    url = str(tmp_path / "fork")
    fork_run(str(smollm2_round / "run"), url, 0, ["method.name=forward_kl", "method.pointwise_clip=1.0", "self_teacher.weights=ema"])
    run_stages(url, "score", "normalize", "train")
    run = open_run(url)
    assert run.records(0, "train").manifest().metrics["ema_dir"].endswith("/ema")
    scores = committed_rows(tmp_path / "fork", "score", 0)
    assert all(np.isfinite(s["teacher_rest_logprob"]).all() for s in scores)


def test_gemma_teaches_smollm2_across_tokenizers(smollm2_round, gemma3, tmp_path):
    """Gemma 3 (another tokenizer, no chat template: it reads the plain question after <bos>) as the
    teacher of SmolLM2's rollouts, in a reverse-KL round on its top-16: every student token gets a value
    from Gemma's log-probs, the responses' <|im_end|> among them (Gemma's <eos> after the same text);
    the first token of every span holds Gemma's top-16 in SmolLM2's vocabulary (most entries spelled
    by a SmolLM2 token too), the others none; train steps on them."""
    from gndpo.apps.fork import fork_run
    from gndpo.pipeline.methods.losses import NO_ENTRY_ID, UNMATCHED_ID
    from gndpo.pipeline.run.run import open_run

    url = str(tmp_path / "cross")
    fork_run(str(smollm2_round / "run"), url, 0, [f"teacher={gemma3}", "score.cross_tokenizer=true", "teacher_context.messages=[]",
                                                  "method.name=reverse_kl"])
    run_stages(url, "score", "normalize", "train")
    scores = committed_rows(tmp_path / "cross", "score", 0)
    ids = np.concatenate([np.asarray(s["teacher_topk_ids"]) for s in scores])
    rest = np.concatenate([s["teacher_rest_logprob"] for s in scores])
    entries = ids[:, 0] != NO_ENTRY_ID
    assert np.all((ids != NO_ENTRY_ID) == entries[:, None]) and np.all(rest[~entries] == 0)
    matched = float((ids[entries] >= 0).mean())
    print(f"Gemma's top-16 entries with a SmolLM2 twin: {matched:.3f} ({int((ids == UNMATCHED_ID).sum())} without)")
    assert matched > 0.5
    steps = open_run(url).records(0, "train").done("update").numbers.steps
    assert steps and all(np.isfinite(s["loss"]) and s["grad_norm"] > 0 for s in steps)
    aligned = np.concatenate([s["aligned"] for s in scores])
    assert aligned.all(), f"{int((aligned == 0).sum())} of {aligned.size} student tokens got no teacher value"
    values = np.concatenate([s["teacher_logprobs"] for s in scores])
    assert np.isfinite(values).all()
    metrics = open_run(url).records(0, "score").manifest().metrics
    print("Gemma -> SmolLM2 tokens in split spans:", metrics["cross_tokenizer/split_span_fraction"])
    assert metrics["cross_tokenizer/unaligned_tokens"] == 0
