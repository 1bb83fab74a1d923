"""What a score worker has ready when it builds its teacher (:class:`ScoreSetup`): the run, the
round's policy and student module, the device, the run's pictures; and how each teacher reads a
prompt (its own rendering with a teacher context or its own image processing, else the student's ids)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from gndpo.pipeline.methods import score_needs
from gndpo.pipeline.run.run import Run
from gndpo.pipeline.settings.schema import Config
from gndpo.stages.models.live import LiveModels
from gndpo.stages.models.loading import is_vision_model, load_tokenizer
from gndpo.stages.models.logprobs import logits_chunk
from gndpo.stages.models.vision import BatchImages, load_processor, same_image_processing
from gndpo.stages.scoring.forward import StudentForward
from gndpo.stages.text.teacher_context import TeacherPrompts


@dataclass
class ScoreSetup:
    """A score worker's round, ready for a teacher backend to build on."""

    run: Run
    live: LiveModels
    device: torch.device
    policy: str  # the round's student folder
    student: torch.nn.Module | None  # None where the rollout engine's log-probs stand in for its forward
    images: BatchImages | None  # the student's image tensors and the pictures by prompt; None for text

    @property
    def cfg(self) -> Config:
        return self.run.cfg

    @cached_property
    def pad_id(self) -> int:
        return load_tokenizer(self.policy).pad_token_id or 0

    @cached_property
    def routes(self) -> dict[str, str]:
        """{prompt id: teacher name} with several teachers routed by prompt (score.teacher_mix route);
        empty otherwise (every row to the one teacher, or to the mean of several)."""
        if not (self.cfg.teachers and self.cfg.score.teacher_mix == "route"):
            return {}
        return {p["prompt_id"]: p["teacher"] for p in self.run.prompts("train")}

    def student_forward(self, teacher_modules: list = (), teacher_path: str | None = None) -> StudentForward:
        """The student's forward, with the teacher modules of ``teacher_path`` beside it (init checked
        that several teachers process pictures alike: one set of teacher image tensors serves them all)."""
        cfg = self.cfg
        modules = [m for m in (self.student, *teacher_modules) if m is not None]
        return StudentForward(
            self.student, logits_chunk(modules, cfg.model) if modules else 1, self.pad_id, self.device,
            cfg.score.max_tokens_per_batch, cfg.score.rows_per_chunk, frozenset(score_needs(cfg.method)), cfg.logging.entropy_metrics,
            self.images, self.teacher_images(teacher_path) if teacher_modules else None, cfg.model.shared_prompts,
        )

    def own_image_processing(self, teacher_path: str) -> bool:
        """Whether the teacher reads the run's pictures otherwise than the student does: as other
        tensors or tokens (its own processor), or not at all (a text-only teacher)."""
        if self.images is None:
            return False
        return not is_vision_model(teacher_path) or not same_image_processing(self.images.processor, load_processor(teacher_path))

    def teacher_images(self, teacher_path: str) -> BatchImages | None:
        """The teacher modules' image tensors: the student's, its own processor's, or none (text)."""
        if self.images is None or not self.own_image_processing(teacher_path):
            return self.images
        return self.images.read_by(load_processor(teacher_path)) if is_vision_model(teacher_path) else None

    def teacher_context(self, teacher_path: str) -> TeacherPrompts | None:
        """The teacher reads its own prompt before the same response ids with a teacher context, or where
        it expands the pictures into its own image tokens; None: the student's prompt ids."""
        if self.cfg.teacher_context.messages or self.own_image_processing(teacher_path):
            return self.teacher_prompts(teacher_path)
        return None

    def teacher_prompts(self, teacher_path: str) -> TeacherPrompts:
        """Each training prompt as the teacher at ``teacher_path`` renders it (its tokenizer, template,
        context, and its processor over the run's pictures)."""
        images = {}
        if self.images is not None and is_vision_model(teacher_path):
            images = {"processor": load_processor(teacher_path), "pictures": self.images.images.get}
        return TeacherPrompts(load_tokenizer(teacher_path), self.cfg.data, self.cfg.teacher_context, self.run.prompts("train"), **images)
