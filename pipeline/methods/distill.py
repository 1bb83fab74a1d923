"""Policy-gradient distillation with the teacher's log-ratio as the advantage (docs/reference/methods.md: opd, gndpo, tinker, minillm).

* OPD: A_t = clamp(lpT - lpS, -5, 5) * m_t.
* GNDPO: the same clamped score, normalized by its mean and unbiased std over ALL valid tokens of the
  round (global across workers and ranks). Normalize gets those from score's per-response partial sums.
* Tinker-style OPD: A_t = lpT - lp_sampler (no clamp), loss -exp(lp_theta - lp_sampler) A_t, no clip.
* MiniLLM: r_t = lpT - lpS, A_t = discounted sum of the remaining r (gamma 0.95) divided by the
  number of remaining tokens, whitened over the batch; normalize computes the return per token with a
  DuckDB window and its mean and variance.
"""

from __future__ import annotations

import math

import numpy as np

from gndpo.errors import GndpoError
from gndpo.pipeline.methods.base import Method, Response, Stats, Targets, no_statistics
from gndpo.pipeline.settings.schema import MethodConfig


def clamped_score(teacher_logprobs: np.ndarray, student_logprobs: np.ndarray, clamp: float) -> np.ndarray:
    """c_t = clamp(lpT_t - lpS_t, -clamp, clamp): minus the k1 sample of KL(pi_S || pi_T)."""
    return np.clip(teacher_logprobs.astype(np.float64) - student_logprobs.astype(np.float64), -clamp, clamp)


def score_partial_sums(c: np.ndarray, mask: np.ndarray) -> dict:
    """Per-response partial sums from which normalize derives the global mean and unbiased std."""
    valid = c[mask.astype(bool)]
    return {
        "n_valid": int(valid.size),
        "c_sum": float(valid.sum()),
        "c_sq_sum": float(np.square(valid).sum()),
        "c_min": float(valid.min()) if valid.size else None,
        "c_max": float(valid.max()) if valid.size else None,
    }


def gndpo_stats_from_sums(n: float, c_sum: float, c_sq_sum: float) -> dict:
    """Global mean and unbiased variance of c over N valid tokens (section 2); N <= 1 is an error."""
    if n is None or n <= 1:
        raise GndpoError(f"GNDPO needs at least 2 valid tokens in the round's batch, got {int(n or 0)}")
    mean = c_sum / n
    # sum (c - mu)^2 = sum c^2 - N mu^2; clip tiny negative round-off.
    var = max(c_sq_sum - n * mean * mean, 0.0) / (n - 1)
    return {"token_count": float(n), "c_mean": mean, "c_var": var, "c_std": float(np.sqrt(var))}


def gndpo_normalized(c: np.ndarray, stats: Stats, eps: float) -> np.ndarray:
    """(c - mu) / sqrt(var + eps) with the round's global statistics of the clamped score."""
    return (c - stats["c_mean"]) / np.sqrt(stats["c_var"] + eps)


def _opd_targets(resp: Response, stats: Stats, cfg: MethodConfig, round_idx: int) -> Targets:
    return Targets.policy_gradient(clamped_score(resp.teacher_lp, resp.student_lp, cfg.clamp), resp.mask)


def _gndpo_targets(resp: Response, stats: Stats, cfg: MethodConfig, round_idx: int) -> Targets:
    c = clamped_score(resp.teacher_lp, resp.student_lp, cfg.clamp)
    # stats_scope teacher: mean and std over the tokens of the teacher that scored this response.
    scope = stats.of_teacher(resp.teacher) if cfg.stats_scope == "teacher" else stats
    return Targets.policy_gradient(gndpo_normalized(c, scope, cfg.std_eps), resp.mask)


def _tinker_targets(resp: Response, stats: Stats, cfg: MethodConfig, round_idx: int) -> Targets:
    return Targets.policy_gradient(resp.teacher_lp - resp.sampler_lp, resp.mask)


def minillm_returns(r: np.ndarray, mask: np.ndarray, gamma: float) -> np.ndarray:
    """sum_{k>=t, valid} gamma^(k-t) r_k / #(valid k >= t), at every valid t (0 elsewhere)."""
    out = np.zeros_like(r, dtype=np.float64)
    acc, count = 0.0, 0
    for t in range(len(r) - 1, -1, -1):
        if mask[t]:
            acc, count = r[t] + gamma * acc, count + 1
            out[t] = acc / count
        else:
            acc *= gamma  # a masked position still counts in the distance k - t
    return out


# gamma^t underflows float64 beyond ~ 700 / ln(1/gamma) positions (13.6k tokens at 0.95).
MINILLM_MAX_EXPONENT = 700.0


def _minillm_statistics(q, cfg: MethodConfig, round_idx):
    g = cfg.minillm_gamma
    longest = q.one("SELECT coalesce(max(t), 0) AS t FROM tokens")["t"]
    if g < 1.0 and longest * math.log(1.0 / g) > MINILLM_MAX_EXPONENT:
        raise GndpoError(f"minillm: responses of {int(longest)} tokens are too long for gamma {g} (float64 range)")
    # Discounted reverse sum as a window: sum_{k>=t} g^k r_k / g^t.
    stats = q.one(
        f"""
        WITH ret AS (
            SELECT sum(pow({g}, t) * (lpT - lpS)) OVER w / pow({g}, t) / count(*) OVER w AS a
            FROM tokens
            WINDOW w AS (PARTITION BY rollout_id ORDER BY t DESC ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
        )
        SELECT avg(a) AS minillm_mean, var_samp(a) AS minillm_var FROM ret
        """
    )
    return stats, {}


def _minillm_targets(resp: Response, stats: Stats, cfg: MethodConfig, round_idx: int) -> Targets:
    a = minillm_returns(resp.log_ratio, resp.mask, cfg.minillm_gamma)
    whitened = (a - stats["minillm_mean"]) / np.sqrt(stats["minillm_var"] + cfg.std_eps)
    return Targets.policy_gradient(whitened, resp.mask)


METHODS = [
    Method("opd", "A = clamp(lpT - lpS) (section 1)", no_statistics, _opd_targets),
    Method("gndpo", "A = clamped score normalized over the whole batch (section 2)", no_statistics, _gndpo_targets),
    Method(
        "tinker", "A = lpT - lp_sampler, unclipped importance ratio to the sampler (section 10)",
        no_statistics, _tinker_targets, policy_loss="is", loss_agg="token-mean", old_logprobs="sampler",
    ),
    Method(
        "minillm", "discounted per-token return of lpT - lpS, whitened over the batch (section 10)",
        _minillm_statistics, _minillm_targets, policy_loss="ppo",
    ),
]
