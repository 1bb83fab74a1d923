"""``score.backend: hf``: the teachers are Hugging Face modules that read each batch beside the
student, in the student's forward: sampled-token log-probs, top-k with the log of the mass outside it,
entropies, the full-vocabulary KL."""

from __future__ import annotations

from gndpo.stages.models.logprobs import logits_chunk
from gndpo.stages.models.lora import without_adapters
from gndpo.stages.scoring.forward import Scored, StudentForward, UnitRows
from gndpo.stages.teachers.base import Capabilities, TeacherBackend, context_prompts, teacher_groups
from gndpo.stages.text.cross_tokenizer import TeacherModule
from gndpo.stages.text.teacher_context import TeacherPrompts


class ModuleTeachers:
    """The teacher module(s) score each batch in the student's forward."""

    def __init__(self, forward: StudentForward, modules: dict[str, object], routes: dict[str, str], context: TeacherPrompts | None):
        """``modules``: {name recorded per row: module}; ``routes``: {prompt id: teacher name} for
        ``score.teacher_mix: route`` (empty: every row to the one teacher, or to the mean of several)."""
        self.forward, self.modules, self.routes, self.context = forward, modules, routes, context

    def score(self, rows: UnitRows, topk: int) -> Scored:
        groups = self.groups(rows.prompt_ids)
        per_token = self.forward.columns(rows, groups.values(), topk, context_prompts(self.context, rows))
        labels = [""] * rows.n
        for label, (_, members) in groups.items():
            for i in members:
                labels[i] = label
        return Scored(per_token, labels)

    def groups(self, prompt_ids: list[str]) -> dict[str, tuple[object, list[int]]]:
        """{label recorded per row: (the teacher module(s) that score those rows, the rows)}: each row's
        routed teacher, or all rows to the one teacher (a list of modules for the mean mix)."""
        return {label: (self.modules[names[0]] if len(names) == 1 else [self.modules[n] for n in names], rows)
                for label, names, rows in teacher_groups(prompt_ids, list(self.modules), self.routes)}


class HFBackend(TeacherBackend):
    """Teacher modules loaded in the score worker, beside the student."""

    capabilities = Capabilities(full_distribution=True, mixes_topk=True, weights_beside_student=True, engine=False, served=False)

    def teacher(self, teachers: dict[str, str]) -> ModuleTeachers:
        setup = self.setup
        modules = {name: self.module(path) for name, path in teachers.items()}
        path = next(iter(teachers.values()))
        return ModuleTeachers(setup.student_forward(list(modules.values()), path), modules, setup.routes, setup.teacher_context(path))

    def columns(self, name: str, path: str, prompts: TeacherPrompts) -> TeacherModule:
        setup, score_cfg = self.setup, self.setup.cfg.score
        module = setup.live.causal_lm(path, setup.cfg.model, setup.device, fixed=True)
        return TeacherModule(module, prompts, setup.device, logits_chunk(module, setup.cfg.model), score_cfg.max_tokens_per_batch, score_cfg.rows_per_chunk)

    def module(self, path: str):
        """The teacher module at ``path``: the student module itself where the teacher is the round's
        policy (a live self-teacher, or any teacher in round 0 of a LoRA student); the base under the
        student's adapters where it is the initial student with model.lora (a frozen self-teacher: no
        second copy of the weights); else a module of its own."""
        setup, lora = self.setup, self.setup.cfg.model.lora
        student = setup.student
        if student is not None and path == setup.policy:
            return student
        if student is not None and path == setup.run.lora_base() and not (lora.train_output_layer or lora.train_embeddings):
            return without_adapters(student)
        return setup.live.causal_lm(path, setup.cfg.model, setup.device, fixed=not setup.run.teacher_changes() and path != setup.policy)
