"""The teacher backends by ``score.backend``, and what asks them: a score worker's teacher
(:func:`build_teacher`) and init's checks of the settings against what a backend can give
(:func:`check_teacher_backend`). Adding a backend is a module of its own and one line in
:data:`TEACHER_BACKENDS` (its name is also one of ``score.backend``'s choices in the config schema; a
test holds the two equal)."""

from __future__ import annotations

from gndpo.errors import GndpoError
from gndpo.pipeline.config.checks import check_other_vocabulary, check_student_logprobs
from gndpo.pipeline.methods import score_needs
from gndpo.pipeline.methods.base import TEACHER_ENTROPY, TOKEN_KL, TOPK
from gndpo.pipeline.settings.schema import Config
from gndpo.stages.models.loading import load_tokenizer
from gndpo.stages.teachers.base import Teacher, TeacherBackend
from gndpo.stages.teachers.hf import HFBackend
from gndpo.stages.teachers.other_tokenizer import OtherTokenizerTeacher
from gndpo.stages.teachers.served import ServerBackend
from gndpo.stages.teachers.setup import ScoreSetup
from gndpo.stages.teachers.vllm import VLLMBackend
from gndpo.stages.text.cross_tokenizer import CrossTokenizerTeacher

TEACHER_BACKENDS: dict[str, type[TeacherBackend]] = {
    "hf": HFBackend,
    "vllm": VLLMBackend,
    "server": ServerBackend,
}
# What a backend that lacks Capabilities.full_distribution cannot give a method.
WHOLE_DISTRIBUTION = {TEACHER_ENTROPY: "the teacher's entropy", TOKEN_KL: "the full-vocabulary KL"}


def backend_of(cfg: Config) -> type[TeacherBackend]:
    """The backend class ``score.backend`` names."""
    return TEACHER_BACKENDS[cfg.score.backend]


def build_teacher(setup: ScoreSetup, teachers: dict[str, str]) -> tuple[Teacher, TeacherBackend]:
    """The teacher that scores a worker's units, and its backend: the teachers' own (they share the
    student's tokenizer), or each teacher over its own tokens (``score.cross_tokenizer``)."""
    backend = backend_of(setup.cfg)(setup)
    if not setup.cfg.score.cross_tokenizer:
        return backend.teacher(teachers), backend
    student_tok, end_text = load_tokenizer(setup.policy), setup.cfg.score.teacher_end_text
    cross = {}
    for name, path in teachers.items():
        prompts = setup.teacher_prompts(path)
        cross[name] = CrossTokenizerTeacher(backend.columns(name, path, prompts), prompts, student_tok, end_text)
    return OtherTokenizerTeacher(setup.student_forward(), cross, setup.routes), backend


def check_teacher_backend(cfg: Config) -> None:
    """A GndpoError (one line) when the scoring set-up cannot give what the run's method needs: a
    backend without the teacher's whole distribution gives its sampled-token and top-k log-probs only,
    and mixes sampled-token log-probs only; ``score.cross_tokenizer`` maps log-probs and top-k by token
    text, so nothing defined over one vocabulary at every position (the teacher's entropy, the full KL)."""
    if cfg.score.cross_tokenizer:
        check_other_vocabulary(cfg)
    check_student_logprobs(cfg)
    backend, can = cfg.score.backend, backend_of(cfg).capabilities
    able = " or ".join(f"score.backend {name}" for name, b in TEACHER_BACKENDS.items() if b.capabilities.full_distribution)
    missing = [what for need, what in WHOLE_DISTRIBUTION.items() if need in score_needs(cfg.method)]
    if missing and not can.full_distribution:
        raise GndpoError(f"score.backend {backend} gives the teacher's sampled-token and top-k log-probs only; method {cfg.method.name} "
                         f"also needs {' and '.join(missing)}: use {able}")
    if TOPK in score_needs(cfg.method) and cfg.teachers and cfg.score.teacher_mix == "mean" and not can.mixes_topk:
        raise GndpoError(f"score.teacher_mix mean with score.backend {backend} mixes sampled-token log-probs only (each teacher's "
                         "top-k is its own, and the rest of its distribution unknown): route each prompt to one teacher "
                         f"(score.teacher_mix route) for a top-k method, or use {able}")
