"""The method family: every method docs/reference/methods.md describes, selected by ``method.name``.

Each module declares its methods whole (score columns, normalize statistics, train targets):

* :mod:`.distill`: OPD, GNDPO, Tinker-style OPD, MiniLLM (sections 1, 2, 10);
* :mod:`.divergence`: reverse KL / forward KL / JSD on the teacher's top-k, PACED, reward weighting (3, 5);
* :mod:`.tip`: TIP token selection (4);
* :mod:`.trust`: TrOPD, EOPD, REOPOLD (6, 7, 8);
* :mod:`.outcome`: GRPO, GDPO, outcome-advantage mixing (9).

Modifiers (TIP, PACED weights, reward weights, outcome mixing) compose with any method. The three
functions below are what the stages call: :func:`score_needs` (score), :func:`method_statistics`
(normalize) and :func:`response_targets` (train).
"""

from __future__ import annotations

from gndpo.errors import GndpoError, did_you_mean
from gndpo.pipeline.methods import distill, divergence, outcome, tip, trust
from gndpo.pipeline.methods.base import (
    SCORE_EXTRAS,
    WEIGHTED_SEQ_MEAN,
    Method,
    Response,
    Stats,
    StatsQuery,
    Targets,
    merge_groups,
)
from gndpo.pipeline.methods.distill import clamped_score, gndpo_stats_from_sums, score_partial_sums
from gndpo.pipeline.settings.schema import Config, MethodConfig
from gndpo.pipeline.tasks.rewards import reads_answer

METHODS: dict[str, Method] = {m.name: m for mod in (distill, divergence, trust, outcome) for m in mod.METHODS}
MODIFIERS = [*tip.MODIFIERS, *divergence.MODIFIERS, *outcome.MODIFIERS]

__all__ = [
    "METHODS", "MODIFIERS", "Method", "Response", "Stats", "StatsQuery", "Targets", "answer_readers", "clamped_score",
    "get_method", "gndpo_stats_from_sums", "method_statistics", "policy_settings", "response_targets",
    "score_needs", "score_partial_sums",
]


def get_method(name: str) -> Method:
    """The registered method called ``name``; a one-line GndpoError (with a suggestion) otherwise."""
    if name not in METHODS:
        raise GndpoError(f"unknown method {name!r}; choose one of: {', '.join(sorted(METHODS))}{did_you_mean(name, METHODS)}")
    return METHODS[name]


def active_modifiers(cfg: MethodConfig) -> list:
    """The modifiers (TIP and the others that reweight any method's tokens) that ``cfg`` turns on."""
    return [m for m in MODIFIERS if m.enabled(cfg)]


def validate(cfg: MethodConfig) -> Method:
    """The method settings the schema cannot check (its ranges and choices are checked when the config
    is read): the method's name, ``method.schedule``'s entries, and the outcome rewards where they are
    used. One-line user errors; run by ``gndpo init`` and ``gndpo fork``, never by a stage."""
    if cfg.name not in METHODS:
        raise GndpoError(f"config key method.name must be one of {', '.join(METHODS)}, got {cfg.name!r}{did_you_mean(cfg.name, METHODS)}")
    method = METHODS[cfg.name]
    if cfg.schedule:
        divergence.parse_schedule(cfg.schedule)
    if cfg.outcome.coef != 0 or cfg.name in ("grpo", "gdpo"):
        outcome.check_outcome_rewards(cfg)
    return method


def answer_readers(cfg: Config) -> str:
    """What in run config ``cfg`` needs each training prompt's reference answer, as a phrase for a
    one-line error ("" when nothing does): the method or a modifier that trains on a reward that reads
    the answer (the outcome methods, PACED's pass rates, reward weighting, outcome mixing), or a teacher
    context that shows it. GNDPO, OPD, the divergences and TIP learn from the teacher alone."""
    method = cfg.method
    used = {"outcome": list(method.outcome.rewards), "primary": [cfg.reward], "": []}
    users = [(f"method.name {method.name}", METHODS[method.name].rewards_used)] if method.name in METHODS else []
    users += [(m.knob, m.rewards_used) for m in active_modifiers(method)]
    readers = [f"{user} (reward {', '.join(r for r in used[source] if reads_answer(r))})"
               for user, source in users if any(reads_answer(r) for r in used[source])]
    if "answer" in cfg.teacher_context.columns():
        readers.append("teacher_context ({answer} in its messages)")
    return "; ".join(readers)


def policy_settings(cfg: MethodConfig) -> tuple[str, str]:
    """(policy loss, aggregation): the config's, or the method's defaults where the config is empty.
    Reward-weighted distillation (``reward_beta`` > 0) always aggregates sum_i w_i L_i / sum_i w_i over
    the step's responses (L_i: response i's token mean), as OPSD defines it: a token mean would give
    long responses more weight than their w_i."""
    method = get_method(cfg.name)
    agg = WEIGHTED_SEQ_MEAN if cfg.reward_beta > 0 else cfg.loss_agg or method.loss_agg
    return cfg.policy_loss or method.policy_loss, agg


def score_needs(cfg: MethodConfig) -> frozenset:
    """The optional score columns the run's method and modifiers need (see base.SCORE_EXTRAS)."""
    needs = set(get_method(cfg.name).needs)
    for m in active_modifiers(cfg):
        needs |= m.needs
    return frozenset(n for n in SCORE_EXTRAS if n in needs)


def method_statistics(q: StatsQuery, cfg: MethodConfig, round_idx: int) -> tuple[dict, dict]:
    """The method's and modifiers' statistics, from the normalize stage's DuckDB views."""
    method = get_method(cfg.name)
    round_wide, groups = method.statistics(q, cfg, round_idx)
    round_wide, groups = dict(round_wide), [groups]
    for m in active_modifiers(cfg):
        g, per_prompt = m.statistics(q, cfg, round_idx)
        round_wide.update(g)
        groups.append(per_prompt)
    return round_wide, merge_groups(*groups)


def response_targets(resp: Response, stats: Stats, cfg: MethodConfig, round_idx: int) -> Targets:
    """What train optimizes for ``resp``: the method's targets, then each active modifier's change."""
    targets = get_method(cfg.name).targets(resp, stats, cfg, round_idx)
    for m in active_modifiers(cfg):
        targets = m.apply(targets, resp, stats, cfg, round_idx)
    return targets


def divergence_of(cfg: MethodConfig, round_idx: int) -> str:
    """The divergence used by the div term this round."""
    return get_method(cfg.name).divergence(cfg, round_idx)
