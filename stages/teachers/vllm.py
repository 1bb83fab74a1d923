"""``score.backend: vllm``: the teacher's vLLM engine in the score worker (``score.engine``; tensor
parallel there), kept across rounds by :class:`~gndpo.stages.models.live.LiveModels`."""

from __future__ import annotations

from functools import partial

from gndpo.stages.models.loading import is_vision_model
from gndpo.stages.models.vllm_engine import response_logprobs
from gndpo.stages.teachers.base import Capabilities
from gndpo.stages.teachers.engine import Scorer, ScorerBackend


class VLLMBackend(ScorerBackend):
    """One teacher, scored by its engine's prompt log-probs."""

    capabilities = Capabilities(full_distribution=False, mixes_topk=False, weights_beside_student=False, engine=True, served=False)

    def scorer(self, name: str, path: str) -> Scorer:
        setup, score_cfg = self.setup, self.setup.cfg.score
        shows = setup.run.images_per_prompt() if is_vision_model(path) else 0  # the engine is sized for the pictures it reads
        return partial(response_logprobs, setup.live.teacher_engine(path, score_cfg.engine, score_cfg.teacher_topk, images=shows))
