"""GNDPO on a real model: SmolLM2-135M-Instruct distils itself reading the answer (``--task privileged``).

The student reads a bare factual question; its teacher, the frozen initial student, reads the same
question with the reference answer in brackets (:mod:`gndpo.apps.demos.privileged`). The bare student
answers about half of the held-out questions right in its own words and the teacher about 0.84, in the
same words, so a sampled-token method has signal: the teacher agrees with the student's right answers
and disagrees with its wrong ones. Held-out correctness is ``answer_words`` (the answer's words
anywhere in the greedy response, 16 tokens, 50 questions). For each learning rate this runs

    gndpo compare opd gndpo forward_kl reverse_kl --task privileged --seeds 3 --rounds 8 train.lr=LR

(the demo's shape: 8 questions x 1 sample x 16 tokens a round, one optimizer step; forward and
reverse KL on the teacher's top-16 with its exact tail; methods after the first fork its round 0, so all
train on the same first responses) and tabulates per method, learning rate and round: held-out
correctness of the policy the round ends with, the sampled KL(student || teacher) estimate, the pre-clip
gradient norm's maximum and 99th percentile over the round's steps, the share of steps the clip (1.0)
cut, and the policy-gradient advantage range. Cells are the mean over the seeds (± sample standard
deviation where it says so). Then ``gndpo report`` draws each comparison folder (mean over seeds, band
from the lowest to the highest), and its held-out and gradient-norm figures are copied beside the table.

Writes results/privileged_answer.{json,md}, and the figures the benchmarks page shows to
docs/benchmarks/figures/: privileged_answer.png and privileged_answer_lr-<LR>_<figure>.png. The runs stay
in ``--work`` (default under ~/.cache/gndpo/bench): rerunning finishes what is missing.

    .venv/bin/python bench/privileged_answer.py
    .venv/bin/python bench/privileged_answer.py --table-only     # re-read the runs, rewrite results
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, gndpo_cmd, machine, run_timed, save_json  # noqa: E402
from seeded_compare import arguments, figure, markdown, mean_sd, run_or_read, table_rows  # noqa: E402

from gndpo.apps.demos.privileged import fact_of  # noqa: E402

TASK = "privileged"
METHODS = ["opd", "gndpo", "forward_kl", "reverse_kl"]
LEARNING_RATES = ["3e-5", "1e-4"]  # the demo's, and 3.3 times it, where the sampled-token methods' first pilots collapsed
SEEDS, ROUNDS = 3, 8
SHAPE: list[str] = []  # the demo's config (apps/demo_privileged.yaml)
WORK = Path.home() / ".cache" / "gndpo" / "bench" / "privileged_answer"
OUT = RESULTS / "privileged_answer"
FIGURES = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "figures"
SCORE = "held-out correct"
REPORT_FIGURES = ["accuracy", "grad_norm", "teacher_kl"]


def gains(summaries: dict[str, dict]) -> list[dict]:
    """Per learning rate and method: held-out correctness at the start and after the last round (seed
    mean ± sd), and the best round's mean."""
    out = []
    for lr, summary in summaries.items():
        for method in METHODS:
            runs = [r for r in summary["runs"] if r["method"] == method]
            start, start_sd = mean_sd([r["acc_r0"] for r in runs])
            end, end_sd = mean_sd([r[f"acc_r{ROUNDS}"] for r in runs])
            best = max(range(ROUNDS + 1), key=lambda k: mean_sd([r[f"acc_r{k}"] for r in runs])[0])
            out.append({"lr": lr, "method": method, "start": start, "start_sd": start_sd, "end": end, "end_sd": end_sd,
                        "gain_points": 100 * (end - start), "best_round": best,
                        "best": mean_sd([r[f"acc_r{best}"] for r in runs])[0]})
    return out


def gains_markdown(rows: list[dict]) -> str:
    lines = ["| lr | method | start | after round 8 (mean ± sd) | gain (points) | best (round) |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {g['lr']} | `{g['method']}` | {g['start']:.3f} | {g['end']:.3f} ± {g['end_sd']:.3f} | {g['gain_points']:+.1f} | "
              f"{g['best']:.3f} ({g['best_round']}) |" for g in rows]
    return "\n".join(lines) + "\n"


def facts(run: Path, split: str) -> dict[str, tuple[str, str]]:
    """{prompt_id: the fact it asks (fact_of)} of a run's prompt table."""
    return {r["prompt_id"]: fact_of(r) for r in pq.read_table(run / "prompts" / f"{split}.parquet", columns=["prompt_id", "prompt", "answer"]).to_pylist()}


def greedy_answers(path: Path, reward: str, response: str) -> dict[str, tuple[float, str]]:
    """{prompt_id: (greedy reward, greedy response)} of an evaluation file."""
    return {r["prompt_id"]: (r[reward], r[response]) for r in pq.read_table(path, columns=["prompt_id", reward, response]).to_pylist()}


# The teacher reads "(The answer is X.)": how often the student's greedy answers take up its opening.
TEACHER_OPENING = "The answer is"


