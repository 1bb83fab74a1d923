"""What the method family costs on top of GNDPO, measured as ratios within one run.

1. Score: one chunk of responses through teacher and student (the score stage's forward), without
   extras (GNDPO) and with every optional column (teacher top-k, both entropies, full-vocab KL).
   The toy vocabulary has 15 tokens, so the same post-processing is also timed on random logits of a
   realistic vocabulary (``--vocab``, default 32000): log-softmax + sampled-token gather vs the same
   plus the extras.
2. Train: forward + backward of one micro-batch with GNDPO's GSPO loss, and with the forward-KL
   divergence on the teacher's top-k (the student's full softmax gathered at the top-k ids).

Uses the demo's toy teacher/student (built or reused from the cache). Writes
bench/results/method_cost.json and .md. Usage: python bench/method_cost.py [--rows 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from gndpo.pipeline.losses import aggregate, combined_token_losses
from gndpo.pipeline.methods.base import SCORE_EXTRAS
from gndpo.pipeline.toy import ensure_toy_assets
from gndpo.stages.modeling import load_causal_lm, load_tokenizer, response_distributions, set_cpu_threads
from gndpo.stages.score import ScoreJob

OUT = Path(__file__).parent / "results"


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    set_cpu_threads()
    torch.manual_seed(0)
    assets = ensure_toy_assets()
    tok = load_tokenizer(str(assets / "student"))
    student = load_causal_lm(str(assets / "student"))
    teacher = load_causal_lm(str(assets / "teacher")).eval()
    prompts = [tok(json.loads(line)["prompt"])["input_ids"] for line in (assets / "train.jsonl").read_text().splitlines()[: args.rows]]
    vocab = student.config.vocab_size
    responses = [torch.randint(3, vocab, (8,)).tolist() for _ in prompts]
    pad = tok.pad_token_id or 0

    class Cfg:  # the two score settings ScoreJob._extras reads
        class score:
            teacher_topk = args.topk

    scorer = ScoreJob.__new__(ScoreJob)
    scorer.cfg = Cfg

    @torch.no_grad()
    def score(needs):
        t_all, _, _ = response_distributions(teacher, prompts, responses, pad, 1.0)
        s_all, _, _ = response_distributions(student, prompts, responses, pad, 1.0)
        scorer._extras(needs, t_all, s_all)

    with torch.no_grad():
        t_all, _, _ = response_distributions(teacher, prompts, responses, pad, 1.0)
        t_topk, ids = t_all.topk(min(args.topk, vocab), dim=-1)

    def train_step(divergence):
        student.zero_grad()
        logp_all, logp, mask = response_distributions(student, prompts, responses, pad, 1.0)
        adv = torch.randn_like(logp)
        s_topk = torch.gather(logp_all, 2, ids) if divergence else None
        losses, _ = combined_token_losses(
            "none" if divergence else "gspo", divergence, logp, logp.detach(), adv, mask, mask, s_topk, t_topk
        )
        aggregate(losses, mask, "token-mean", len(prompts), int(mask.sum())).backward()

    base_score = timed(lambda: score(frozenset()), args.repeats)
    full_score = timed(lambda: score(frozenset(SCORE_EXTRAS)), args.repeats)
    base_train = timed(lambda: train_step(None), args.repeats)
    div_train = timed(lambda: train_step("forward_kl"), args.repeats)
    # Post-processing only, at a realistic vocabulary: 16 responses x 64 positions.
    t_logits, s_logits = torch.randn(16, 64, args.vocab), torch.randn(16, 64, args.vocab)
    target = torch.randint(0, args.vocab, (16, 64, 1))

    @torch.no_grad()
    def post(needs):
        t, s = torch.log_softmax(t_logits, -1), torch.log_softmax(s_logits, -1)
        torch.gather(t, 2, target), torch.gather(s, 2, target)
        scorer._extras(needs, t, s)

    base_post = timed(lambda: post(frozenset()), args.repeats)
    full_post = timed(lambda: post(frozenset(SCORE_EXTRAS)), args.repeats)
    result = {
        "rows": args.rows, "vocab": vocab, "topk": min(args.topk, vocab), "threads": torch.get_num_threads(),
        "score_seconds": {"gndpo": base_score, "all_extras": full_score, "ratio": full_score / base_score},
        "train_step_seconds": {"gspo": base_train, "forward_kl_topk": div_train, "ratio": div_train / base_train},
        "postprocess_seconds_at_vocab": {"vocab": args.vocab, "gndpo": base_post, "all_extras": full_post, "ratio": full_post / base_post},
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "method_cost.json").write_text(json.dumps(result, indent=1))
    (OUT / "method_cost.md").write_text(
        f"toy models, {args.rows} responses of 8 tokens, vocab {vocab}, top-k {result['topk']}, {result['threads']} threads, median of {args.repeats}\n\n"
        "| measurement | GNDPO baseline (s) | with the method's extra work (s) | ratio |\n|---|---|---|---|\n"
        f"| score chunk: + top-k, entropies, KL | {base_score:.4f} | {full_score:.4f} | {full_score / base_score:.2f} |\n"
        f"| train micro-batch fwd+bwd: forward KL on top-k vs GSPO | {base_train:.4f} | {div_train:.4f} | {div_train / base_train:.2f} |\n"
        f"| score post-processing at vocab {args.vocab} (16 x 64 positions): + extras | {base_post:.4f} | {full_post:.4f} | {full_post / base_post:.2f} |\n"
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
