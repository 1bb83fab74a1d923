"""Eval: verifiable-reward accuracy of a model on held-out prompts with vLLM.

pass@1 is greedy exact match. pass@k draws k samples per prompt (temperature 1, seeded per prompt and
sample) and uses the unbiased estimator 1 - C(n-c, k) / C(n, k) with n = k samples, i.e. "any of k".
"""

from __future__ import annotations

import hashlib

import pyarrow as pa

from gndpo.pipeline.config import EngineConfig
from gndpo.stages.engine import generate, make_llm, shutdown_llm
from gndpo.stages.modeling import load_tokenizer

EVAL_SCHEMA = pa.schema(
    [("prompt_id", pa.string()), ("prompt", pa.string()), ("answer", pa.string()), ("response", pa.string()), ("reward", pa.float64())]
)


def greedy_eval(llm, tok, rows: list[dict], reward, max_tokens: int) -> dict:
    """Greedy pass@1 over ``rows`` (dicts with prompt, answer, and optionally prompt_id)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    gens = generate(llm, [tok(r["prompt"])["input_ids"] for r in rows], [params] * len(rows))
    out = []
    for r, g in zip(rows, gens):
        text = tok.decode(g.token_ids, skip_special_tokens=True)
        out.append(
            {
                "prompt_id": r.get("prompt_id", ""),
                "prompt": r["prompt"],
                "answer": str(r["answer"]),
                "response": text,
                "reward": float(reward(text, r)),
            }
        )
    acc = sum(o["reward"] for o in out) / max(len(out), 1)
    return {"accuracy": acc, "n": len(out), "table": pa.Table.from_pylist(out, schema=EVAL_SCHEMA)}


def pass_at_k(llm, tok, rows: list[dict], reward, max_tokens: int, k: int) -> float:
    """Fraction of prompts with at least one rewarded sample among k (temperature 1)."""
    from vllm import SamplingParams

    requests, params = [], []
    for r in rows:
        ids = tok(r["prompt"])["input_ids"]
        for s in range(k):
            seed = int.from_bytes(hashlib.sha256(f"eval:{r['prompt']}:{s}".encode()).digest()[:4], "little")
            requests.append(ids)
            params.append(SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed))
    gens = generate(llm, requests, params)
    solved = 0
    for i, r in enumerate(rows):
        texts = [tok.decode(g.token_ids, skip_special_tokens=True) for g in gens[i * k : (i + 1) * k]]
        solved += any(reward(t, r) > 0 for t in texts)
    return solved / max(len(rows), 1)


def evaluate_model(model_path: str, rows: list[dict], reward, engine: EngineConfig, max_tokens: int, k: int = 1) -> dict:
    """Start an engine for ``model_path`` and report pass@1 (greedy) and, for k > 1, pass@k."""
    tok = load_tokenizer(model_path)
    llm = make_llm(model_path, engine)
    result = greedy_eval(llm, tok, rows, reward, max_tokens)
    result.pop("table")
    result = {"model": model_path, "pass@1": result["accuracy"], "n": result["n"]}
    if k > 1:
        result[f"pass@{k}"] = pass_at_k(llm, tok, rows, reward, max_tokens, k)
    shutdown_llm(llm)
    return result
