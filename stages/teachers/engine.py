"""Teachers scored by an engine outside the student's forward (``score.backend: vllm`` and ``server``):
sampled-token and top-k log-probs as prompt log-probs over the stored ids
(:func:`gndpo.stages.models.vllm_engine.response_logprobs`'s signature, a *scorer*). Methods that need
the teacher's whole distribution (its entropy, the full KL) are refused with these backends, and the
rest mass beside the top-k is 1 - sum(top-k p) (:func:`rest_logprob_from_topk`). A vLLM teacher reads
every picture's placeholder unexpanded, with the pictures, and expands it itself."""

from __future__ import annotations

from abc import abstractmethod
from typing import Callable

import numpy as np

from gndpo.pipeline.methods.losses import REST_MASS_FLOOR
from gndpo.stages.scoring.forward import Scored, StudentForward, UnitRows, place
from gndpo.stages.teachers.base import TeacherBackend, context_prompts, mean_logprob, teacher_groups
from gndpo.stages.text.teacher_context import TeacherPrompts

# (prompts' ids, responses' ids, top-k, pictures per prompt or None) -> {"logprobs", "topk_ids", "topk_logprobs"} flat
Scorer = Callable[[list, list, int, list | None], dict]


def engine_prompts(context: TeacherPrompts | None, rows: UnitRows) -> tuple[list, list | None]:
    """Per row, the prompt ids a teacher engine reads, and its pictures (None for text). vLLM expands
    each picture's placeholder itself, so with pictures the prompt is the teacher's unexpanded rendering."""
    if context is None:
        return [rows.prompt(i) for i in range(rows.n)], None
    if context.pictures is None:
        return context_prompts(context, rows), None
    prompt_rows = [context.by_id[pid] for pid in rows.prompt_ids]
    return [context.unexpanded(row)[1] for row in prompt_rows], [context.images(row) for row in prompt_rows]


class EngineTeacher:
    """Each teacher's columns from its scorer, after the student's forward. Several teachers (servers
    only) are routed, or mixed: the log of the mean of their probabilities of each sampled token (init
    refuses a top-k method with the mean mix: each teacher's top-k is its own)."""

    def __init__(self, forward: StudentForward, scorers: dict[str, Scorer], routes: dict[str, str], context: TeacherPrompts | None):
        """``scorers``: {name recorded per row: scorer}; ``routes``: {prompt id: teacher name} for
        ``score.teacher_mix: route`` (empty: every row to the one teacher, or to the mean of several)."""
        self.forward, self.scorers, self.routes, self.context = forward, scorers, routes, context

    def score(self, rows: UnitRows, topk: int) -> Scored:
        per_token = self.forward.columns(rows, [(None, list(range(rows.n)))], topk)
        n_tokens = len(per_token["student_logprobs"])
        prompts, images = engine_prompts(self.context, rows)
        labels = [""] * rows.n
        for label, names, members in teacher_groups(rows.prompt_ids, list(self.scorers), self.routes):
            shown = [images[i] for i in members] if images is not None else None
            answers = [self.scorers[name]([prompts[i] for i in members], [rows.response(i) for i in members], topk, shown) for name in names]
            columns = {"teacher_logprobs": mean_logprob([a["logprobs"] for a in answers])}
            if topk:
                columns.update(teacher_topk_ids=answers[0]["topk_ids"], teacher_topk_logprobs=answers[0]["topk_logprobs"],
                               teacher_rest_logprob=rest_logprob_from_topk(answers[0]["topk_logprobs"]))
            place(per_token, columns, rows.token_positions(members), n_tokens)
            for i in members:
                labels[i] = label
        return Scored(per_token, labels)


class TeacherEngineColumns:
    """A cross-tokenizer teacher's numbers from its scorer: prompt log-probs over its own rendering of
    each prompt and its own tokens of the response; the rest mass beside the top-k is 1 - sum(top-k p),
    as with :class:`EngineTeacher`."""

    def __init__(self, scorer: Scorer, prompts: TeacherPrompts):
        self.scorer, self.prompts = scorer, prompts

    def columns(self, rows: list[dict], responses: list[list[int]], topk: int) -> list[dict]:
        """See :class:`gndpo.stages.text.cross_tokenizer.TeacherColumns`. vLLM expands each picture's
        placeholder itself: with pictures the prompt is the teacher's unexpanded rendering."""
        if self.prompts.pictures is None:
            prompts, images = [self.prompts.token_ids(row) for row in rows], None
        else:
            prompts, images = [self.prompts.unexpanded(row)[1] for row in rows], [self.prompts.images(row) for row in rows]
        flat = self.scorer(prompts, responses, topk, images)
        named = {"teacher_logprobs": flat["logprobs"].astype(np.float64)}
        if topk:
            named.update(teacher_topk_ids=flat["topk_ids"], teacher_topk_logprobs=flat["topk_logprobs"],
                         teacher_rest_logprob=rest_logprob_from_topk(flat["topk_logprobs"]))
        offsets = np.cumsum([0] + [len(r) for r in responses])
        return [{name: values[offsets[i] : offsets[i + 1]] for name, values in named.items()} for i in range(len(responses))]


def rest_logprob_from_topk(topk_logprobs: np.ndarray) -> np.ndarray:
    """[N, k] top-k log-probs -> [N] float32 log(1 - sum_k p), the teacher's rest mass where only its
    top-k is known (an engine's or a server's): computed in float64 as log(-expm1(logsumexp)), with the
    mass floored at REST_MASS_FLOOR as train's own recomputation does. Exact only to the top-k's
    rounding: a true rest below ~1e-7 comes out as noise (the HF backend stores the full softmax's instead)."""
    lse = np.logaddexp.reduce(np.asarray(topk_logprobs, dtype=np.float64), axis=-1)
    return np.log(np.maximum(-np.expm1(lse), REST_MASS_FLOOR)).astype(np.float32)


class ScorerBackend(TeacherBackend):
    """A backend whose teachers answer through a scorer each (an engine, a pool of servers)."""

    @abstractmethod
    def scorer(self, name: str, path: str) -> Scorer:
        """The teacher ``name``'s scorer (its local folder: ``path``)."""

    def teacher(self, teachers: dict[str, str]) -> EngineTeacher:
        setup = self.setup
        scorers = {name: self.scorer(name, path) for name, path in teachers.items()}
        path = next(iter(teachers.values()))
        # vLLM expands a picture's placeholder itself: with pictures it reads the teacher's own rendering.
        context = setup.teacher_prompts(path) if setup.images is not None else setup.teacher_context(path)
        return EngineTeacher(setup.student_forward(), scorers, setup.routes, context)

    def columns(self, name: str, path: str, prompts: TeacherPrompts) -> TeacherEngineColumns:
        return TeacherEngineColumns(self.scorer(name, path), prompts)
