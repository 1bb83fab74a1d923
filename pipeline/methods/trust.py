"""Trust-region and entropy-aware variants of OPD (docs/reference/methods.md: tropd, eopd, reopold).

TrOPD [interp]: P_t = min(exp(lpT - lpS), 1) is the speculative-decoding acceptance probability;
tokens with P_t >= tau get the OPD/GNDPO policy-gradient term, the others ("outliers") are dropped
(``mask``), get r_t <- max(r_t, c) (``clip``) or forward KL on the teacher's top-k with weight lambda
(``fkl``). Teacher-prefix tokens of guided rollouts get forward KL and never a policy-gradient term.

EOPD: PPO on A_t = lpT - lpS_old, plus forward KL (top-k) where the teacher's entropy exceeds 0.8 nats.

REOPOLD: R^_t = max(lpT - lpS, log(lam) / (1 - lam)); REINFORCE on R^ over a token selection M:
phase 1 (round < switch_round) drops tokens below the floor, phase 2 keeps tokens whose student
entropy is in the batch's top beta fraction (quantile from normalize).
"""

from __future__ import annotations

import math

import numpy as np

from gndpo.pipeline.methods.base import STUDENT_ENTROPY, TEACHER_ENTROPY, TOPK, Method, Response, Stats, Targets, no_statistics
from gndpo.pipeline.methods.distill import gndpo_normalized
from gndpo.pipeline.settings.schema import MethodConfig


def acceptance(log_ratio: np.ndarray) -> np.ndarray:
    """P_t = min(pi_T / pi_S, 1)."""
    return np.exp(np.minimum(log_ratio, 0.0))


def _tropd_statistics(q, cfg: MethodConfig, round_idx):
    tropd_cfg = cfg.tropd
    if tropd_cfg.tau_quantile < 0:
        return {"tropd_tau": tropd_cfg.tau}, {}
    return {"tropd_tau": q.quantile("exp(least(lpT - lpS, 0))", tropd_cfg.tau_quantile)}, {}


def _tropd_targets(resp: Response, stats: Stats, cfg: MethodConfig, round_idx: int) -> Targets:
    tropd_cfg = cfg.tropd
    r = resp.log_ratio
    trust = (acceptance(r) >= stats["tropd_tau"]).astype(np.float64) * resp.mask
    outlier = resp.mask - trust
    if tropd_cfg.outlier == "clip":
        r = np.where(outlier > 0, np.maximum(r, tropd_cfg.clip_value), r)
        pg_mask = resp.mask.copy()
    else:
        pg_mask = trust
    c = np.clip(r, -cfg.clamp, cfg.clamp)
    adv = gndpo_normalized(c, stats, cfg.std_eps) if tropd_cfg.base == "gndpo" else c
    div = tropd_cfg.fkl_coef * outlier if tropd_cfg.outlier == "fkl" else np.zeros_like(r)
    div = div + resp.prefix  # teacher-written tokens: forward KL only
    mask = pg_mask + (div > 0) * (pg_mask == 0)
    return Targets(adv=adv * pg_mask, pg_mask=pg_mask, div=div, mask=mask)


def _eopd_targets(resp: Response, stats: Stats, cfg: MethodConfig, round_idx: int) -> Targets:
    uncertain = (resp.teacher_entropy > cfg.eopd.entropy_threshold).astype(np.float64)
    t = Targets.policy_gradient(resp.log_ratio, resp.mask)
    t.div = cfg.eopd.fkl_coef * uncertain * resp.mask
    return t


def reopold_floor(lam: float) -> float:
    return math.log(lam) / (1.0 - lam)


def _reopold_statistics(q, cfg: MethodConfig, round_idx):
    if round_idx < cfg.reopold.switch_round:
        return {}, {}
    beta = cfg.reopold.beta
    return {"reopold_entropy_cut": q.quantile("hS", 1.0 - beta)}, {}


def _reopold_targets(resp: Response, stats: Stats, cfg: MethodConfig, round_idx: int) -> Targets:
    floor = reopold_floor(cfg.reopold.lam)
    r = resp.log_ratio
    if round_idx < cfg.reopold.switch_round:
        keep = (r >= floor).astype(np.float64)
    else:
        keep = (resp.student_entropy >= stats["reopold_entropy_cut"]).astype(np.float64)
    return Targets.policy_gradient(np.maximum(r, floor), resp.mask * keep)


METHODS = [
    Method(
        "tropd", "OPD/GNDPO on trusted tokens (min(pi_T/pi_S, 1) >= tau), outliers masked, clipped or fkl (section 6)",
        _tropd_statistics, _tropd_targets, needs=frozenset({TOPK}),
    ),
    Method(
        "eopd", "PPO on lpT - lpS plus forward KL where the teacher's entropy > 0.8 nats (section 7)",
        no_statistics, _eopd_targets, needs=frozenset({TOPK, TEACHER_ENTROPY}), policy_loss="ppo", loss_agg="token-mean",
    ),
    Method(
        "reopold", "REINFORCE on the floored log-ratio, with a floor mask then an entropy mask (section 8)",
        _reopold_statistics, _reopold_targets, needs=frozenset({STUDENT_ENTROPY}), policy_loss="reinforce", loss_agg="token-mean",
    ),
]
