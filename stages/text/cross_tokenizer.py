"""Scoring with a teacher whose tokenizer is not the student's (``score.cross_tokenizer: true``).

For each response: its text (the student's tokens decoded, special tokens left out) is tokenized by the
teacher after the teacher's own rendering of the prompt (its chat template), the teacher scores its
tokens in context, and its log-probs are given to the student's tokens span by span
(:mod:`gndpo.stages.text.align`): the smallest pieces of text whose edges both tokenizations share,
each student token getting its share of its span's log-ratio. A response that ended on the student's
end-of-turn or EOS token ends, for the teacher, on the teacher's own (its chat template's end-of-turn,
else its EOS), scored in context after the same text: the teacher teaches when to stop. Student tokens
left without a value (another special token, text the teacher's rendering lost) keep the student's own
log-prob as their teacher value (a score of 0) and are left out of every statistic and loss by the
``aligned`` mask score stores beside them.

With images, a vision-language teacher of another family reads each picture through its own processor
(its expansion in the prompt, its image tensors in the forward); a text-only teacher reads the
picture's information as text from its teacher context (:mod:`gndpo.stages.text.teacher_context`).
"""

from __future__ import annotations

import numpy as np
import torch

from gndpo.stages.text.align import Alignment, align_spans, token_offsets
from gndpo.stages.text.chat import end_of_turn_ids, stop_token_ids
from gndpo.stages.models.logprobs import chunks, head_logprobs, make_batch, response_hidden, token_budget_batches
from gndpo.stages.models.vision import image_inputs
from gndpo.stages.text.teacher_context import TeacherPrompts


@torch.no_grad()
def token_logprobs(model, batch, token_chunk: int) -> torch.Tensor:
    """The model's temperature-1 log-prob of every response token of ``batch``, flat [N], on the CPU."""
    hidden = response_hidden(model, batch)
    parts = [head_logprobs(model, hidden[sl]).gather(-1, batch.targets[sl].unsqueeze(-1)).squeeze(-1).cpu()
             for sl in chunks(batch.n_tokens, token_chunk)]
    return torch.cat(parts) if parts else torch.zeros(0)


class CrossTokenizerTeacher:
    """A teacher module with its own tokenizer, scoring responses written in the student's tokens."""

    def __init__(self, model, prompts: TeacherPrompts, student_tok, device, token_chunk: int, max_tokens: int, max_rows: int):
        """``prompts`` renders each prompt row as the teacher reads it (its chat template, its context)."""
        self.model, self.prompts, self.teacher_tok, self.student_tok = model, prompts, prompts.tok, student_tok
        self.device, self.token_chunk, self.max_tokens, self.max_rows = device, token_chunk, max_tokens, max_rows
        self.student_stops = set(stop_token_ids(student_tok, prompts.data))
        self.teacher_end = (end_of_turn_ids(self.teacher_tok, prompts.data) or [self.teacher_tok.eos_token_id])[0]

    def score(self, rows: list[dict], responses: list[np.ndarray], student_lp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(teacher value per student token, aligned 0/1, in a span of several student tokens 0/1), flat
        over ``responses`` in order; ``rows`` are their prompts' rows, ``student_lp`` the student's flat
        log-probs."""
        prompts, teacher_ids, alignments, ends = [], [], [], []
        for row, ids in zip(rows, responses):
            text, spans = token_offsets(self.student_tok, ids)
            enc = self.teacher_tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ended = len(ids) > 0 and int(ids[-1]) in self.student_stops and self.teacher_end is not None
            prompts.append(self.prompts.token_ids(row))
            teacher_ids.append(list(enc["input_ids"]) + ([self.teacher_end] if ended else []))
            alignments.append(align_spans(spans[:-1] if ended else spans, [tuple(o) for o in enc["offset_mapping"]]))
            ends.append(ended)
        teacher_lp = self._teacher_logprobs(prompts, teacher_ids, [self.prompts.images(row) for row in rows])
        offsets = np.cumsum([0] + [len(ids) for ids in responses])
        parts = [response_values(alignment, lps, student_lp[offsets[i] : offsets[i + 1]], ended)
                 for i, (alignment, lps, ended) in enumerate(zip(alignments, teacher_lp, ends))]
        if not parts:
            return np.zeros(0, np.float32), np.zeros(0, np.int8), np.zeros(0, np.int8)
        values, aligned, split = (np.concatenate(column) for column in zip(*parts))
        return values, aligned, split

    def _teacher_logprobs(self, prompts: list[list[int]], responses: list[list[int]], pictures: list[list]) -> list[list[float]]:
        """Per response, the teacher's log-prob of each of its own tokens, in token-budget batches;
        ``pictures[i]``: what response ``i``'s prompt shows the teacher (empty for a text teacher)."""
        out: list[list[float]] = [[] for _ in responses]
        pad = self.teacher_tok.pad_token_id or 0
        spans = np.array([len(p) + len(r) for p, r in zip(prompts, responses)])
        for rows in token_budget_batches(spans, self.max_tokens, self.max_rows):
            batch = make_batch([prompts[i] for i in rows], [responses[i] for i in rows], pad, self.device)
            if self.prompts.processor is not None:
                batch.images = image_inputs(self.prompts.processor, [pictures[i] for i in rows], self.device)
            flat = token_logprobs(self.model, batch, self.token_chunk).double().numpy()
            at = 0
            for i in rows:
                out[i] = flat[at : at + len(responses[i])].tolist()
                at += len(responses[i])
        return out


def response_values(alignment: Alignment, teacher_lp: list[float], student_lp: np.ndarray, ended: bool) -> tuple[np.ndarray, ...]:
    """One response's (teacher value, aligned, in a split span) per student token, from its alignment
    and the teacher's log-probs of its own tokens (the last one its end-of-turn where ``ended``)."""
    text_lp = teacher_lp[:-1] if ended else teacher_lp
    values = np.array(student_lp, dtype=np.float32)  # an unaligned token's score is 0
    aligned, split = np.zeros(len(values), dtype=np.int8), np.zeros(len(values), dtype=np.int8)
    for j, value in enumerate(alignment.teacher_values(text_lp, student_lp.tolist())):
        if value is not None:
            values[j], aligned[j] = value, 1
    split[: len(alignment.span_of)] = alignment.split
    if ended:  # the student's end-of-turn: the teacher's own, after the same text
        values[-1], aligned[-1] = teacher_lp[-1], 1
    return values, aligned, split
