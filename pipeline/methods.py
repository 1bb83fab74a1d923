"""Distillation methods: what each needs from score, asks of normalize, and feeds to the policy loss.

A method is readable here in one place (formulas: shared/ALGORITHMS.md, sections 1 and 2):

* ``score_columns``: the per-token columns the score stage must store for it,
* ``statistics``: the batch statistics the normalize stage computes for it (with DuckDB, over all
  committed score shards of the round, i.e. global across workers and data-parallel ranks),
* ``advantages``: the per-token advantage from one response's scores and those statistics.

The policy loss that consumes the advantages is in :mod:`gndpo.pipeline.losses`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from gndpo.errors import GndpoError


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


@dataclass(frozen=True)
class Method:
    name: str
    score_columns: tuple[str, ...]
    statistics: tuple[str, ...]
    # (c_t for one response, its loss mask, the round's global statistics, method config) -> A_t
    advantages: Callable[[np.ndarray, np.ndarray, dict, object], np.ndarray]


def _opd_advantages(c: np.ndarray, mask: np.ndarray, stats: dict, cfg) -> np.ndarray:
    """Section 1: A_t = c_t * m_t."""
    return c * mask


def _gndpo_advantages(c: np.ndarray, mask: np.ndarray, stats: dict, cfg) -> np.ndarray:
    """Section 2: A_t = (c_t - mu) / sqrt(var + eps) * m_t with mu, var over the whole round's batch."""
    return (c - stats["c_mean"]) / np.sqrt(stats["c_var"] + cfg.std_eps) * mask


METHODS: dict[str, Method] = {
    "opd": Method(
        name="opd",
        score_columns=("teacher_logprobs", "student_logprobs"),
        statistics=("token_count", "c_mean", "c_std"),  # logged; OPD's advantage does not use them
        advantages=_opd_advantages,
    ),
    "gndpo": Method(
        name="gndpo",
        score_columns=("teacher_logprobs", "student_logprobs"),
        statistics=("token_count", "c_mean", "c_var", "c_std"),
        advantages=_gndpo_advantages,
    ),
}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise GndpoError(f"unknown method {name!r}; choose one of: {', '.join(sorted(METHODS))}")
    return METHODS[name]
