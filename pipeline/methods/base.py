"""What every method is made of, and the data it sees.

A method (docs/reference/methods.md) is three things, declared together in one module of this package:

* ``needs``: the optional per-token columns the score stage must store for it (teacher top-k ids and
  log-probs, teacher / student entropy, full-vocabulary KL(p_S || p_T));
* ``statistics``: the batch statistics it asks the normalize stage for, as DuckDB queries over the
  round's committed shards (global over every worker and data-parallel rank);
* ``targets``: per response, what train optimizes: the policy-gradient advantage and the tokens it
  applies to, the weight of a divergence term per token, the tokens in the loss denominator, and a
  response weight.

Train turns targets into one loss (:mod:`gndpo.pipeline.methods.losses`):
``L_t = pg_mask_t * L_pg(A_t) + div_t * D_t``, times the response weight, aggregated over ``mask``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from gndpo.errors import GndpoError
from gndpo.pipeline.settings.schema import MethodConfig

# The policy losses, aggregations and top-k forms the loss functions (:mod:`gndpo.pipeline.methods.losses`)
# understand are the choices of method.policy_loss, method.loss_agg and method.topk_form in the schema.
# Reward-weighted distillation's own aggregation, whatever loss_agg says (chosen by policy_settings).
WEIGHTED_SEQ_MEAN = "weighted-seq-mean"

# Optional score columns (per token, one list per response).
TOPK = "teacher_topk"  # teacher_topk_ids + teacher_topk_logprobs
TEACHER_ENTROPY = "teacher_entropy"
STUDENT_ENTROPY = "student_entropy"
TOKEN_KL = "token_kl"  # full-vocabulary KL(p_S || p_T) at each position
SCORE_EXTRAS = (TOPK, TEACHER_ENTROPY, STUDENT_ENTROPY, TOKEN_KL)

DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")


@dataclass
class Response:
    """One response as train sees it: rollout row joined with its score row (numpy, float64)."""

    rollout_id: str
    prompt_id: str
    mask: np.ndarray  # rollout loss mask: 1 = a token the student sampled
    teacher_lp: np.ndarray
    student_lp: np.ndarray  # recomputed by the training engine's forward ("old log-probs")
    sampler_lp: np.ndarray  # what vLLM reported while sampling
    rewards: dict  # every registered reward, by name
    reward: float  # the run's primary reward
    prefix: np.ndarray  # 1 = a token written by the teacher (off-policy guidance)
    teacher_entropy: np.ndarray | None = None
    student_entropy: np.ndarray | None = None
    token_kl: np.ndarray | None = None
    teacher: str = ""  # the teacher (or mix) that scored it, as score recorded

    @property
    def log_ratio(self) -> np.ndarray:
        """lpT_t - lpS_t, unclamped."""
        return self.teacher_lp - self.student_lp


@dataclass
class Targets:
    """What train optimizes for one response (arrays of the response's length)."""

    adv: np.ndarray  # policy-gradient advantage A_t
    pg_mask: np.ndarray  # tokens with a policy-gradient term (also the GSPO sequence ratio's tokens)
    div: np.ndarray  # weight of the divergence term D_t per token (0 = none)
    mask: np.ndarray  # tokens in the loss denominator
    weight: float = 1.0  # response weight (PACED, reward-weighted distillation)

    @staticmethod
    def policy_gradient(adv: np.ndarray, mask: np.ndarray) -> "Targets":
        return Targets(adv=adv * mask, pg_mask=mask.copy(), div=np.zeros_like(mask), mask=mask.copy())

    @staticmethod
    def divergence(mask: np.ndarray) -> "Targets":
        return Targets(adv=np.zeros_like(mask), pg_mask=np.zeros_like(mask), div=mask.copy(), mask=mask.copy())


TEACHER_SCOPE = "teacher:"  # normalize's scope prefix for per-teacher statistics


@dataclass
class Stats:
    """The round's committed statistics: round-wide {name: value} (normalize's scope "global") and per scope
    (a prompt_id, or a teacher) {scope: {name: value}}."""

    round_wide: dict = field(default_factory=dict)  # scope "global": over every valid token of the round
    groups: dict = field(default_factory=dict)

    def __getitem__(self, name: str) -> float:
        if name not in self.round_wide:
            raise GndpoError(f"statistic {name!r} is missing from the round's normalize output")
        return self.round_wide[name]

    def group(self, prompt_id: str) -> dict:
        return self.groups.get(prompt_id, {})

    def of_teacher(self, teacher: str) -> "Stats":
        """The statistics normalize computed over one teacher's tokens (``method.stats_scope: teacher``;
        stored under the scope ``teacher:<name>``), as a Stats whose global values are that teacher's."""
        scope = f"{TEACHER_SCOPE}{teacher}"
        if scope not in self.groups:
            raise GndpoError(f"the round's normalize output has no statistics for teacher {teacher!r}")
        return Stats(dict(self.groups[scope]), self.groups)


@dataclass(frozen=True)
class Method:
    """One training method: its name and one-line summary, the statistics it needs over a round's
    shards (SQL through :class:`StatsQuery`), how it turns them into per-token targets, and which
    stored values and settings it needs (checked at init)."""

    name: str
    summary: str
    # (StatsQuery, method config, round) -> (global stats, {prompt_id: stats})
    statistics: Callable
    # (Response, Stats, method config, round) -> Targets
    targets: Callable
    needs: frozenset = frozenset()
    policy_loss: str = "gspo"  # default when the config leaves it empty; "none" = no PG term
    loss_agg: str = "seq-mean-token-mean"
    old_logprobs: str = "student"  # "sampler": ratios against vLLM's log-probs (Tinker)
    # (method config, round) -> divergence for the div term (forward KL unless the method chooses)
    divergence: Callable = lambda cfg, round_idx: "forward_kl"
    # The rewards its targets use: "outcome" (method.outcome.rewards), "primary" (the run's reward) or "".
    rewards_used: str = ""


def no_statistics(q, cfg: MethodConfig, round_idx) -> tuple[dict, dict]:
    return {}, {}


class StatsQuery:
    """DuckDB over the round's committed shards, as the views normalize creates:

    * ``responses``: one row per response: rollout_id, prompt_id, reward, rewards (map), n_valid,
      c_sum, c_sq_sum (score's partial sums);
    * ``tokens``: one row per VALID token (loss mask 1): rollout_id, prompt_id, t (position in the
      response), lpT, lpS, hT, hS, kl (NULL where score did not store the column).
    """

    def __init__(self, con):
        self.con = con

    def one(self, sql: str, parameters: dict | None = None) -> dict:
        """{column: value} of a one-row query (``parameters``: its ``$name`` values)."""
        rel = self.con.sql(sql, params=parameters)
        row = rel.fetchall()[0]
        return {k: (float(v) if v is not None else None) for k, v in zip(rel.columns, row)}

    def by_prompt(self, sql: str) -> dict:
        """{prompt_id: {column: value}} from a query whose first column is prompt_id."""
        rel = self.con.sql(sql)
        cols = rel.columns[1:]
        return {row[0]: {k: (float(v) if v is not None else None) for k, v in zip(cols, row[1:])} for row in rel.fetchall()}

    def quantile(self, expression: str, q: float, source: str = "tokens") -> float | None:
        """DuckDB's ``quantile_cont(expression, q)`` over ``source``'s non-null values, the same value
        bit for bit, in memory that does not grow with the rows: ``quantile_cont`` holds every value
        (16 GiB at a billion tokens), this selects the two order statistics it interpolates between by
        narrowing a value range, a scan per step (:func:`order_statistics`). None over no values."""
        values = f"SELECT ({expression}) AS v FROM {source}"
        n, low, high, typ = self.con.execute(f"SELECT count(v), min(v), max(v), any_value(typeof(v)) FROM ({values})").fetchall()[0]
        if not n:
            return None
        rank = (n - 1) * q  # DuckDB's: between the values of ranks floor(RN) and ceil(RN), RN = (n - 1) q
        below = math.floor(rank)
        first, second = order_statistics(self.con, values, below, n, low, high)
        if rank == below:
            return float(first)
        # DuckDB interpolates the two itself, so the value is its own to the last bit: over two values,
        # quantile_cont at the fraction d has RN = d.
        return float(self.con.execute(f"SELECT quantile_cont(x, $d) FROM (SELECT unnest([$first::{typ}, $second::{typ}]) AS x)",
                                      {"d": rank - below, "first": first, "second": second}).fetchall()[0][0])


RANGE_BUCKETS = 4096  # value buckets per scan
FETCHED_VALUES = 1 << 20  # a range with at most this many values is fetched and sorted


def order_statistics(con, values: str, k: int, count: int, low: float, high: float) -> tuple[float, float | None]:
    """The k-th and (k+1)-th smallest (0-based; None past the last) of the ``count`` non-null values
    of ``values``' column ``v``, whose minimum and maximum are ``low`` and ``high``. Each scan counts
    the values in ``RANGE_BUCKETS`` equal slices of the current range (a grouped count: bounded
    memory) and keeps the slice holding the k-th, with its count and the smallest value after it; a
    range of one value ends it, and one of at most ``FETCHED_VALUES`` values is fetched and sorted.
    A value's slice is a monotone function of it, so a slice is exactly the values between its
    minimum and maximum."""
    after = None  # the smallest value above the current range
    inside = f"SELECT v FROM ({values}) WHERE v BETWEEN $low AND $high"
    while count > FETCHED_VALUES and low != high:
        slices = con.execute(
            f"SELECT least(floor((v::DOUBLE - $low) / ($high - $low) * {RANGE_BUCKETS}), {RANGE_BUCKETS - 1}) AS b, "
            f"count(*), min(v), max(v) FROM ({inside}) GROUP BY b ORDER BY b", {"low": low, "high": high}
        ).fetchall()
        for i, (_, in_slice, smallest, largest) in enumerate(slices):
            if k < in_slice:
                after = slices[i + 1][2] if i + 1 < len(slices) else after
                count, low, high = in_slice, smallest, largest
                break
            k -= in_slice
    if low == high:
        return low, low if k + 1 < count else after
    fetched = np.sort(con.execute(inside, {"low": low, "high": high}).fetchnumpy()["v"])
    return fetched[k].item(), fetched[k + 1].item() if k + 1 < len(fetched) else after


def merge_groups(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        for pid, values in part.items():
            out.setdefault(pid, {}).update(values)
    return out


@dataclass(frozen=True)
class Modifier:
    """A knob that changes any method's targets (token selection, response weights, outcome mixing)."""

    name: str
    knob: str  # the config setting that turns it on, as users write it
    enabled: Callable  # (method config) -> bool
    statistics: Callable  # like Method.statistics
    apply: Callable  # (Targets, Response, Stats, method config, round) -> Targets
    needs: frozenset = frozenset()
    rewards_used: str = ""  # as Method's
