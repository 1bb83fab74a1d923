"""GNDPO against OPD on a real model: does batch normalization keep sampled-token distillation stable?

SmolLM2-135M-Instruct distils itself reading three demonstrations (``gndpo demo --task self-distill``):
on a bare question the student starts "The capital of Denmark is ..." where the teacher, having read
the demonstrations, expects "Answer: ...", so the teacher disagrees strongly with a few sampled tokens
of every response (the first ones) and little with the rest: the outlier states where plain OPD's
per-token advantages, and so its gradients, are largest. For each learning rate (the demo's, and ten
times it, where instability is expected) this runs

    gndpo compare opd gndpo forward_kl --task self-distill --seeds 3 --rounds 3 --set train.lr=LR [shape]

(each method with rollout seeds 0, 1, 2; the second and third method fork the first one's round 0, so
all three train on the same round-0 responses) and tabulates per method, learning rate and round: the
held-out format score of the policy the round ends with (greedy, 36 questions), the sampled KL(student
|| teacher) estimate, the pre-clip gradient norm's maximum and 99th percentile over the round's steps,
the share of steps the clip (1.0) cut, and the policy-gradient advantage range (none for forward KL).
Cells are the mean over the 3 seeds (± their sample standard deviation where it says so); advantage
ranges are the lowest and highest over the seeds.

The shape is smaller than the demo's (16 questions x 2 samples x 24 tokens, 2 optimizer steps of 16
responses per round, against 64 x 2 and 4 steps of 32) so that the 18 runs fit about an hour on 2 CPU
cores.

Writes results/real_model_stability.{json,md,png}. The runs stay in ``--work`` (default under
~/.cache/gndpo/bench): rerunning finishes what is missing and re-reads what is done.

    .venv/bin/python bench/real_model_stability.py
    .venv/bin/python bench/real_model_stability.py --table-only     # re-read the runs, rewrite results
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, save_json  # noqa: E402
from seeded_compare import arguments, figure, markdown, run_or_read, table_rows  # noqa: E402

METHODS = ["opd", "gndpo", "forward_kl"]
LEARNING_RATES = ["1e-4", "1e-3"]  # the self-distillation demo's, and ten times it
SEEDS, ROUNDS = 3, 3
SHAPE = ["rollout.prompts_per_round=16", "rollout.prompts_per_unit=16", "train.optimizer_steps=2", "train.micro_batch_size=16"]
WORK = Path.home() / ".cache" / "gndpo" / "bench" / "real_model_stability"
OUT = RESULTS / "real_model_stability"
SCORE = "held-out format"


def main() -> None:
    args = arguments(__doc__.splitlines()[0], WORK, LEARNING_RATES)
    seconds = json.loads(OUT.with_suffix(".json").read_text()).get("seconds", {}) if OUT.with_suffix(".json").exists() else {}
    summaries = run_or_read(args, METHODS, "self-distill", LEARNING_RATES, SEEDS, ROUNDS, SHAPE, seconds)
    rows = [row for lr, summary in summaries.items() for row in table_rows(lr, summary, METHODS, ROUNDS)]
    save_json(OUT.with_suffix(".json"), {"methods": METHODS, "seeds": SEEDS, "rounds": ROUNDS, "shape": SHAPE,
                                         "seconds": seconds, "rows": rows})
    OUT.with_suffix(".md").write_text(markdown(rows, SCORE))
    figure(summaries, METHODS, ROUNDS, OUT.with_suffix(".png"),
           f"SmolLM2-135M-Instruct self-distillation, {SEEDS} seeds (mean, band: lowest to highest)", f"{SCORE} (greedy, 36 questions)")
    print(markdown(rows, SCORE))


if __name__ == "__main__":
    main()
