"""Checks of settings against each other that need the methods' declarations (what each method's
score columns are): run by ``gndpo init`` and ``gndpo fork`` with the schema's own checks, never again by a
stage."""

from __future__ import annotations

from gndpo.errors import GndpoError
from gndpo.pipeline.methods import score_needs
from gndpo.pipeline.methods.base import STUDENT_ENTROPY, TEACHER_ENTROPY, TOKEN_KL, TOPK


def check_other_vocabulary(cfg) -> None:
    """A GndpoError (one line) for what ``score.cross_tokenizer`` cannot give the run's method: values
    defined at every position over one vocabulary (the teacher's entropy, the full KL); a top-k mixed
    over several teachers (each sits at its own spans' first tokens); the renormalized top-k form."""
    needs = score_needs(cfg.method)
    one_vocabulary = sorted(needs & {TEACHER_ENTROPY, TOKEN_KL})
    if one_vocabulary:
        raise GndpoError(
            f"score.cross_tokenizer compares the teacher's top-k token by token text; method {cfg.method.name} also needs "
            f"{', '.join(one_vocabulary)}, defined at every position over one vocabulary: use a teacher with the student's tokenizer"
        )
    if TOPK in needs and cfg.teachers and cfg.score.teacher_mix == "mean":
        raise GndpoError("score.teacher_mix mean with score.cross_tokenizer mixes sampled-token log-probs only: each teacher's "
                         "top-k sits at its own spans' first tokens, in its own vocabulary; route each prompt to one teacher "
                         "(score.teacher_mix route) for a top-k method")
    if TOPK in needs and cfg.method.topk_form != "bucket":
        raise GndpoError("score.cross_tokenizer compares top-k divergences in method.topk_form bucket only (the teacher's "
                         "tokens without a student twin join its rest bucket)")


def engine_logprob_blockers(cfg) -> list[str]:
    """Why the rollout engine's sampler log-probs cannot stand in for the student's forward in score
    (empty: they can): they are the temperature-1 distribution's, exist only for tokens the student
    sampled, and are not the student's whole distribution."""
    rollout_cfg = cfg.rollout
    reasons = [
        (rollout_cfg.temperature != 1.0, f"rollout.temperature {rollout_cfg.temperature} (vLLM returns the temperature-1 distribution's log-probs)"),
        (bool(rollout_cfg.tools), "rollout.tools (tool turns are not sampled by the student)"),
        (rollout_cfg.guided_fraction > 0, "rollout.guided_fraction (a guided prefix is not sampled by the student)"),
        (bool(score_needs(cfg.method) & {STUDENT_ENTROPY, TOKEN_KL}), f"method {cfg.method.name} (it reads the student's distribution)"),
    ]
    return [why for clash, why in reasons if clash]


def check_student_logprobs(cfg) -> None:
    """A GndpoError (one line) when ``score.student_logprobs: engine`` cannot stand in for the student's
    forward (:func:`engine_logprob_blockers`); ``auto`` falls back to the forward there instead."""
    blockers = engine_logprob_blockers(cfg) if cfg.score.student_logprobs == "engine" else []
    if blockers:
        raise GndpoError(f"score.student_logprobs engine cannot be used with {blockers[0]}: use score.student_logprobs recompute or auto")
