"""Achieved FLOP/s of score and train on W's models, as a fraction of a matmul peak measured in the same run.

Peak: the best of repeated square matmuls (``--matmul`` wide) in fp32 and bf16, the most this machine's
cores reach in either dtype. Score: the project's own scoring path (:func:`gndpo.stages.models.logprobs.
pair_token_stats`: both backbones over prompt + response, then the two output layers and log-softmax
over response positions, chunked). Train: one micro-batch of the student through
:func:`policy_token_logprobs`, a token-mean loss and ``backward()``. Both on a batch of ``--rows``
sequences of ``--prompt`` + ``--response`` tokens, timed as the best of ``--repeats``.

FLOPs are counted the usual way (model FLOPs, no recomputation): 2 per parameter and token for a
forward through the transformer blocks (every token) and the output layer (response tokens only), plus
attention's 2 x seq^2 x hidden per layer per sequence (causal half); a backward costs twice its forward.
Writes ``results/flops.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, save_json  # noqa: E402
from workload import STUDENT, TEACHER, build_workload, parameters  # noqa: E402


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up (allocations, kernels)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_peak(n: int, dtype: torch.dtype, repeats: int) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / best_time(lambda: a @ b, repeats)


def forward_flops(spec, rows: int, prompt: int, response: int) -> float:
    p = parameters(spec)
    seq = prompt + response
    return 2 * p["blocks"] * rows * seq + 2 * p["lm_head"] * rows * response + 2 * spec.layers * rows * seq * seq * spec.hidden


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--matmul", type=int, default=3072)
    a = ap.parse_args(argv)

    from gndpo.stages.models.batches import make_batch
    from gndpo.stages.models.device import set_cpu_threads
    from gndpo.stages.models.loading import load_causal_lm
    from gndpo.stages.models.logprobs import pair_token_stats, policy_token_logprobs

    set_cpu_threads()
    assets = build_workload()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, STUDENT.tokenizer_vocab, (a.rows, a.prompt), generator=g).tolist()
    responses = torch.randint(0, STUDENT.tokenizer_vocab, (a.rows, a.response), generator=g).tolist()
    batch = make_batch(prompts, responses, 0, torch.device("cpu"))
    score_flops = forward_flops(TEACHER, a.rows, a.prompt, a.response) + forward_flops(STUDENT, a.rows, a.prompt, a.response)
    train_flops = 3 * forward_flops(STUDENT, a.rows, a.prompt, a.response)
    results = {"threads": torch.get_num_threads(), "batch": {"rows": a.rows, "prompt": a.prompt, "response": a.response}}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        peak = matmul_peak(a.matmul, dtype, a.repeats)
        teacher = load_causal_lm(str(assets / "teacher"), device=torch.device("cpu"), dtype=dtype).eval()
        student = load_causal_lm(str(assets / "student"), device=torch.device("cpu"), dtype=dtype)

        def score():
            with torch.no_grad():
                pair_token_stats(teacher, student.eval(), batch, 1024, 1.0)

        def train():
            student.train()
            student.zero_grad(set_to_none=True)
            logp, _, extra, _ = policy_token_logprobs(student, batch, 1024, 1.0)
            (-(logp.float().mean()) + extra).backward()

        score_s, train_s = best_time(score, a.repeats), best_time(train, a.repeats)
        results[name] = {
            "matmul_peak_gflops": round(peak / 1e9, 1),
            "score": {"seconds": round(score_s, 3), "gflops": round(score_flops / score_s / 1e9, 1),
                      "fraction_of_peak": round(score_flops / score_s / peak, 3)},
            "train": {"seconds": round(train_s, 3), "gflops": round(train_flops / train_s / 1e9, 1),
                      "fraction_of_peak": round(train_flops / train_s / peak, 3)},
        }
        print(name, results[name], flush=True)
    save_json(RESULTS / "flops.json", results)
    return results


if __name__ == "__main__":
    main()
