"""What the method family costs on top of GNDPO, measured as ratios within one run.

1. Score: one batch of responses through teacher and student (the score stage's chunked forward),
   without extras (GNDPO with logging.entropy_metrics off), with both entropies (what the round's
   entropy metrics cost: the default) and with every optional column (teacher top-k, both entropies,
   full-vocab KL).
   The toy vocabulary has 15 tokens, so the same is also timed on a pair with a realistic vocabulary
   (``--vocab``, default 32000; random weights, built in a temporary folder).
2. Train: forward + backward of one micro-batch with GNDPO's GSPO loss, and with the forward-KL
   divergence on the teacher's top-k (the student's full softmax gathered at the top-k ids).

Uses the demo's toy teacher/student (built or reused from the cache). Writes
bench/results/method_cost.json and .md. Usage: python bench/method_cost.py [--rows 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.realistic
from gndpo.apps.demos.arithmetic import ensure_toy_assets
from gndpo.pipeline.methods.losses import DivergenceTerm, PolicyGradientTerm, aggregate, combined_token_losses  # noqa: E402
from gndpo.stages.models.batches import make_batch
from gndpo.stages.models.device import set_cpu_threads
from gndpo.stages.models.loading import load_causal_lm, load_tokenizer
from gndpo.stages.models.logprobs import pair_token_stats, policy_token_logprobs
from tests.realistic import ShapeSpec, build_realistic_pair  # noqa: E402

OUT = Path(__file__).parent / "results"


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(student, teacher, prompts, responses, pad, topk: int, repeats: int) -> dict:
    """Score and train costs of the method extras on one batch, as ratios to GNDPO's."""
    batch = make_batch(prompts, responses, pad, torch.device("cpu"))
    chunk = 1024

    def score(extras: bool, entropies: bool = False):
        pair_token_stats(teacher, student, batch, chunk, 1.0, topk if extras else 0, (extras or entropies,) * 2, extras)

    stored = pair_token_stats(teacher, student, batch, chunk, 1.0, topk)
    t_topk, ids = stored["teacher_topk_logprobs"], stored["teacher_topk_ids"].long()
    mask = batch.mask().double()

    def train_step(divergence):
        student.zero_grad()
        flat, at_ids, _, _ = policy_token_logprobs(student, batch, chunk, 1.0, ids if divergence else None)
        logp = batch.padded(flat)
        adv = torch.randn_like(logp)
        s_topk = batch.padded(at_ids, -float(torch.log(torch.tensor(topk + 1.0)))) if divergence else None
        t_pad = batch.padded(t_topk, -float(torch.log(torch.tensor(topk + 1.0)))) if divergence else None
        policy = None if divergence else PolicyGradientTerm("gspo", logp.detach(), adv, mask)
        losses, _ = combined_token_losses(logp, policy, DivergenceTerm(divergence, mask, s_topk, t_pad) if divergence else None)
        aggregate(losses, mask, "token-mean", len(prompts), int(mask.sum())).backward()

    base_score, full_score = timed(lambda: score(False), repeats), timed(lambda: score(True), repeats)
    entropy_score = timed(lambda: score(False, entropies=True), repeats)
    base_train, div_train = timed(lambda: train_step(None), repeats), timed(lambda: train_step("forward_kl"), repeats)
    return {
        "vocab": student.config.vocab_size, "rows": len(prompts), "tokens": batch.n_tokens, "topk": topk,
        "score_seconds": {"gndpo": base_score, "all_extras": full_score, "ratio": full_score / base_score,
                          "entropy_metrics": entropy_score, "entropy_ratio": entropy_score / base_score},
        "train_step_seconds": {"gspo": base_train, "forward_kl_topk": div_train, "ratio": div_train / base_train},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    set_cpu_threads()
    torch.manual_seed(0)
    results = []
    # The toy pair (vocabulary 15: "top-16" is the whole distribution) ...
    assets = ensure_toy_assets()
    tok = load_tokenizer(str(assets / "student"))
    prompts = [tok(json.loads(line)["prompt"])["input_ids"] for line in (assets / "train.jsonl").read_text().splitlines()[: args.rows]]
    student, teacher = load_causal_lm(str(assets / "student")), load_causal_lm(str(assets / "teacher")).eval()
    responses = [torch.randint(3, student.config.vocab_size, (8,)).tolist() for _ in prompts]
    topk = min(args.topk, student.config.vocab_size)
    results.append({"models": "toy", **measure(student, teacher, prompts, responses, tok.pad_token_id or 0, topk, args.repeats)})
    # ... and a realistic-vocabulary pair (random weights), 16 responses of 64 tokens.
    with tempfile.TemporaryDirectory() as tmp:
        build_realistic_pair(tmp, ShapeSpec(vocab_size=args.vocab, hidden=256, layers=1, heads=4, kv_heads=2, intermediate=704, tokenizer_vocab=2048))
        student, teacher = load_causal_lm(f"{tmp}/student"), load_causal_lm(f"{tmp}/teacher").eval()
        prompts = [torch.randint(3, 2048, (16,)).tolist() for _ in range(16)]
        responses = [torch.randint(3, args.vocab, (64,)).tolist() for _ in prompts]
        results.append({"models": "realistic-vocab", **measure(student, teacher, prompts, responses, 0, args.topk, args.repeats)})
    OUT.mkdir(exist_ok=True)
    (OUT / "method_cost.json").write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=1))
    lines = [f"{torch.get_num_threads()} threads, median of {args.repeats}\n",
             "| models | vocab | responses x tokens | score: + entropy metrics (ratio) | score: + top-k, entropies, KL (ratio) "
             "| train fwd+bwd: top-k forward KL vs GSPO (ratio) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['models']} | {r['vocab']} | {r['rows']} x {r['tokens'] // r['rows']} | {r['score_seconds']['entropy_ratio']:.2f} "
                     f"| {r['score_seconds']['ratio']:.2f} | {r['train_step_seconds']['ratio']:.2f} |")
    (OUT / "method_cost.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
