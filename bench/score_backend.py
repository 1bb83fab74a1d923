"""Teacher scoring: score.backend vllm (prompt log-probs from a vLLM engine) and server (vLLM's
OpenAI-compatible server, one and two replicas) against hf (the teacher module, chunked output layer),
same teacher, same token ids, same top-k, every response in one call.

W's teacher (:mod:`bench.workload`, 80M parameters, 32k vocabulary), ``--prompts`` x ``--n`` responses of
``--tokens`` random token ids after each rendered prompt (scoring does not care who wrote them), fp32 on
this machine. hf runs :func:`gndpo.stages.models.logprobs.pair_token_stats` in score's token-budget batches
(teacher side only, as with the vLLM backend the student's forward is the same either way); vllm runs
:func:`gndpo.stages.models.vllm_engine.response_logprobs`. Reports response tokens/s of each (the engine's start
reported beside), their ratio and the largest difference of the teacher's log-probs. ``--servers``
adds the server backend (:class:`gndpo.stages.models.teacher_server.ServerPool`) against servers started
on loopback: tokens/s with one and two replicas, and the per-request overhead (the mean time of one
two-token request, sequentially, through the pool and through the in-process engine). The servers share
this machine's cores with the client and each other, so two replicas measure the client's overhead, not
a second GPU's throughput. Writes ``results/score_backend.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, machine, save_json  # noqa: E402
from workload import CPU_SCALE, build_workload  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=CPU_SCALE.prompts)
    ap.add_argument("--n", type=int, default=CPU_SCALE.n)
    ap.add_argument("--tokens", type=int, default=CPU_SCALE.max_tokens)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--servers", action="store_true", help="also the server backend, against servers started on loopback")
    a = ap.parse_args(argv)

    import numpy as np
    import torch

    from gndpo.pipeline.settings.schema import DataConfig, EngineConfig
    from gndpo.stages.models.batches import make_batch, token_budget_batches
    from gndpo.stages.models.device import set_cpu_threads
    from gndpo.stages.models.loading import load_causal_lm, load_tokenizer
    from gndpo.stages.models.logprobs import chunks, head_logprobs, response_hidden
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
    engine_request_s = mean_request_s(lambda: response_logprobs(llm, [prompts[0][:1]], [responses[0][:1]], a.topk))
    shutdown_llm(llm)
    result = {
        "teacher": "W teacher (80M, 32k vocabulary), fp32, CPU", "responses": len(responses), "tokens_per_response": a.tokens,
        "topk": a.topk,
        "hf": {"seconds": round(hf_s, 2), "tokens_per_s": round(n_tokens / hf_s, 1)},
        "vllm": {"seconds": round(vllm_s, 2), "tokens_per_s": round(n_tokens / vllm_s, 1), "engine_start_s": round(start_s, 1)},
        "max_abs_diff": float(np.abs(by_engine["logprobs"] - hf_lp).max()),
    }
    result["ratio"] = round(result["vllm"]["tokens_per_s"] / result["hf"]["tokens_per_s"], 2)
    result["vllm"]["request_s"] = round(engine_request_s, 4)
    if a.servers:
        result["server"] = server_arms(teacher, prompts, responses, a.topk, hf_lp)
        for arm in result["server"].values():
            if isinstance(arm, dict):
                arm["vs_vllm"] = round(arm["tokens_per_s"] / result["vllm"]["tokens_per_s"], 2)
    result["machine"], result["date"] = machine(), time.strftime("%Y-%m-%d")
    print(json.dumps(result, indent=1))
    save_json(RESULTS / "score_backend.json", result)
    (RESULTS / "score_backend.md").write_text(table(result))
    return result


def table(result: dict) -> str:
    """The results as the markdown table the docs include."""
    rows = [("hf (teacher module)", result["hf"]), ("vllm (in-process engine)", result["vllm"])]
    server = result.get("server", {})
    rows += [(f"server, {name.replace('_', ' ')}", server[name]) for name in ("one_replica", "two_replicas") if name in server]
    lines = [f"{result['date']}, {result['machine']}: {result['responses']} responses x {result['tokens_per_response']} tokens, "
             f"top-{result['topk']}, fp32.", "", "| backend | seconds | response tokens/s | max abs diff to hf |", "|---|---|---|---|"]
    for name, arm in rows:
        diff = "-" if arm is result["hf"] else f"{arm.get('max_abs_diff', result['max_abs_diff']):.2e}"
        lines.append(f"| {name} | {arm['seconds']} | {arm['tokens_per_s']:,} | {diff} |")
    lines += ["", f"One two-token request, sequentially: in-process engine {result['vllm']['request_s'] * 1000:.1f} ms"
              + (f", through the server pool {server['request_s'] * 1000:.1f} ms (servers started in {server['start_s']} s)." if server else ".")]
    return "\n".join(lines) + "\n"


def mean_request_s(call, repeats: int = 20) -> float:
    """The mean wall time of ``call`` over ``repeats`` sequential calls, after one unmeasured."""
    call()
    t0 = time.time()
    for _ in range(repeats):
        call()
    return (time.time() - t0) / repeats


def server_arms(teacher: str, prompts: list, responses: list, topk: int, hf_lp) -> dict:
    """The server backend on two replicas of ``teacher`` started here: {"one_replica", "two_replicas":
    seconds, tokens/s, max |diff| to hf; "request": the mean two-token request}."""
    import tempfile

    import numpy as np

    from gndpo.stages.models.teacher_server import ServerPool, ServerSettings
    from tests.teacher_servers import start_servers

    n_tokens = sum(len(r) for r in responses)
    folder = Path(tempfile.mkdtemp(prefix="gndpo-bench-servers-"))
    t0 = time.time()
    # Compiled, as vLLM serves by default (and as the recorded results were measured).
    servers = start_servers([(Path(teacher), "teacher")] * 2, folder, max_model_len=512, kv_cache_mib=2048, threads=0,
                            in_process=False, eager=False)
    arms = {"start_s": round(time.time() - t0, 1)}
    try:
        for name, urls in (("one_replica", [servers[0].url]), ("two_replicas", [s.url for s in servers])):
            pool = ServerPool(ServerSettings(tuple(urls), "teacher", in_flight=8))
            pool.response_logprobs(prompts[:2], responses[:2], topk)  # connections open, the servers warm
            t0 = time.time()
            scored = pool.response_logprobs(prompts, responses, topk)
            seconds = time.time() - t0
            arms[name] = {"seconds": round(seconds, 2), "tokens_per_s": round(n_tokens / seconds, 1),
                          "max_abs_diff": float(np.abs(scored["logprobs"] - hf_lp).max())}
            if name == "one_replica":
                arms["request_s"] = round(mean_request_s(lambda: pool.response_logprobs([prompts[0][:1]], [responses[0][:1]], topk)), 4)
            pool.close()
    finally:
        for server in servers:
            server.kill()
    return arms


if __name__ == "__main__":
    main()