def fact_exposure(work: Path, lr: str) -> list[dict]:
    """Per method and seed: which held-out questions' facts the run trained on (a training question of
    the same fact, in other words, among its rollouts), and its held-out correctness at the start and
    after the last round on those questions and on the rest."""
    out = []
    for run in sorted((work / f"lr-{lr}").glob("*/seed-*/run")):
        if not (run.parent / "eval" / "per_prompt.parquet").exists():
            continue  # not finished
        method, seed = run.parent.parent.name.split("-", 1)[1], int(run.parent.name.split("-")[1])
        # Methods after the first fork its round 0 (`gndpo compare`): that round's rollouts are its files.
        first = run if (run / "rounds" / "r0000" / "rollout").is_dir() else next((work / f"lr-{lr}").glob(f"00-*/{run.parent.name}/run"))
        train = facts(run, "train")
        shards = [*first.glob("rounds/r0000/rollout/data/u*/*/part-*.parquet"), *run.glob("rounds/r000[1-9]/rollout/data/u*/*/part-*.parquet")]
        shown = {train[pid] for f in shards for pid in pq.read_table(f, columns=["prompt_id"])["prompt_id"].to_pylist()}
        start = greedy_answers(next(first.glob("rounds/r0000/rollout/data/eval-heldout/*/eval.parquet")), "reward", "response")
        end = greedy_answers(run.parent / "eval" / "per_prompt.parquet", "greedy_reward", "greedy_response")
        seen = {pid for pid, fact in facts(run, "heldout").items() if fact in shown}
        rest = set(start) - seen
        rate = lambda scores, ids: sum(scores[i][0] for i in ids) / len(ids) if ids else None  # noqa: E731
        opening = lambda answers: sum(a[1].startswith(TEACHER_OPENING) for a in answers.values()) / len(answers)  # noqa: E731
        out.append({"lr": lr, "method": method, "seed": seed, "seen": len(seen), "rest": len(rest),
                    "seen_start": rate(start, seen), "seen_end": rate(end, seen), "rest_start": rate(start, rest), "rest_end": rate(end, rest),
                    "opening_start": opening(start), "opening_end": opening(end)})
    return out


def exposure_markdown(rows: list[dict]) -> str:
    """Seed means per learning rate and method."""
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = ["| lr | method | held-out questions whose fact it trained on | their correctness: start -> end | the other questions: start -> end "
             f"| greedy answers opening \"{TEACHER_OPENING}\": start -> end |",
             "|---|---|---:|---:|---:|---:|"]
    for lr, method in dict.fromkeys((r["lr"], r["method"]) for r in rows):
        mine = [r for r in rows if (r["lr"], r["method"]) == (lr, method)]
        m = {k: mean_sd([r[k] for r in mine])[0] for k in ("seen", "rest", "seen_start", "seen_end", "rest_start", "rest_end", "opening_start", "opening_end")}
        lines.append(f"| {lr} | `{method}` | {m['seen']:.1f} of {m['seen'] + m['rest']:.0f} | {f(m['seen_start'])} -> {f(m['seen_end'])} | "
                     f"{f(m['rest_start'])} -> {f(m['rest_end'])} | {f(m['opening_start'])} -> {f(m['opening_end'])} |")
    return "\n".join(lines) + "\n"


def report(lr: str, work: Path) -> None:
    """``gndpo report`` of one learning rate's comparison folder; some of its figures copied to the docs."""
    folder = work / f"lr-{lr}"
    run_timed(gndpo_cmd("-q", "report", str(folder), "--out", str(folder / "report")), work / f"report-{lr}.log")
    for name in REPORT_FIGURES:
        shutil.copyfile(folder / "report" / f"{name}.png", FIGURES / f"privileged_answer_lr-{lr}_{name}.png")


def main() -> None:
    args = arguments(__doc__.splitlines()[0], WORK, LEARNING_RATES)
    FIGURES.mkdir(parents=True, exist_ok=True)
    seconds = json.loads(OUT.with_suffix(".json").read_text()).get("seconds", {}) if OUT.with_suffix(".json").exists() else {}
    summaries = run_or_read(args, METHODS, TASK, LEARNING_RATES, SEEDS, ROUNDS, SHAPE, seconds)
    for lr in LEARNING_RATES:
        report(lr, args.work)
    rows = [row for lr, summary in summaries.items() for row in table_rows(lr, summary, METHODS, ROUNDS)]
    gain_rows = gains(summaries)
    exposure = [row for lr in LEARNING_RATES for row in fact_exposure(args.work, lr)]
    save_json(OUT.with_suffix(".json"), {"task": TASK, "methods": METHODS, "seeds": SEEDS, "rounds": ROUNDS, "shape": SHAPE,
                                         "machine": machine(), "date": time.strftime("%Y-%m-%d"), "seconds": seconds,
                                         "gains": gain_rows, "exposure": exposure, "rows": rows})
    OUT.with_suffix(".md").write_text(gains_markdown(gain_rows) + "\n" + exposure_markdown(exposure) + "\n" + markdown(rows, SCORE))
    figure(summaries, METHODS, ROUNDS, FIGURES / "privileged_answer.png",
           f"SmolLM2-135M-Instruct, privileged-answer self-distillation, {SEEDS} seeds (mean, band: lowest to highest)",
           f"{SCORE} (greedy, 50 questions)")
    print(gains_markdown(gain_rows))


if __name__ == "__main__":
    main()
