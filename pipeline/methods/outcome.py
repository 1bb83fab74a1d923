"""Outcome-reward methods (docs/reference/methods.md: grpo and gdpo): GRPO, GDPO, and mixing an outcome advantage into
distillation. Rewards are the named functions of :mod:`gndpo.pipeline.tasks.rewards`; rollout stores every
registered reward per response, ``method.outcome.rewards`` picks the ones used and ``weights`` their
weights. Normalize computes the per-prompt group statistics (scope = prompt_id) and GDPO's batch
statistics of A_pre with DuckDB window functions.

GRPO: r_i = sum_k w_k R_k,i (the weighted rewards summed first, as TRL does), then
A_i = (r_i - mean_g) / (std_g + 1e-6), unbiased std; a singleton group gives mean 0, std 1. The outcome
mix uses the same A_i.
GDPO: A_k,i = (R_k,i - mean_g) / (std_g + 1e-4) (NaN -> 0), A_pre = sum_k w_k A_k, then A_pre is
whitened over the batch's responses (``sequence``, TRL: / (std + 1e-4)) or tokens (``token``, verl:
/ sqrt(var + 1e-8)).
"""

from __future__ import annotations

import math

import numpy as np

from gndpo.errors import GndpoError
from gndpo.pipeline.methods.base import Method, Modifier, Response, Stats, Targets
from gndpo.pipeline.settings.schema import MethodConfig
from gndpo.pipeline.tasks.rewards import get_reward

GRPO_EPS = 1e-6
GDPO_EPS = 1e-4


def check_outcome_rewards(cfg: MethodConfig) -> None:
    """``method.outcome`` where a method uses it (by :func:`gndpo.pipeline.methods.validate`): at least one
    reward, each one that exists, and one weight per reward (or none); one-line user errors."""
    oc = cfg.outcome
    if not oc.rewards:
        raise GndpoError("method.outcome.rewards is empty")
    for name in oc.rewards:
        get_reward(name)  # a one-line error for an unknown name or a custom reward that does not import
    if oc.weights and len(oc.weights) != len(oc.rewards):
        raise GndpoError(f"method.outcome.weights must be {len(oc.rewards)} numbers, one per reward, got {oc.weights!r}")


def outcome_rewards(cfg: MethodConfig) -> list[tuple[str, float]]:
    """[(reward name, weight)] from ``method.outcome`` (checked by :func:`check_outcome_rewards`)."""
    oc = cfg.outcome
    return list(zip(oc.rewards, map(float, oc.weights or [1.0] * len(oc.rewards))))


def _col(name: str) -> str:
    return f"rewards['{name}']"


def group_statistics(q, columns: dict[str, str]) -> dict:
    """Per prompt, for each named SQL expression over a response's rewards: mean, unbiased std (NULL
    for a singleton group) and the group size."""
    cols = ", ".join(f"avg({expr}) AS \"{n}_mean\", stddev_samp({expr}) AS \"{n}_std\"" for n, expr in columns.items())
    return q.by_prompt(f"SELECT prompt_id, count(*) AS group_size, {cols} FROM responses GROUP BY prompt_id")


GRPO_REWARD = "weighted_reward"


def grpo_reward(rewards: dict, weighted: list[tuple[str, float]]) -> float:
    """GRPO's scalar reward: sum_k w_k R_k."""
    return sum(w * rewards[name] for name, w in weighted)


def grpo_advantage(rewards: dict, group: dict, weighted: list[tuple[str, float]]) -> float:
    if group["group_size"] < 2:
        mean, std = 0.0, 1.0
    else:
        mean, std = group[f"{GRPO_REWARD}_mean"], group[f"{GRPO_REWARD}_std"]
    return (grpo_reward(rewards, weighted) - mean) / (std + GRPO_EPS)


