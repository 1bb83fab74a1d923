"""Score and train tokens/s of a SmolLM2 gndpo round against plain transformers on the same batches.

Reads the committed round 0 of the run ``round_vs_trl.py --workload smollm2`` leaves (its rollouts:
prompt and response token ids; its score shards: the teacher's top-16) and its stage metrics
(``gndpo sql RUN "select stage, tokens, seconds, tokens_per_s from metrics"``): score's and train's
response tokens and seconds. Score's seconds are its work units' compute (model loading is the stage's
set-up, outside them; reading and writing shards inside); train's are its one unit's: the DeepSpeed
engine build, the optimizer steps, the export, the engine probe and the optimizer state.

Then, in this process (2 CPU threads, as the stages use), on the same sequences in the same batches:

* **score, plain**: the student's and the teacher's forward (``no_grad``, ``model(ids).logits`` over
  every position, ``log_softmax`` over the vocabulary, a gather of the sampled tokens, the teacher's
  top-16), batched as score batches (its ``token_budget_batches`` over each work unit, with
  ``score.max_tokens_per_batch`` and ``score.rows_per_chunk``);
* **score, gndpo's kernel**: ``gndpo.stages.models.logprobs.pair_token_stats`` on the same batches with the
  stage's arguments (top-16, both entropies for the round's metrics): the stage without its I/O;
* **train, plain**: on a copy of the student, the forward over every position, ``log_softmax``, and
  the reverse KL of the teacher's top-16 buckets plus the rest of the vocabulary against the stored
  teacher columns, then backward, gradient clipping and an AdamW step per optimizer step;
* **train, gndpo's kernel**: on another copy, train's own loss (``Objective.micro_batch_loss``: the
  output layer on response positions only, chunked and recomputed in backward) with the same backward,
  clipping and AdamW, outside DeepSpeed.

Both train sides run train's own mini-batches and micro-batches (``schedule_steps``), and their
step losses must equal the stage's. Plain and kernel take turns batch by batch (micro-batch by
micro-batch in train), so a machine shared with other jobs slows both alike; the stage's figures come
from another time and share no such protection. CPU seconds (this process) are reported beside wall
seconds. Tokens/s are response (loss) tokens per second everywhere; a ratio is plain seconds / gndpo
seconds on the same tokens (above 1: gndpo is faster). Writes the ``throughput`` entry of
``results/smollm2.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, gndpo_cmd, save_json  # noqa: E402

DEFAULT_RUN = "/tmp/gndpo-bench/round_vs_trl/smollm2/gndpo/run"


def stage_metrics(run: str) -> dict:
    """{stage: {tokens, seconds, tokens_per_s}} of round 0, through ``gndpo sql``."""
    out = subprocess.run(gndpo_cmd("sql", run, "select stage, tokens, seconds, tokens_per_s from metrics where round = 0",
                                   "--format", "json"), check=True, capture_output=True, text=True).stdout
    return {r["stage"]: {k: r[k] for k in ("tokens", "seconds", "tokens_per_s")} for r in json.loads(out)}


def rollout_units(run) -> list:
    """Round 0's rollout tables, one per score work unit (the units score reads)."""
    import pyarrow as pa

    from gndpo.stages.score import ScoreJob
    from gndpo.storage.shards import read_shard

    job = ScoreJob(run, 0)
    units, _ = job.plan()
    return [pa.concat_tables([read_shard(run.fs, f) for f in job.rollout_files(u)]) for u in units]


def score_batches(table, cfg, pad_id: int) -> list:
    """The unit's batches as score forms them: (TokenBatch, response tokens)."""
    from gndpo.stages.models.batches import make_batch, token_budget_batches

    prompts = table.column("prompt_token_ids").to_pylist()
    responses = table.column("response_token_ids").to_pylist()
    spans = np.array([len(p) + len(r) for p, r in zip(prompts, responses)])
    out = []
    for rows in token_budget_batches(spans, cfg.score.max_tokens_per_batch, cfg.score.rows_per_chunk):
        batch = make_batch([prompts[i] for i in rows], [responses[i] for i in rows], pad_id, torch.device("cpu"))
        out.append(batch)
    return out


