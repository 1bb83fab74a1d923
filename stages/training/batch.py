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
    """Rank ``rank``'s share of round ``round_idx``: the round's responses (less those
    ``rollout.truncated`` keeps out) in ``train.optimizer_steps`` steps, shuffled by the train seed,
    each step's rows split across the ``world`` ranks, joined with their scores and targets."""
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


class ListColumns:
    """A table's list columns, each flattened once into one array and its row offsets, so a row's list
    is a slice (no Python list per row)."""

    def __init__(self, table: pa.Table, names: list[str]):
        self.columns = {name: flat_values(table.column(name)) for name in names}

    def row(self, name: str, i: int, dtype=np.float64) -> np.ndarray:
        values, offsets = self.columns[name]
        return values[offsets[i] : offsets[i + 1]].astype(dtype, copy=False)


ROLLOUT_LISTS = ["prompt_token_ids", "response_token_ids", "loss_mask", "sampler_logprobs"]
OPTIONAL_SCORES = ("teacher_entropy", "student_entropy", "token_kl")


def _join(rollouts: pa.Table, scores: pa.Table, run: Run, round_idx: int, needs_topk: bool) -> dict[str, TrainRow]:
    """Train rows by rollout id: each rollout joined with its score row, with the method's targets."""
    method_cfg = run.cfg.method
    stats = round_stats(run, round_idx)
    score_row_of = {rid: i for i, rid in enumerate(scores.column("rollout_id").to_pylist())}
    optional = [*OPTIONAL_SCORES, *(topk_columns(scores.column_names) if needs_topk else [])]
    rollout_lists = ListColumns(rollouts, ROLLOUT_LISTS)
    cross = run.cfg.score.cross_tokenizer  # student tokens the teacher's tokens did not cover exactly get no loss
    score_lists = ListColumns(scores, ["teacher_logprobs", "student_logprobs", *optional, *(["aligned"] if cross else [])])
    stored = {name for name in optional if scores.column(name).null_count < scores.num_rows}
    if needs_topk and "teacher_topk_ids" not in stored and scores.num_rows:
        raise GndpoError(f"score rows of round {round_idx} have no teacher top-k, which method {method_cfg.name} needs")
    teachers = scores.column("teacher").to_pylist()
    old_logprobs = get_method(method_cfg.name).old_logprobs
    rows = {}
    for i, meta in enumerate(rollouts.select(["rollout_id", "prompt_id", "reward", "rewards", "teacher_prefix_len"]).to_pylist()):
        j = score_row_of.get(meta["rollout_id"])
        if j is None:
            raise GndpoError(f"rollout {meta['rollout_id']} of round {round_idx} has no score row")
        response_ids = rollout_lists.row("response_token_ids", i, np.int64)
        response = Response(
            rollout_id=meta["rollout_id"], prompt_id=meta["prompt_id"],
            mask=rollout_lists.row("loss_mask", i) * (score_lists.row("aligned", j) if cross else 1.0),
            teacher_lp=score_lists.row("teacher_logprobs", j), student_lp=score_lists.row("student_logprobs", j),
            sampler_lp=rollout_lists.row("sampler_logprobs", i), rewards=dict(meta["rewards"] or {}), reward=meta["reward"],
            prefix=teacher_prefix(len(response_ids), meta["teacher_prefix_len"]),
            **{name: (score_lists.row(name, j) if name in stored else None) for name in OPTIONAL_SCORES},
            teacher=teachers[j] or "",
        )
        targets = response_targets(response, stats, method_cfg, round_idx)
        rows[meta["rollout_id"]] = TrainRow(
            rollout_id=response.rollout_id,
            prompt=rollout_lists.row("prompt_token_ids", i, np.int64), response=response_ids,
            old_logp=response.sampler_lp if old_logprobs == "sampler" else response.student_lp,
            adv=targets.adv, pg_mask=targets.pg_mask, div=targets.div, mask=targets.mask, weight=targets.weight,
            prompt_id=response.prompt_id, teacher=response.teacher,
            topk_ids=score_lists.row("teacher_topk_ids", j, np.int64) if needs_topk else None,
            topk_logp=score_lists.row("teacher_topk_logprobs", j) if needs_topk else None,
            topk_rest=stored_rest(score_lists, j, len(response.mask)) if "teacher_rest_logprob" in stored else None,
        )
    return rows


def teacher_prefix(length: int, prefix_len: int | None) -> np.ndarray:
    """[length] 1.0 on the response's first ``prefix_len`` tokens (a teacher-written guided prefix)."""
    prefix = np.zeros(length)
    prefix[: prefix_len or 0] = 1.0
    return prefix


def stored_rest(score_lists: ListColumns, j: int, length: int) -> np.ndarray | None:
    """Score row ``j``'s stored teacher rest log-probs, or None where the row has none per token (the
    loss then recomputes the rest from the top-k)."""
    rest = score_lists.row("teacher_rest_logprob", j)
    return rest if len(rest) == length else None
