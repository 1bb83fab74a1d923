"""Scoring with a teacher whose tokenizer is not the student's (``score.cross_tokenizer: true``).

For each response: its text (the student's tokens decoded, special tokens left out) is tokenized by the
teacher after the teacher's own rendering of the prompt (its chat template), the teacher scores its
tokens in context, and its log-probs are mapped onto the student's tokens by character offsets
(:mod:`gndpo.stages.text.align`): a student token whose characters are covered exactly by teacher tokens gets
the sum of their log-probs; any other (a teacher token crossing its edges, a special token such as the
end-of-turn, text the teacher's tokenizer cut differently) is marked unaligned, gets the student's own
log-prob as its teacher value (a score of 0) and is left out of every statistic and loss by the
``aligned`` mask score stores beside it.

With images, a vision-language teacher of another family reads each picture through its own processor
(its expansion in the prompt, its image tensors in the forward); a text-only teacher reads the
picture's information as text from its teacher context (:mod:`gndpo.stages.text.teacher_context`).
"""

from __future__ import annotations

import numpy as np
import torch

from gndpo.stages.text.align import align_by_offsets, token_offsets
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

    def score(self, rows: list[dict], responses: list[np.ndarray], student_lp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(teacher log-prob per student token, aligned 0/1 per student token), flat over ``responses``
        in order; ``rows`` are their prompts' rows, ``student_lp`` the student's flat log-probs."""
        prompts, teacher_ids, alignments = [], [], []
        for row, ids in zip(rows, responses):
            text, spans = token_offsets(self.student_tok, ids)
            enc = self.teacher_tok(text, add_special_tokens=False, return_offsets_mapping=True)
            prompts.append(self.prompts.token_ids(row))
            teacher_ids.append(list(enc["input_ids"]))
            alignments.append(align_by_offsets(spans, [tuple(o) for o in enc["offset_mapping"]]))
        teacher_lp = self._teacher_logprobs(prompts, teacher_ids, [self.prompts.images(row) for row in rows])
        values, aligned = np.array(student_lp, dtype=np.float32), np.zeros(len(student_lp), dtype=np.int8)
        at = 0
        for alignment, lps in zip(alignments, teacher_lp):
            for j, value in enumerate(alignment.teacher_values(lps)):
                if value is not None:
                    values[at + j], aligned[at + j] = value, 1
            at += len(alignment.groups)
        return values, aligned

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
