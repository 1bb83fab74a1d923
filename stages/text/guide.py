"""Teacher-written prefixes for guided rollouts (``rollout.guided_fraction``, TrOPD's off-policy
guidance): the teacher samples the first tokens of a response and the student continues.

A teacher with the student's tokenizer reads the student's rendering of the prompt and its tokens are
the prefix. A teacher with its own (``score.cross_tokenizer``) reads the prompt through its own chat
template, samples its own tokens, and the prefix is their text in the student's tokens; a prefix that
ended on the teacher's end-of-turn or EOS ends on the student's. Sampling runs on the CPU with the
request's own generator, wherever the teacher runs, so a seed gives the same prefix on every machine.
"""

from __future__ import annotations

import torch

from gndpo.stages.text.chat import render_prompt, stop_token_ids, turn_end_id


class TeacherGuide:
    """Samples a guided prefix from the teacher module (see the module docstring)."""

    def __init__(self, model, student_tok, teacher_tok, data, max_tokens: int, temperature: float):
        """``teacher_tok``: the teacher's tokenizer, None where it is the student's; ``max_tokens``:
        the prefix's length limit, in the teacher's tokens and then in the student's."""
        self.model, self.student_tok, self.teacher_tok, self.data = model, student_tok, teacher_tok, data
        self.max_tokens, self.temperature = max_tokens, temperature
        self.student_stops = stop_token_ids(student_tok, data)
        self.teacher_stops = stop_token_ids(teacher_tok, data) if teacher_tok is not None else self.student_stops
        self.student_end = turn_end_id(student_tok, data)

    def prefix(self, row: dict, student_prompt: list[int], seed: int) -> tuple[list[int], bool]:
        """(the prefix in the student's tokens, whether it ends the response) for prompt ``row``, which
        the student reads as ``student_prompt``."""
        if self.teacher_tok is None:
            ids = self.sample(student_prompt, seed)
            return ids, bool(ids) and ids[-1] in self.student_stops
        ids = self.sample(render_prompt(self.teacher_tok, row, self.data).token_ids, seed)
        ended = bool(ids) and ids[-1] in self.teacher_stops
        text = self.teacher_tok.decode(ids, skip_special_tokens=True)
        student = self.student_tok(text, add_special_tokens=False)["input_ids"][: self.max_tokens - int(ended)]
        return student + ([self.student_end] if ended else []), ended

    @torch.no_grad()
    def sample(self, prompt: list[int], seed: int) -> list[int]:
        """Up to ``max_tokens`` teacher tokens after ``prompt``, stopping after an end token."""
        gen = torch.Generator().manual_seed(seed)
        out: list[int] = []
        for _ in range(self.max_tokens):
            context = torch.tensor([prompt + out], device=self.model.device)
            logits = self.model(input_ids=context, logits_to_keep=1).logits[0, -1].float()
            probs = torch.softmax(logits / max(self.temperature, 1e-6), dim=-1).cpu()
            out.append(int(torch.multinomial(probs, 1, generator=gen)))
            if out[-1] in self.teacher_stops:
                break
        return out
