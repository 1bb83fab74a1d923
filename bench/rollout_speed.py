"""Rollout tokens/s: gndpo's vLLM engine against Hugging Face ``generate``, same model, sampling and lengths.

W's student (:mod:`bench.workload`), ``--prompts`` x ``--n`` requests of ``--max-tokens`` tokens at
temperature 1 (no top-p/top-k), fp32. vLLM runs through the project's own engine set-up and generation
(:func:`gndpo.stages.models.vllm_engine.make_llm`, :func:`generate`, one seeded request per sample, as rollout sends
them); HF ``generate`` runs in batches of ``--hf-batch`` with its KV cache. Random weights never sample
EOS, so both produce exactly prompts x n x max_tokens tokens. Generation time excludes the engine's
start-up, which is reported beside it. Writes ``results/rollout_speed.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, save_json  # noqa: E402
from workload import CPU_SCALE, FULL_SCALE, build_workload  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=CPU_SCALE.prompts)
    ap.add_argument("--n", type=int, default=CPU_SCALE.n)
    ap.add_argument("--max-tokens", type=int, default=FULL_SCALE.max_tokens)
    ap.add_argument("--hf-batch", type=int, default=64)
    a = ap.parse_args(argv)

    from vllm import SamplingParams

    from gndpo.pipeline.settings.schema import DataConfig, EngineConfig
    from gndpo.stages.models.device import set_cpu_threads
    from gndpo.stages.models.loading import load_causal_lm, load_tokenizer
    from gndpo.stages.models.vllm_engine import generate, make_llm, shutdown_llm
    from gndpo.stages.text.chat import render_prompt

    model = str(build_workload() / "student")
    tok = load_tokenizer(model)
    rows = [json.loads(line) for line in open(build_workload() / "train.jsonl")][: a.prompts]
    prompts = [list(render_prompt(tok, r, DataConfig()).token_ids) for r in rows]  # as rollout renders them
    requests = [p for p in prompts for _ in range(a.n)]
    expected = len(requests) * a.max_tokens

    t0 = time.time()
    llm = make_llm(model, EngineConfig(max_model_len=512, kv_cache_gib=2), seed=0)
    start_s = time.time() - t0
    params = [SamplingParams(temperature=1.0, max_tokens=a.max_tokens, seed=i, logprobs=0) for i in range(len(requests))]
    t0 = time.time()
    gens = generate(llm, requests, params)
    vllm_s = time.time() - t0
    vllm_tokens = sum(len(g.token_ids) for g in gens)
    shutdown_llm(llm)

    set_cpu_threads()
    hf = load_causal_lm(model, device=torch.device("cpu"), dtype=torch.float32).eval()
    torch.manual_seed(0)
    hf_tokens, t0 = 0, time.time()
    pad = tok.pad_token_id
    for i in range(0, len(requests), a.hf_batch):
        chunk = requests[i : i + a.hf_batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])  # left padding for generation
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=a.max_tokens, min_new_tokens=a.max_tokens, pad_token_id=pad)
        hf_tokens += (out.shape[1] - width) * len(chunk)
    hf_s = time.time() - t0
    results = {
        "requests": len(requests), "max_tokens": a.max_tokens, "expected_tokens": expected,
        "vllm": {"tokens": vllm_tokens, "seconds": round(vllm_s, 2), "tokens_per_s": round(vllm_tokens / vllm_s, 1),
                 "engine_start_s": round(start_s, 1)},
        "hf_generate": {"tokens": hf_tokens, "seconds": round(hf_s, 2), "tokens_per_s": round(hf_tokens / hf_s, 1),
                        "batch": a.hf_batch},
    }
    results["ratio"] = round(results["vllm"]["tokens_per_s"] / results["hf_generate"]["tokens_per_s"], 2)
    print(json.dumps(results), flush=True)
    save_json(RESULTS / "rollout_speed.json", results)
    return results


if __name__ == "__main__":
    main()
