"""Aligning a teacher's tokens with the student's over the same text (a teacher with another tokenizer).

Both tokenizers cut the same response text. The text is split into the smallest **spans** whose edges
are token boundaries of both tokenizations: a span holds one or more student tokens and one or more
teacher tokens, and no token of either side crosses its edges. By the chain rule the teacher's
log-probability of a span's text is the sum ``T`` of its teacher tokens' log-probs in context, the
student's the sum ``S`` of its own. Each of the span's ``k`` student tokens gets the teacher value

    teacher_j = student_j + (T - S) / k

so the per-token differences ``teacher_j - student_j`` (the score every method reads) add up, over the
span, to the span's log-ratio ``T - S``, and over a response to the sequence's: no student token is
left without a signal, and a span of one student token (most of them) gets ``T`` itself. Merging the
tokens of a span so that none is dropped follows TRL's GOLD trainer (its span alignment for teachers of
another tokenizer); sharing the span's log-ratio equally among its student tokens is gndpo's choice
(the chain rule fixes only the sum).

A token with no text has no span: the student's end-of-turn or EOS is matched by the caller with the
teacher's own (:mod:`gndpo.stages.text.cross_tokenizer`), teacher tokens with no text (its template's
special tokens) are never part of a span, and any other student token without text stays unaligned.
A span with no teacher token (a teacher text that stops early) leaves its student tokens unaligned.

Offsets are (start, end) character positions in the response text, as fast tokenizers return them with
``return_offsets_mapping``. Tokens are placed in spans by where they end, which tolerates tokenizers
whose offsets leave gaps (a leading space outside a SentencePiece token's offsets).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """The student tokens and the teacher tokens (indices) of one span of the text."""

    student: tuple[int, ...]
    teacher: tuple[int, ...]


@dataclass(frozen=True)
class Alignment:
    """The spans of one response, and per student token the index of its span (None: unaligned)."""

    spans: list[Span]
    span_of: list[int | None]

    @property
    def aligned(self) -> int:
        return sum(s is not None for s in self.span_of)

    @property
    def split(self) -> list[bool]:
        """Per student token: whether it shares its span with other student tokens (its value is a share)."""
        return [s is not None and len(self.spans[s].student) > 1 for s in self.span_of]

    def teacher_values(self, teacher_logprobs: list[float], student_logprobs: list[float]) -> list[float | None]:
        """Each student token's teacher value (module docstring), None where it is unaligned."""
        shift = []
        for span in self.spans:
            teacher = sum(teacher_logprobs[i] for i in span.teacher)
            student = sum(student_logprobs[j] for j in span.student)
            shift.append((teacher - student) / len(span.student))
        return [None if s is None else float(student_logprobs[j] + shift[s]) for j, s in enumerate(self.span_of)]


def align_spans(student: list[tuple[int, int]], teacher: list[tuple[int, int]]) -> Alignment:
    """The spans shared by ``student`` and ``teacher`` token offsets over the same text."""
    student_ends = [end for start, end in student if end > start]
    teacher_ends = [end for start, end in teacher if end > start]
    if not student_ends or not teacher_ends:
        return Alignment([], [None] * len(student))
    edges = sorted(set(student_ends) & set(teacher_ends))
    if edges[-1] < max(student_ends):  # the student's tail past the teacher's last shared boundary
        edges.append(max(student_ends))
    members: list[tuple[list[int], list[int]]] = [([], []) for _ in edges]
    for side, offsets in enumerate((student, teacher)):
        for i, (start, end) in enumerate(offsets):
            if end > start and (k := bisect_left(edges, end)) < len(edges):
                members[k][side].append(i)
    spans, span_of = [], [None] * len(student)
    for student_tokens, teacher_tokens in members:
        if student_tokens and teacher_tokens:
            for j in student_tokens:
                span_of[j] = len(spans)
            spans.append(Span(tuple(student_tokens), tuple(teacher_tokens)))
    return Alignment(spans, span_of)


def token_offsets(tok, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """(the text of ``ids`` without special tokens, each token's (start, end) in it). Special tokens get
    an empty span where they stand. The text is re-tokenized with offsets; where that does not give
    back ``ids`` (a non-canonical tokenization), each token's span is found by decoding prefixes."""
    special = set(tok.all_special_ids)
    ids = [int(t) for t in ids]
    text = tok.decode(ids, skip_special_tokens=True)
    plain = [t for t in ids if t not in special]
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) == plain:
        spans, out, at = iter(enc["offset_mapping"]), [], 0
        for t in ids:
            if t in special:
                out.append((at, at))
            else:
                start, at = next(spans)
                out.append((start, at))
        return text, out
    out, at = [], 0
    for j in range(len(ids)):
        end = max(len(tok.decode(ids[: j + 1], skip_special_tokens=True)), at)
        out.append((at, end))
        at = end
    return text, out