def plain_logprobs(model, batch) -> torch.Tensor:
    """[N, V] log-probs at the response positions, the plain way: logits over every position."""
    logits = model(input_ids=batch.ids, attention_mask=batch.attention_mask, use_cache=False).logits
    return torch.log_softmax(logits.float(), dim=-1)[batch.rows, batch.cols]


class Clock:
    """Wall and CPU seconds (this process, all threads) summed over the timed sections."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def __enter__(self):
        self._t = (time.perf_counter(), time.process_time())
        return self

    def __exit__(self, *exc):
        self.wall += time.perf_counter() - self._t[0]
        self.cpu += time.process_time() - self._t[1]

    def report(self, tokens: int) -> dict:
        return {"seconds": round(self.wall, 2), "cpu_s": round(self.cpu, 2), "tokens_per_s": round(tokens / self.wall, 1)}


@torch.no_grad()
def plain_score(student, teacher, batch, topk: int) -> None:
    targets = batch.targets.unsqueeze(-1)
    plain_logprobs(student, batch).gather(-1, targets)
    t_all = plain_logprobs(teacher, batch)
    t_all.gather(-1, targets)
    t_all.topk(topk, dim=-1)


@torch.no_grad()
def gndpo_score(student, teacher, batch, chunk: int, cfg, topk: int) -> None:
    from gndpo.stages.models.logprobs import pair_token_stats

    # The stage's call: top-k, and both entropies for the round's metrics (logging.entropy_metrics).
    pair_token_stats(teacher, student, batch, chunk, cfg.rollout.temperature, topk, (True, True), False)


def plain_micro_loss(student, micro, pad_id: int, n_tokens: float) -> torch.Tensor:
    """The plain reverse KL over the teacher's top-k buckets and the rest of the vocabulary, on the
    stored teacher columns, summed over the micro-batch's loss tokens / the step's loss tokens."""
    from gndpo.stages.models.batches import make_batch

    batch = make_batch([r.prompt for r in micro], [r.response for r in micro], pad_id, torch.device("cpu"))
    s_all = plain_logprobs(student, batch)  # [N, V]
    t_ids = torch.from_numpy(np.concatenate([r.topk_ids for r in micro])).long()
    t_lp = torch.from_numpy(np.concatenate([r.topk_logp for r in micro])).float()
    t_rest = torch.from_numpy(np.concatenate([r.topk_rest for r in micro])).float()
    mask = torch.from_numpy(np.concatenate([r.mask for r in micro])).float()
    s_lp = s_all.gather(-1, t_ids)
    s_rest = torch.log1p(-s_lp.exp().sum(-1).clamp(max=1 - 1e-6))
    per_token = (s_lp.exp() * (s_lp - t_lp)).sum(-1) + s_rest.exp() * (s_rest - t_rest)
    return (per_token * mask).sum() / max(n_tokens, 1.0)


def train_objective(run, pad_id: int):
    """train's own loss on a plain module, outside DeepSpeed: the Objective ``prepare_round`` builds."""
    from gndpo.stages.train import Objective

    return Objective.of(run.cfg, 0, pad_id, torch.device("cpu"))


