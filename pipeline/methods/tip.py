"""TIP token selection (docs/reference/methods.md, Modifiers): train only on the tokens where the student is uncertain or
disagrees with the teacher. Applies to any method (``method.tip.enabled``).

    h_t = H(p_S) (student entropy)   d_t = max(0, KL(p_S || p_T)) (full vocabulary, from score)
    h_t = min(h_t, quantile_q(h over the batch));  h^, d^ = min-max scaled over the batch
    score_t = 1 - (1 - h^)(1 - d^)  (soft OR, = h^ + d^ - h^ d^);  keep the top floor(keep_ratio * L) tokens of each response

The spec divides h by ln V first; a constant factor cancels in the min-max scaling, so it is omitted.
Ties keep the earlier token. Normalize computes the quantile and the min/max with DuckDB.
"""

from __future__ import annotations

import numpy as np

from gndpo.pipeline.methods.base import STUDENT_ENTROPY, TOKEN_KL, Modifier, Response, Stats, Targets
from gndpo.pipeline.settings.schema import MethodConfig


def _statistics(q, cfg: MethodConfig, round_idx):
    cap = q.quantile("hS", cfg.tip.entropy_quantile)  # exact, in bounded memory
    ranges = q.one(
        """SELECT min(h) AS tip_h_min, max(h) AS tip_h_max, min(d) AS tip_d_min, max(d) AS tip_d_max
           FROM (SELECT least(hS, $cap) AS h, greatest(kl, 0) AS d FROM tokens)""",
        {"cap": cap},
    )
    return {"tip_h_cap": cap, **ranges}, {}


def _minmax(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    return (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)


def tip_scores(student_entropy: np.ndarray, token_kl: np.ndarray, stats: Stats) -> np.ndarray:
    h = _minmax(np.minimum(student_entropy, stats["tip_h_cap"]), stats["tip_h_min"], stats["tip_h_max"])
    d = _minmax(np.maximum(token_kl, 0.0), stats["tip_d_min"], stats["tip_d_max"])
    # The product form is exactly 1 wherever h^ or d^ is 1 (the batch's maximum-KL token, tokens at or
    # above the entropy cap); h + d - h*d rounds those to 1 or 1 - 1 ulp, and the tie rule below would
    # then be decided by rounding noise instead of position.
    return 1.0 - (1.0 - h) * (1.0 - d)


def tip_selection(scores: np.ndarray, mask: np.ndarray, keep_ratio: float) -> np.ndarray:
    """0/1 over the response: the top floor(keep_ratio * L) valid tokens by score, ties -> earlier."""
    valid = np.flatnonzero(mask > 0)
    keep = int(np.floor(keep_ratio * valid.size))
    # A stable sort of -score keeps the earlier position first among equal scores.
    chosen = valid[np.argsort(-scores[valid], kind="stable")[:keep]]
    out = np.zeros_like(mask, dtype=np.float64)
    out[chosen] = 1.0
    return out


def _apply(t: Targets, resp: Response, stats: Stats, cfg: MethodConfig, round_idx: int) -> Targets:
    selected = tip_selection(tip_scores(resp.student_entropy, resp.token_kl, stats), resp.mask, cfg.tip.keep_ratio)
    t.mask, t.pg_mask, t.div = t.mask * selected, t.pg_mask * selected, t.div * selected
    t.adv = t.adv * selected
    return t


MODIFIERS = [Modifier("tip", "method.tip.enabled", lambda cfg: cfg.tip.enabled, _statistics, _apply, needs=frozenset({STUDENT_ENTROPY, TOKEN_KL}))]
