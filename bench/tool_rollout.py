"""Multi-turn tool-use rollout: conversations batched per turn (what rollout does) against one
conversation at a time (a naive agent loop), same engine, model, seeds and limits.

The policy is the tool-use toy's teacher (:mod:`gndpo.apps.demos.tool_task`), which calls the calculator
on every prompt, so each conversation is a call, a tool turn and an answer, sampled at temperature 1
with the demo's limits (3 student turns, 24 tokens a turn, 64 a conversation). Both sides go through
:func:`gndpo.stages.text.agent.run_conversations` on one vLLM engine started once (its start is reported
beside, not counted); the baseline calls it with one conversation at a time, on a subset of
``--baseline-conversations``. Reports conversations/s and student tokens/s of each, their ratio, and
how many of the subset's conversations came out token for token the same both ways. Writes
``results/tool_rollout.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, save_json  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--baseline-conversations", type=int, default=128)
    a = ap.parse_args(argv)

    import json

    from gndpo.apps.demos.tool_task import ensure_tool_toy_assets
    from gndpo.pipeline.settings.schema import DataConfig, EngineConfig, RolloutConfig
    from gndpo.stages.models.device import set_cpu_threads
    from gndpo.stages.models.loading import load_tokenizer
    from gndpo.stages.models.sampling import SamplingRequest
    from gndpo.stages.models.vllm_engine import make_llm, shutdown_llm
    from gndpo.stages.samplers.vllm import VLLMSampler
    from gndpo.stages.text.agent import Conversation, ToolUse, run_conversations
    from gndpo.stages.text.chat import render_prompt, stop_token_ids

    set_cpu_threads()
    assets = ensure_tool_toy_assets()
    model, data = str(assets / "teacher"), DataConfig()
    tok = load_tokenizer(model)
    rc = RolloutConfig(tools=["calculator"], max_turns=3, max_tokens=24, max_tool_response_tokens=64)
    tool_use, stops = ToolUse.from_config(rc), stop_token_ids(tok, data)
    rows = [json.loads(line) for line in open(assets / "train.jsonl")][: a.prompts]
    prompts = [render_prompt(tok, r, data).token_ids for r in rows]

    def conversations(count=None):
        out = [Conversation(r, p, 1000 * i + s) for i, (r, p) in enumerate(zip(rows, prompts)) for s in range(a.n)]
        return out[:count] if count else out

    def sampling(seed, max_tokens, extra_stops):
        return SamplingRequest(seed, max_tokens, 1.0, stop=tuple(extra_stops), keep_stop_text=bool(extra_stops), stop_token_ids=tuple(stops))

    t0 = time.time()
    engine = EngineConfig(max_model_len=128, kv_cache_gib=1)
    llm = make_llm(model, engine)
    sampler = VLLMSampler(llm, engine)
    start_s = time.time() - t0

    def timed(batches):
        t = time.time()
        for batch in batches:
            run_conversations(sampler, tok, batch, data, tool_use, rc.max_tokens, sampling)
        seconds = time.time() - t
        done = [c for batch in batches for c in batch]
        student = sum(sum(c.loss_mask) for c in done)
        return done, {
            "conversations": len(done), "seconds": round(seconds, 2), "conversations_per_s": len(done) / seconds,
            "student_tokens_per_s": student / seconds, "turns_mean": sum(c.num_turns for c in done) / len(done),
            "tool_share_of_tokens": 1 - student / sum(len(c.loss_mask) for c in done),
        }

    run_conversations(sampler, tok, conversations(8), data, tool_use, rc.max_tokens, sampling)  # warm-up
    batched, batched_stats = timed([conversations()])
    single, single_stats = timed([[c] for c in conversations(a.baseline_conversations)])
    same = sum(x.response_ids == y.response_ids for x, y in zip(batched, single))
    shutdown_llm(llm)
    result = {
        "model": "tool-use toy teacher (2 x 128 Llama, character tokenizer)",
        "limits": {"max_turns": rc.max_turns, "max_tokens": rc.max_tokens, "max_tool_response_tokens": rc.max_tool_response_tokens},
        "engine_start_s": round(start_s, 1),
        "batched_per_turn": batched_stats,
        "one_at_a_time": single_stats,
        "ratio": batched_stats["conversations_per_s"] / single_stats["conversations_per_s"],
        "identical_conversations": f"{same} of {len(single)}",
    }
    save_json(RESULTS / "tool_rollout.json", result)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
