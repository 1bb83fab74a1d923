"""A teacher with its own tokenizer (``score.cross_tokenizer``), over any backend: the teacher scores
its own tokens of each response's text, mapped onto the student's tokens by character offsets
(:mod:`gndpo.stages.text.cross_tokenizer`), its log-probs given to the student's tokens span by span
and its top-k stored in the student's vocabulary where a token of the same text exists. Its numbers
come from the backend's :meth:`~gndpo.stages.teachers.base.TeacherBackend.columns`."""

from __future__ import annotations

import numpy as np

from gndpo.stages.scoring.forward import Scored, StudentForward, UnitRows, place
from gndpo.stages.teachers.base import mean_logprob, teacher_groups
from gndpo.stages.text.cross_tokenizer import CrossTokenizerTeacher


class OtherTokenizerTeacher:
    """The student's forward runs alone; each teacher scores its own tokens.

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
