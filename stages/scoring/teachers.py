"""The teacher's columns of a score unit, from the backend the run's config names.

Every backend runs the student's forward (:class:`~gndpo.stages.scoring.forward.StudentForward`, the same
function train differentiates, so the importance ratio at a round's first step is 1 up to float error)
and adds the teacher's columns its own way:

* :class:`ModuleTeachers` (``score.backend: hf``): Hugging Face modules that read each batch beside the
  student: sampled-token log-probs, top-k with the log of the mass outside it, entropies, the
  full-vocabulary KL. Several teachers are routed (each prompt to the teacher its row names) or mixed
  (the mean of their distributions), per ``score.teacher_mix``.
* :class:`EngineTeacher` (``score.backend: vllm``): sampled-token and top-k log-probs from a vLLM engine,
  as prompt log-probs over the stored ids (:func:`gndpo.stages.models.vllm_engine.response_logprobs`;
  tensor parallel through ``score.engine``); with ``score.backend: server`` the same numbers from
  OpenAI-compatible teacher servers (:mod:`gndpo.stages.models.teacher_server`), one pool a teacher,
  several teachers routed or mixed. Methods that need the teacher's whole distribution (its
  entropy, the full KL) are refused with these backends, and the rest mass beside the top-k is
  1 - sum(top-k p) (:func:`rest_logprob_from_topk`).
* :class:`OtherTokenizerTeacher` (``score.cross_tokenizer``): a teacher with its own tokenizer scores its
  own tokens of each response's text, mapped onto the student's tokens by character offsets
  (:mod:`gndpo.stages.text.cross_tokenizer`), its log-probs given to the student's tokens span by span
  and its top-k stored in the student's vocabulary where a token of the same text exists; the teacher
  scores with its module or, with ``score.backend: vllm`` or ``server``, its engine or servers
  (:class:`TeacherEngineColumns`).

With a teacher context (``teacher_context.messages``), or pictures the teacher's processor expands its
own way, the teacher reads a prompt of its own before the same response ids
(:class:`~gndpo.stages.text.teacher_context.TeacherPrompts`); a vLLM teacher reads every picture's
placeholder unexpanded, with the pictures, and expands it itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from gndpo.pipeline.methods.losses import REST_MASS_FLOOR
from gndpo.stages.scoring.forward import StudentForward, UnitRows, place
from gndpo.stages.text.cross_tokenizer import CrossTokenizerTeacher
from gndpo.stages.text.teacher_context import TeacherPrompts


@dataclass
class Scored:
    """A unit's per-token columns, the student's and the teacher's, flat over its response tokens; the
    teacher recorded per row; and, for a cross-tokenizer teacher, 1 where a student token has a teacher
    value (``aligned``; None: every token counts) and 1 where that value is a share of a span of several
    student tokens (``split``; :mod:`gndpo.stages.text.align`)."""

    per_token: dict[str, np.ndarray]
    labels: list[str]
    aligned: np.ndarray | None = None
    split: np.ndarray | None = None


def context_prompts(context: TeacherPrompts | None, rows: UnitRows) -> list[list[int]] | None:
    """Per row, the prompt ids the teacher reads in place of the student's; None without a context."""
    if context is None:
        return None
    return [context.token_ids(context.by_id[pid]) for pid in rows.prompt_ids]


def engine_prompts(context: TeacherPrompts | None, rows: UnitRows) -> tuple[list, list | None]:
    """Per row, the prompt ids a teacher engine reads, and its pictures (None for text). vLLM expands
    each picture's placeholder itself, so with pictures the prompt is the teacher's unexpanded rendering."""
    if context is None:
        return [rows.prompt(i) for i in range(rows.n)], None
    if context.pictures is None:
        return context_prompts(context, rows), None
    prompt_rows = [context.by_id[pid] for pid in rows.prompt_ids]
    return [context.unexpanded(row)[1] for row in prompt_rows], [context.images(row) for row in prompt_rows]


class ModuleTeachers:
    """``score.backend: hf``: the teacher module(s) score each batch in the student's forward."""

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


def teacher_groups(prompt_ids: list[str], names: list[str], routes: dict[str, str]) -> list[tuple[str, list[str], list[int]]]:
    """(label recorded per row, the names of the teachers that score those rows, the rows): with
    ``routes`` ({prompt id: teacher name}, score.teacher_mix route) each row's routed teacher, else
    every row to the one teacher, or to the mean of all (score.teacher_mix mean)."""
    if routes:
        members: dict[str, list[int]] = {}
        for i, pid in enumerate(prompt_ids):
            members.setdefault(routes[pid], []).append(i)
        return [(name, [name], rows) for name, rows in members.items()]
    label = names[0] if len(names) == 1 else f"mean({','.join(names)})"
    return [(label, names, list(range(len(prompt_ids))))]


