"""Divergence losses on the teacher's top-k, reward-weighted distillation, PACED (docs/reference/methods.md).

The loss term itself, D_t over the stored teacher top-k and the student's full softmax, is
:func:`gndpo.pipeline.methods.losses.topk_divergence`; here is what each method asks of it. ``method.topk_form``
picks how the k ids become distributions:

* ``bucket`` (default): each model gets k+1 buckets, its probabilities at the teacher's k ids plus one
  "rest" bucket with the remainder (1 - its top-k mass), and the divergence is exact on those buckets,
  nothing renormalized. Student mass outside the teacher's top-k shows up in the rest bucket and is
  paid for; the value lower-bounds the full-vocabulary divergence and equals it when k covers the
  vocabulary.
* ``renormalized``: the earlier form. Both models renormalized over the k ids (forward KL: only the
  teacher), so the student's tail outside the teacher's top-k is free; reverse KL and JSD can then be
  far below their full-vocabulary values.

* ``reverse_kl`` / ``forward_kl`` / ``jsd``: D_t on every sampled token, global token mean. With
  ``method.schedule`` (e.g. ``fkl:2,rkl:4``) the divergence changes by round.
* ``reward_beta`` > 0 (any method): response weights w_i = B softmax_i(r_i / reward_beta) over the
  whole batch; normalize provides B and logsumexp(r / reward_beta).
* ``paced``: forward KL rounds then reverse KL rounds (default schedule ``fkl:1,rkl:1000000``), each
  response weighted by w_x = p_x^a (1 - p_x)^b of its prompt's pass rate p_x this round; the
  ``method.paced.enabled`` knob applies the same weights to any other method.
"""

from __future__ import annotations

import numpy as np

from gndpo.errors import GndpoError
from gndpo.pipeline.methods.base import DIVERGENCES, TOPK, Method, Modifier, Response, Stats, Targets, no_statistics
from gndpo.pipeline.settings.schema import MethodConfig

SHORT_NAMES = {"fkl": "forward_kl", "rkl": "reverse_kl", "jsd": "jsd"}
PACED_DEFAULT_SCHEDULE = "fkl:1,rkl:1000000"


def parse_schedule(text: str) -> list[tuple[str, int]]:
    """``"fkl:2,rkl:4"`` -> [("forward_kl", 2), ("reverse_kl", 4)]; a user error if malformed."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, count = part.partition(":")
        kind = SHORT_NAMES.get(name.strip(), name.strip())
        if kind not in DIVERGENCES or not count.strip().isdigit() or int(count) < 1:
            raise GndpoError(f"method.schedule: bad entry {part!r}; expected e.g. 'fkl:2,rkl:4'")
        out.append((kind, int(count)))
    if not out:
        raise GndpoError("method.schedule is empty")
    return out


def scheduled_divergence(schedule: str, round_idx: int) -> str:
    """The divergence of round ``round_idx``; the last entry continues past the schedule's end."""
    start = 0
    entries = parse_schedule(schedule)
    for kind, count in entries:
        if round_idx < start + count:
            return kind
        start += count
    return entries[-1][0]


def _divergence_of(name: str):
    def choose(cfg: MethodConfig, round_idx: int) -> str:
        if cfg.schedule:
            return scheduled_divergence(cfg.schedule, round_idx)
        if name == "paced":
            return scheduled_divergence(PACED_DEFAULT_SCHEDULE, round_idx)
        return name

    return choose


def _divergence_targets(resp: Response, stats: Stats, cfg: MethodConfig, round_idx: int) -> Targets:
    return Targets.divergence(resp.mask)


# -- reward-weighted distillation ------------------------------------------------------------------
def _reward_weight_statistics(q, cfg: MethodConfig, round_idx):
    b = cfg.reward_beta
    return q.one(
        f"""
        WITH m AS (SELECT max(reward / {b}) AS top FROM responses)
        SELECT count(*) AS responses_weighted, any_value(m.top) + ln(sum(exp(reward / {b} - m.top))) AS reward_logsumexp
        FROM responses, m
        """
    ), {}


def reward_weight(reward: float, stats: Stats, beta: float) -> float:
    """w_i = B softmax_i(r_i / beta) = B exp(r_i / beta - logsumexp_j(r_j / beta))."""
    return stats["responses_weighted"] * float(np.exp(reward / beta - stats["reward_logsumexp"]))


def _apply_reward_weight(t: Targets, resp: Response, stats: Stats, cfg: MethodConfig, round_idx: int) -> Targets:
    t.weight *= reward_weight(resp.reward, stats, cfg.reward_beta)
    return t


# -- PACED ------------------------------------------------------------------------------------------
def _pass_rate_statistics(q, cfg: MethodConfig, round_idx):
    return {}, q.by_prompt("SELECT prompt_id, avg(reward) AS pass_rate FROM responses GROUP BY prompt_id")


def paced_weight(pass_rate: float, a: float, b: float) -> float:
    """Beta kernel w = p^a (1 - p)^b (a = b = 1: p (1 - p))."""
    return float(pass_rate**a * (1.0 - pass_rate) ** b)


def _apply_paced(t: Targets, resp: Response, stats: Stats, cfg: MethodConfig, round_idx: int) -> Targets:
    t.weight *= paced_weight(stats.group(resp.prompt_id)["pass_rate"], cfg.paced.a, cfg.paced.b)
    return t


METHODS = [
    Method(
        name, f"{name} on the teacher's top-k, every sampled token (section 3)", no_statistics, _divergence_targets,
        needs=frozenset({TOPK}), policy_loss="none", loss_agg="token-mean", divergence=_divergence_of(name),
    )
    for name in DIVERGENCES
] + [
    Method(
        "paced", "forward-then-reverse KL rounds, responses weighted by p(1-p) of their prompt (section 5)",
        no_statistics, _divergence_targets, needs=frozenset({TOPK}), policy_loss="none", loss_agg="token-mean",
        divergence=_divergence_of("paced"),
    )
]

MODIFIERS = [
    Modifier("reward_weight", "method.reward_beta > 0", lambda cfg: cfg.reward_beta > 0, _reward_weight_statistics, _apply_reward_weight,
             rewards_used="primary"),
    Modifier("paced", "method.paced.enabled", lambda cfg: cfg.paced.enabled or cfg.name == "paced", _pass_rate_statistics, _apply_paced,
             rewards_used="primary"),
]
