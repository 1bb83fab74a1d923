"""Checks of settings against each other that need the methods' declarations (what each method's
score columns are): run by ``gndpo init`` and ``gndpo fork`` with the schema's own checks, never again by a
stage."""

from __future__ import annotations

from gndpo.errors import GndpoError
from gndpo.pipeline.methods import score_needs
from gndpo.pipeline.methods.base import TEACHER_ENTROPY, TOKEN_KL, TOPK

ENGINE_CANNOT = {TEACHER_ENTROPY: "the teacher's entropy", TOKEN_KL: "the full-vocabulary KL"}


def check_backend(cfg) -> None:
    """A GndpoError (one line) when the scoring set-up cannot give what the run's method needs:
    ``score.backend: vllm`` returns the teacher's sampled-token and top-k log-probs, not its whole
    distribution; ``score.cross_tokenizer`` maps sampled-token log-probs only (no shared vocabulary)."""
    over_vocabulary = sorted(score_needs(cfg.method) & {TOPK, TEACHER_ENTROPY, TOKEN_KL})
    if cfg.score.cross_tokenizer and over_vocabulary:
        raise GndpoError(
            f"score.cross_tokenizer maps the teacher's sampled-token log-probs only; method {cfg.method.name} needs "
            f"{', '.join(over_vocabulary)} over one vocabulary: use a teacher with the student's tokenizer"
        )
    if cfg.score.backend != "vllm":
        return
    missing = [what for need, what in ENGINE_CANNOT.items() if need in score_needs(cfg.method)]
    if missing:
        raise GndpoError(
            f"score.backend vllm gives the teacher's sampled-token and top-k log-probs only; method {cfg.method.name} "
            f"also needs {' and '.join(missing)}: use score.backend hf"
        )