def compare_train(plain_student, gndpo_student, run, pad_id: int) -> dict:
    """Train's optimizer steps twice, on two copies of the student, micro-batch by micro-batch in turn:
    the plain loss (full logits) and train's own (``Objective.micro_batch_loss``: chunked output layer
    on response positions, recomputed in backward), each with backward, clipping and AdamW."""
    from gndpo.stages.models.logprobs import logits_chunk
    from gndpo.stages.train import TrainJob, schedule_steps
    from gndpo.stages.training.batch import load_share

    tc = run.cfg.train
    objective = train_objective(run, pad_id)
    share = load_share(TrainJob(run, 0).inputs, 0, 1)
    steps = schedule_steps(share, tc, logits_chunk(gndpo_student, run.cfg.model))
    sides = {"plain": (plain_student, Clock(), []), "gndpo_kernel": (gndpo_student, Clock(), [])}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=tc.lr, weight_decay=tc.weight_decay) for name, (m, _, _) in sides.items()}
    tokens = 0
    for i, step in enumerate(steps):
        totals = dict.fromkeys(sides, 0.0)
        rows = share.rows(i)
        for j, micro in enumerate([rows[k] for k in idx] for idx in step.micros):
            for name, (model, clock, _) in sides.items():
                with clock:
                    if name == "plain":
                        loss = plain_micro_loss(model, micro, pad_id, step.n_tokens)
                    else:
                        loss, _ = objective.micro_batch_loss(model, micro, step.chunks[j], step.n_seqs, step.n_tokens, step.weight_sum)
                    loss.backward()
                totals[name] += float(loss.detach())
        for name, (model, clock, losses) in sides.items():
            with clock:
                if tc.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
                opts[name].step()
                opts[name].zero_grad(set_to_none=True)
            losses.append(totals[name])
        tokens += step.n_tokens
    return {"tokens": tokens, **{name: {**clock.report(tokens), "step_losses": losses} for name, (_, clock, losses) in sides.items()}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=DEFAULT_RUN, help="the gndpo run round_vs_trl.py --workload smollm2 leaves")
    a = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from gndpo.pipeline.run.run import open_run
    from gndpo.stages.models.device import set_cpu_threads
    from gndpo.stages.models.loading import load_tokenizer
    from gndpo.stages.models.logprobs import logits_chunk

    set_cpu_threads()
    run = open_run(a.run)
    cfg = run.cfg
    stages = stage_metrics(a.run)
    pad_id = load_tokenizer(cfg.student).pad_token_id or 0
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # noqa: E731
    student, teacher = load(cfg.student), load(cfg.teacher)
    tables = rollout_units(run)
    batches = [b for t in tables for b in score_batches(t, cfg, pad_id)]
    score_tokens = int(sum(b.n_tokens for b in batches))
    topk = cfg.score.teacher_topk
    chunk = logits_chunk([student, teacher], cfg.model)
    plain_score(student, teacher, batches[-1], topk)  # warm-up on the smallest batch, not counted
    clocks = {"plain": Clock(), "gndpo_kernel": Clock()}
    for batch in batches:  # in turn, batch by batch, so a busy machine slows both alike
        with clocks["plain"]:
            plain_score(student, teacher, batch, topk)
        with clocks["gndpo_kernel"]:
            gndpo_score(student, teacher, batch, chunk, cfg, topk)
    del teacher
    gndpo_student = copy.deepcopy(student).train()
    train = compare_train(student.train(), gndpo_student, run, pad_id)

    sc, tr = stages["score"], stages["train"]
    plain_s, kernel_s, plain_t, kernel_t = clocks["plain"].wall, clocks["gndpo_kernel"].wall, train["plain"]["seconds"], train["gndpo_kernel"]["seconds"]
    result = {
        "run": a.run,
        "threads": torch.get_num_threads(),
        "score_batches": [list(b.ids.shape) for b in batches],
        "score": {
            "tokens": score_tokens,
            "gndpo_stage": {"seconds": round(sc["seconds"], 2), "tokens_per_s": round(sc["tokens_per_s"], 1)},
            "gndpo_kernel": clocks["gndpo_kernel"].report(score_tokens),
            "plain": clocks["plain"].report(score_tokens),
            "stage_vs_plain": round(plain_s / sc["seconds"], 2),
            "kernel_vs_plain": round(plain_s / kernel_s, 2),
        },
        "train": {
            "tokens": train["tokens"],
            "gndpo_stage": {"seconds": round(tr["seconds"], 2), "tokens_per_s": round(tr["tokens_per_s"], 1)},
            "gndpo_kernel": train["gndpo_kernel"],
            "plain": train["plain"],
            "stage_vs_plain": round(plain_t / tr["seconds"], 2),
            "kernel_vs_plain": round(plain_t / kernel_t, 2),
        },
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    print(json.dumps(result), flush=True)
    path = RESULTS / "smollm2.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    save_json(path, {**previous, "throughput": result})
    return result


if __name__ == "__main__":
    main()