def gdpo_pre_advantage(rewards: dict, group: dict, weighted: list[tuple[str, float]]) -> float:
    total = 0.0
    for name, w in weighted:
        std = group.get(f"{name}_std")  # absent for a singleton group (NULL in DuckDB, NaN in torch)
        a = (rewards[name] - group[f"{name}_mean"]) / (std + GDPO_EPS) if std is not None else math.nan
        total += w * (0.0 if math.isnan(a) else a)
    return total


def _grpo_statistics(q, cfg: MethodConfig, round_idx):
    summed = " + ".join(f"{w} * {_col(n)}" for n, w in outcome_rewards(cfg))
    return {}, group_statistics(q, {GRPO_REWARD: summed})


def _grpo_targets(resp: Response, stats: Stats, cfg: MethodConfig, round_idx: int) -> Targets:
    a = grpo_advantage(resp.rewards, stats.group(resp.prompt_id), outcome_rewards(cfg))
    return Targets.policy_gradient(np.full_like(resp.mask, a), resp.mask)


def _gdpo_statistics(q, cfg: MethodConfig, round_idx):
    weighted = outcome_rewards(cfg)
    mode = cfg.outcome.gdpo_batch_norm
    groups = group_statistics(q, {n: _col(n) for n, _ in weighted})
    terms = " + ".join(
        f"{w} * coalesce((({_col(n)}) - avg({_col(n)}) OVER g) / (stddev_samp({_col(n)}) OVER g + {GDPO_EPS}), 0)"
        for n, w in weighted
    )
    pre = f"SELECT n_valid, {terms} AS a FROM responses WINDOW g AS (PARTITION BY prompt_id)"
    if mode == "sequence":
        round_wide = q.one(f"SELECT avg(a) AS gdpo_mean, stddev_samp(a) AS gdpo_std FROM ({pre})")
    else:  # every valid token carries its response's A_pre
        round_wide = q.one(
            f"""SELECT sum(n_valid * a) / sum(n_valid) AS gdpo_mean,
                   (sum(n_valid * a * a) - sum(n_valid * a) ^ 2 / sum(n_valid)) / (sum(n_valid) - 1) AS gdpo_var
                FROM ({pre})"""
        )
    return round_wide, groups


def _gdpo_targets(resp: Response, stats: Stats, cfg: MethodConfig, round_idx: int) -> Targets:
    pre = gdpo_pre_advantage(resp.rewards, stats.group(resp.prompt_id), outcome_rewards(cfg))
    if cfg.outcome.gdpo_batch_norm == "sequence":
        a = (pre - stats["gdpo_mean"]) / (stats["gdpo_std"] + GDPO_EPS)
    else:
        a = (pre - stats["gdpo_mean"]) / math.sqrt(stats["gdpo_var"] + 1e-8)
    return Targets.policy_gradient(np.full_like(resp.mask, a), resp.mask)


def _apply_outcome_mix(t: Targets, resp: Response, stats: Stats, cfg: MethodConfig, round_idx: int) -> Targets:
    """A_t = A_dist_t + coef * A_GRPO_i on the tokens with a policy-gradient term (slime-style)."""
    a = grpo_advantage(resp.rewards, stats.group(resp.prompt_id), outcome_rewards(cfg))
    t.adv = t.adv + cfg.outcome.coef * a * t.pg_mask
    return t


METHODS = [
    Method("grpo", "group-normalized outcome reward, the weighted sum of method.outcome.rewards (section 9)",
           _grpo_statistics, _grpo_targets, policy_loss="ppo", rewards_used="outcome"),
    Method("gdpo", "per-reward group normalization, weighted sum, batch whitening (section 9)",
           _gdpo_statistics, _gdpo_targets, policy_loss="ppo", rewards_used="outcome"),
]

MODIFIERS = [Modifier("outcome_mix", "method.outcome.coef != 0", lambda cfg: cfg.outcome.coef != 0, _grpo_statistics, _apply_outcome_mix,
                      rewards_used="outcome")]
