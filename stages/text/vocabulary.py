"""Which tokens two vocabularies share (a teacher with another tokenizer, top-k divergences).

Two tokens match when they stand for the same text: each token's text is read by decoding it after a
fixed anchor token and cutting the anchor's text off, so that a leading space survives tokenizers whose
decoders strip one at the start of a text (SentencePiece) and byte-level vocabularies (GPT-2's ``Ġ``)
meet SentencePiece ones (``▁``) on the text itself, not on their internal spellings. Special tokens,
tokens with no text and tokens that decode to part of a character (a byte of a multi-byte UTF-8
sequence) match nothing, except that the teacher's end-of-turn and EOS match the student's: the two
models' ways to say "the response ends here" (for a base-model teacher, the first token of the text
that ends its turns, ``score.teacher_end_text``, matches the student's end-of-turn instead). Where
several tokens of one vocabulary share a text, the lowest id matches, so the match is one-to-one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gndpo.stages.text.chat import end_of_turn_ids

UNDECODABLE = "\ufffd"  # what a decoder writes for a byte that is only part of a character


@dataclass(frozen=True)
class VocabularyMatch:
    """``student_of[t]``: the student id with teacher token ``t``'s text, or -1; ``student_matched[s]``:
    whether student id ``s`` has a teacher twin (the rest of the student's vocabulary is its
    "unmatched" part, compared by sorted probabilities)."""

    student_of: np.ndarray  # [teacher vocabulary] int64
    student_matched: np.ndarray  # [student vocabulary] bool

    @property
    def matched(self) -> int:
        return int(self.student_matched.sum())


def token_texts(tok) -> list[str | None]:
    """Each id's text (None: a special token, no text, or part of a character), by decoding it after an
    anchor token."""
    anchor = tok("a", add_special_tokens=False)["input_ids"][:1]
    special = set(tok.all_special_ids) | {i for i, t in (getattr(tok, "added_tokens_decoder", {}) or {}).items() if t.special}
    prefix, *decoded = raw_decode(tok, [anchor] + [anchor + [i] for i in range(len(tok))])
    texts: list[str | None] = []
    for i, text in enumerate(decoded):
        text = text[len(prefix):] if text.startswith(prefix) else ""
        texts.append(None if i in special or not text or UNDECODABLE in text else text)
    return texts


def raw_decode(tok, sequences: list[list[int]]) -> list[str]:
    """``sequences`` decoded by the tokenizer's own (Rust) decoder where it has one: 4x faster than
    the Python wrapper at 262k sequences, and no clean-up of spaces around punctuation."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return tok.batch_decode(sequences, clean_up_tokenization_spaces=False)
    return backend.decode_batch(sequences, skip_special_tokens=False)


def match_vocabularies(student_tok, teacher_tok, data, teacher_end_text: str = "") -> VocabularyMatch:
    """The one-to-one match of the two tokenizers' tokens by text, end tokens paired (module docstring);
    ``data`` is the run's data config (which chat template, hence which end-of-turn token).
    ``teacher_end_text`` (score.teacher_end_text): the first teacher token of that text is the
    teacher's end of a turn, paired with the student's end-of-turn (else EOS) instead of its text twin."""
    first_student: dict[str, int] = {}
    for s, text in enumerate(token_texts(student_tok)):
        if text is not None:
            first_student.setdefault(text, s)
    student_of = np.full(len(teacher_tok), -1, dtype=np.int64)
    taken: set[int] = set()
    student_turn_end = end_of_turn_ids(student_tok, data)  # one rendering of the chat template, used twice
    student_end = (student_turn_end or [student_tok.eos_token_id])[0]
    text_end = teacher_tok(teacher_end_text, add_special_tokens=False)["input_ids"][:1] if teacher_end_text else []
    if text_end and student_end is not None:
        student_of[text_end[0]] = student_end
        taken.add(student_end)
    for t, text in enumerate(token_texts(teacher_tok)):
        s = first_student.get(text) if text is not None else None
        if s is not None and s not in taken and student_of[t] < 0:
            student_of[t] = s
            taken.add(s)
    for ends in ((end_of_turn_ids(teacher_tok, data), student_turn_end),
                 ([teacher_tok.eos_token_id], [student_tok.eos_token_id])):
        t, s = (ids[0] if ids and ids[0] is not None else None for ids in ends)
        if t is not None and s is not None and student_of[t] < 0 and s not in taken:
            student_of[t] = s
            taken.add(s)
    student_matched = np.zeros(len(student_tok), dtype=bool)
    student_matched[list(taken)] = True
    return VocabularyMatch(student_of, student_matched)