class EngineTeacher:
    """``score.backend: vllm`` or ``server``: each teacher's columns from its scorer (its vLLM engine, or
    its servers' pool; :func:`gndpo.stages.models.vllm_engine.response_logprobs`'s signature), after the
    student's forward. Several teachers (servers only) are routed, or mixed: the log of the mean of
    their probabilities of each sampled token (init refuses a top-k method with the mean mix: each
    teacher's top-k is its own)."""

    def __init__(self, forward: StudentForward, scorers: dict[str, Callable], routes: dict[str, str], context: TeacherPrompts | None):
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


class OtherTokenizerTeacher:
    """``score.cross_tokenizer``: the student's forward runs alone; each teacher scores its own tokens.

    Several teachers (each with its own tokenizer) are routed (each prompt to the teacher its row
    names) or mixed: with ``score.teacher_mix: mean`` a student token's teacher value is the log of the
    mean of the teachers' probabilities of it, ``log (1/n) sum_i exp(lpT_i)``, each teacher's value
    from its own spans (a token counts where every teacher aligned it)."""

    def __init__(self, forward: StudentForward, teachers: dict[str, CrossTokenizerTeacher], routes: dict[str, str]):
        """``teachers``: {name recorded per row: teacher}; ``routes``: {prompt id: teacher name} for
        ``score.teacher_mix: route`` (empty: every row to the one teacher, or to the mean of several)."""
        self.forward, self.teachers, self.routes = forward, teachers, routes

    def score(self, rows: UnitRows, topk: int) -> Scored:
        every = list(range(rows.n))
        per_token = self.forward.columns(rows, [(None, every)], topk)
        student_lp = per_token["student_logprobs"]
        n_tokens = len(student_lp)
        aligned, split = np.zeros(n_tokens, np.int8), np.zeros(n_tokens, np.int8)
        labels = [""] * rows.n
        for label, names, members in teacher_groups(rows.prompt_ids, list(self.teachers), self.routes):
            where = rows.token_positions(members)
            masks, answers = [rows.loss_mask(i) for i in members], [rows.tool_results(i) for i in members]
            crosses = [self.teachers[name].score([self.teachers[name].prompts.by_id[rows.prompt_ids[i]] for i in members],
                                                 [rows.response(i) for i in members], student_lp[where], topk, masks, answers)
                       for name in names]
            columns = {"teacher_logprobs": mean_logprob([c.values for c in crosses]), **crosses[0].topk}
            place(per_token, columns, where, n_tokens)
            aligned[where] = np.min([c.aligned for c in crosses], axis=0)
            split[where] = np.max([c.split for c in crosses], axis=0)
            for i in members:
                labels[i] = label
        return Scored(per_token, labels, aligned, split)


def mean_logprob(values: list[np.ndarray]) -> np.ndarray:
    """log of the mean of exp(values) over the list (one array: itself), in float64, as float32."""
    if len(values) == 1:
        return values[0]
    stacked = np.stack([np.asarray(v, np.float64) for v in values])
    return (np.logaddexp.reduce(stacked, axis=0) - np.log(len(values))).astype(np.float32)


class TeacherEngineColumns:
    """A cross-tokenizer teacher's numbers from its scorer (``score.backend: vllm`` or ``server``: its
    engine, or its servers): prompt log-probs over its own rendering of each prompt and its own tokens
    of the response; the rest mass beside the top-k is 1 - sum(top-k p), as with :class:`EngineTeacher`."""

    def __init__(self, scorer: Callable, prompts: TeacherPrompts):
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
    top-k is known (score.backend vllm): computed in float64 as log(-expm1(logsumexp)), with the mass
    floored at REST_MASS_FLOOR as train's own recomputation does. Exact only to the top-k's rounding:
    a true rest below ~1e-7 comes out as noise (the HF backend stores the full softmax's instead)."""
    lse = np.logaddexp.reduce(np.asarray(topk_logprobs, dtype=np.float64), axis=-1)
    return np.log(np.maximum(-np.expm1(lse), REST_MASS_FLOOR)).astype(np.float32)
