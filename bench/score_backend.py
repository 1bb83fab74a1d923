"""Teacher scoring: score.backend vllm (prompt log-probs from a vLLM engine) against hf (the teacher
module, chunked output layer), same teacher, same token ids, same top-k.

W's teacher (:mod:`bench.workload`, 80M parameters, 32k vocabulary), ``--prompts`` x ``--n`` responses of
``--tokens`` random token ids after each rendered prompt (scoring does not care who wrote them), fp32 on
this machine. hf runs :func:`gndpo.stages.models.logprobs.pair_token_stats` in score's token-budget batches
(teacher side only, as with the vLLM backend the student's forward is the same either way); vllm runs
:func:`gndpo.stages.models.vllm_engine.response_logprobs`. Reports response tokens/s of each (the engine's start
reported beside), their ratio and the largest difference of the teacher's log-probs. Writes
``results/score_backend.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, save_json  # noqa: E402
from workload import CPU_SCALE, build_workload  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=CPU_SCALE.prompts)
    ap.add_argument("--n", type=int, default=CPU_SCALE.n)
    ap.add_argument("--tokens", type=int, default=CPU_SCALE.max_tokens)
    ap.add_argument("--topk", type=int, default=16)
    a = ap.parse_args(argv)

    import numpy as np
    import torch

    from gndpo.pipeline.config.schema import DataConfig, EngineConfig
    from gndpo.stages.models.device import set_cpu_threads
    from gndpo.stages.models.loading import load_causal_lm, load_tokenizer
    from gndpo.stages.models.logprobs import chunks, head_logprobs, make_batch, response_hidden, token_budget_batches
    from gndpo.stages.models.vllm_engine import make_llm, response_logprobs, shutdown_llm
    from gndpo.stages.text.chat import render_prompt

    set_cpu_threads()
    folder = build_workload()
    teacher = str(folder / "teacher")
    tok = load_tokenizer(teacher)
    rows = [json.loads(line) for line in open(folder / "train.jsonl")][: a.prompts]
    rng = np.random.default_rng(0)
    prompts = [np.asarray(render_prompt(tok, r, DataConfig()).token_ids) for r in rows for _ in range(a.n)]
    responses = [rng.integers(0, len(tok), a.tokens) for _ in prompts]
    n_tokens = sum(len(r) for r in responses)

    model = load_causal_lm(teacher, device=torch.device("cpu"), dtype=torch.float32).eval()
    t0 = time.time()
    hf_lp = np.zeros(n_tokens, np.float32)
    offsets = np.cumsum([0] + [len(r) for r in responses])
    with torch.no_grad():
        for rows_ in token_budget_batches(np.array([len(p) + len(r) for p, r in zip(prompts, responses)]), 32768, 128):
            batch = make_batch([prompts[i] for i in rows_], [responses[i] for i in rows_], 0, torch.device("cpu"))
            hidden = response_hidden(model, batch)
            parts = []
            for sl in chunks(batch.n_tokens, 1024):
                logp = head_logprobs(model, hidden[sl])
                parts.append(logp.gather(-1, batch.targets[sl].unsqueeze(-1)).squeeze(-1))
                logp.topk(a.topk, dim=-1)
            where = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in rows_])
            hf_lp[where] = torch.cat(parts).numpy()
    hf_s = time.time() - t0
    del model

    t0 = time.time()
    llm = make_llm(teacher, EngineConfig(max_model_len=512, kv_cache_gib=2), max_logprobs=a.topk)
    start_s = time.time() - t0
    t0 = time.time()
    by_engine = response_logprobs(llm, prompts, responses, a.topk)
    vllm_s = time.time() - t0
    shutdown_llm(llm)
    result = {
        "teacher": "W teacher (80M, 32k vocabulary), fp32, CPU", "responses": len(responses), "tokens_per_response": a.tokens,
        "topk": a.topk,
        "hf": {"seconds": round(hf_s, 2), "tokens_per_s": round(n_tokens / hf_s, 1)},
        "vllm": {"seconds": round(vllm_s, 2), "tokens_per_s": round(n_tokens / vllm_s, 1), "engine_start_s": round(start_s, 1)},
        "max_abs_diff": float(np.abs(by_engine["logprobs"] - hf_lp).max()),
    }
    result["ratio"] = round(result["vllm"]["tokens_per_s"] / result["hf"]["tokens_per_s"], 2)
    print(json.dumps(result, indent=1))
    save_json(RESULTS / "score_backend.json", result)
    return result


if __name__ == "__main__":
    main()
