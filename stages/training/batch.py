"""Train's batch join: this rank's share of the round, with the method's targets, as numpy arrays.

Every rank reads the round's rollout ids (one short string per response), shuffles them with the
round's seed and cuts them into ``train.optimizer_steps`` mini-batches; rank r takes every world-th
response of each mini-batch. Only then are the heavy columns (token ids, log-probs, the teacher's
top-k) read, for this rank's rows only, straight from Arrow buffers into numpy views: no per-token
Python objects, whatever the response length or k. The method's targets (advantage, policy-gradient
mask, divergence weight, loss mask, response weight) come from the committed round statistics.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gndpo.errors import GndpoError
from gndpo.pipeline.methods import Response, get_method, response_targets, score_needs
from gndpo.pipeline.methods.base import TOPK
from gndpo.pipeline.run.run import Run
from gndpo.pipeline.run.stats import round_stats
from gndpo.storage.records import manifest_files, rollout_shards
from gndpo.storage.shards import flat_values, read_shards

ROLLOUT_COLUMNS = ["rollout_id", "prompt_id", "prompt_token_ids", "response_token_ids", "loss_mask", "sampler_logprobs",
                   "reward", "rewards", "teacher_prefix_len", "finish_reason"]
SCORE_COLUMNS = ["rollout_id", "teacher", "teacher_logprobs", "student_logprobs", "teacher_entropy", "student_entropy", "token_kl",
                 "aligned"]


@dataclass
class TrainRow:
    """One response as train sees it; every per-token field is a numpy view of length n (or [n, k])."""

    rollout_id: str
    prompt: np.ndarray
    response: np.ndarray
    old_logp: np.ndarray
    adv: np.ndarray
    pg_mask: np.ndarray
    div: np.ndarray
    mask: np.ndarray
    weight: float
    topk_ids: np.ndarray | None = None
    topk_logp: np.ndarray | None = None
    # log of the teacher's mass outside its top-k, per token; None where score did not store it (shards
    # written before it did: the loss then recomputes it from the top-k).
    topk_rest: np.ndarray | None = None
    prompt_id: str = ""  # which prompt's images the forward shows (a vision-language run)
    teacher: str = ""  # the teacher that scored the row, as score recorded it (its top-k's vocabulary)

    @property
    def tokens(self) -> int:
        """Padded-batch cost of this row: prompt + response tokens."""
        return len(self.prompt) + len(self.response)


@dataclass
class RoundShare:
    """The round's mini-batches as this rank sees them: ``steps[i]`` are this rank's rows of step i,
    ``step_sizes[i]`` the number of responses of step i over all ranks."""

    steps: list[list[TrainRow]]
    step_sizes: list[int]


def topk_columns(available: list[str]) -> list[str]:
    """The score columns a top-k method reads: the teacher's ids and log-probs, and its rest log-prob
    where the shards have it (older ones do not)."""
    return ["teacher_topk_ids", "teacher_topk_logprobs"] + (["teacher_rest_logprob"] if "teacher_rest_logprob" in available else [])


def step_order(rollout_ids: list[str], seed: int, round_idx: int, optimizer_steps: int) -> list[list[str]]:
    """The round's mini-batches of rollout ids: a seeded shuffle of the rollout manifest's order (by
    round, never by attempt or rank count, so a retried train and any world size take the same steps)
    cut into equal parts."""
    order = list(rollout_ids)
    random.Random(f"{seed}:{round_idx}").shuffle(order)
    steps = max(1, min(optimizer_steps, len(order)))
    size = math.ceil(len(order) / steps)
    return [order[i : i + size] for i in range(0, len(order), size)]


def load_share(run: Run, round_idx: int, rank: int, world: int) -> RoundShare:
    cfg = run.cfg
    method_cfg = cfg.method
    needs_topk = TOPK in score_needs(method_cfg)
    rollout_files = rollout_shards(run.records(round_idx, "rollout").require_manifest())
    score_files = manifest_files(run.records(round_idx, "score").require_manifest())
    rollouts = read_shards(run.fs, rollout_files).select(ROLLOUT_COLUMNS)
    scores = read_shards(run.fs, score_files)
    scores = scores.select(SCORE_COLUMNS + (topk_columns(scores.column_names) if needs_topk else []))
    all_ids = rollouts.column("rollout_id").to_pylist()
    if len(set(all_ids)) != len(all_ids) or scores.num_rows != len(all_ids):
        raise GndpoError(f"round {round_idx}: {scores.num_rows} score rows for {len(all_ids)} rollouts")
    if cfg.rollout.truncated != "keep":
        # mask and drop: a response cut at max_tokens has no loss and does not count in the step's
        # normalizers (drop also kept it out of normalize's statistics).
        cut = pc.fill_null(pc.equal(rollouts.column("finish_reason"), "length"), False)
        rollouts = rollouts.filter(pc.invert(cut))
        all_ids = rollouts.column("rollout_id").to_pylist()
        if not all_ids:
            raise GndpoError(
                f"round {round_idx}: every response was cut at rollout.max_tokens and rollout.truncated is "
                f"{cfg.rollout.truncated}: nothing to train on (raise rollout.max_tokens, or use truncated: keep)"
            )
    steps = step_order(all_ids, cfg.train.seed, round_idx, cfg.train.optimizer_steps)
    mine = [ids[rank::world] for ids in steps]
    wanted = pa.array([rid for ids in mine for rid in ids], pa.string())
    rollouts = rollouts.filter(pc.is_in(rollouts.column("rollout_id"), value_set=wanted))
    scores = scores.filter(pc.is_in(scores.column("rollout_id"), value_set=wanted))
    rows = _join(rollouts, scores, run, round_idx, needs_topk)
    return RoundShare(steps=[[rows[rid] for rid in ids] for ids in mine], step_sizes=[len(ids) for ids in steps])


def _join(rollouts: pa.Table, scores: pa.Table, run: Run, round_idx: int, needs_topk: bool) -> dict[str, TrainRow]:
    """Rows by rollout id, each with the method's targets."""
    method_cfg = run.cfg.method
    method = get_method(method_cfg.name)
    stats = round_stats(run, round_idx)
    score_row = {rid: i for i, rid in enumerate(scores.column("rollout_id").to_pylist())}
    teachers = scores.column("teacher").to_pylist()
    r = {name: flat_values(rollouts.column(name)) for name in ("prompt_token_ids", "response_token_ids", "loss_mask", "sampler_logprobs")}
    optional = ["teacher_entropy", "student_entropy", "token_kl"] + (topk_columns(scores.column_names) if needs_topk else [])
    s = {name: flat_values(scores.column(name)) for name in ["teacher_logprobs", "student_logprobs"] + optional}
    present = {name for name in optional if scores.column(name).null_count < scores.num_rows}
    cross = run.cfg.score.cross_tokenizer
    if cross:  # student tokens the teacher's tokens did not cover exactly get no loss
        s["aligned"] = flat_values(scores.column("aligned"))
    if needs_topk and "teacher_topk_ids" not in present and scores.num_rows:
        raise GndpoError(f"score rows of round {round_idx} have no teacher top-k, which method {method_cfg.name} needs")

    def view(columns, name, i, dtype=np.float64):
        values, offsets = columns[name]
        return values[offsets[i] : offsets[i + 1]].astype(dtype, copy=False)

    out = {}
    meta = rollouts.select(["rollout_id", "prompt_id", "reward", "rewards", "teacher_prefix_len"]).to_pylist()
    for i, m in enumerate(meta):
        j = score_row.get(m["rollout_id"])
        if j is None:
            raise GndpoError(f"rollout {m['rollout_id']} of round {round_idx} has no score row")
        n = len(view(r, "response_token_ids", i, np.int64))
        prefix = np.zeros(n)
        prefix[: m["teacher_prefix_len"] or 0] = 1.0
        resp = Response(
            rollout_id=m["rollout_id"], prompt_id=m["prompt_id"],
            mask=view(r, "loss_mask", i) * (view(s, "aligned", j) if cross else 1.0),
            teacher_lp=view(s, "teacher_logprobs", j), student_lp=view(s, "student_logprobs", j),
            sampler_lp=view(r, "sampler_logprobs", i), rewards=dict(m["rewards"] or {}), reward=m["reward"], prefix=prefix,
            **{name: (view(s, name, j) if name in present else None) for name in ("teacher_entropy", "student_entropy", "token_kl")},
            teacher=teachers[j] or "",
        )
        t = response_targets(resp, stats, method_cfg, round_idx)
        out[m["rollout_id"]] = TrainRow(
            rollout_id=m["rollout_id"],
            prompt=view(r, "prompt_token_ids", i, np.int64), response=view(r, "response_token_ids", i, np.int64),
            old_logp=resp.sampler_lp if method.old_logprobs == "sampler" else resp.student_lp,
            adv=t.adv, pg_mask=t.pg_mask, div=t.div, mask=t.mask, weight=t.weight, prompt_id=m["prompt_id"], teacher=resp.teacher,
            topk_ids=view(s, "teacher_topk_ids", j, np.int64) if needs_topk else None,
            topk_logp=view(s, "teacher_topk_logprobs", j) if needs_topk else None,
            topk_rest=rest if "teacher_rest_logprob" in present and len(rest := view(s, "teacher_rest_logprob", j)) == n else None,
        )
    return out
