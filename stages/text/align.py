"""Aligning a teacher's tokens with the student's by character offsets (a teacher with another tokenizer).

Both tokenizers cut the same response text. For each student token the teacher tokens that lie inside
its character span are found; when they cover the span exactly (first starts where it starts, last ends
where it ends, no gap) the student token is *aligned* and its teacher log-prob is their sum (the chain
rule: the teacher's probability of that piece of text). Otherwise, a teacher token that crosses the
student token's edges, or a student token with no text (a special token), it is not aligned: score
gives it no teacher value and train no policy-gradient signal, and the count is reported. Teacher tokens
with no text (its template's special tokens) never align with anything.

Offsets are (start, end) character positions in the response text, as fast tokenizers return them with
``return_offsets_mapping``. Score uses it with ``score.cross_tokenizer: true``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Alignment:
    """Per student token: the indices of the teacher tokens whose log-probs sum to its teacher value,
    or None where it does not align."""

    groups: list[tuple[int, ...] | None]

    @property
    def aligned(self) -> int:
        return sum(g is not None for g in self.groups)

    def teacher_values(self, teacher_logprobs: list[float]) -> list[float | None]:
        """The teacher's log-prob of each student token (the sum over its group), None where unaligned."""
        return [None if g is None else float(sum(teacher_logprobs[i] for i in g)) for g in self.groups]


def align_by_offsets(student: list[tuple[int, int]], teacher: list[tuple[int, int]]) -> Alignment:
    """The alignment of ``student`` token spans with ``teacher`` token spans over the same text."""
    spans = [(start, end, i) for i, (start, end) in enumerate(teacher) if end > start]
    spans.sort()
    groups: list[tuple[int, ...] | None] = []
    k = 0  # first teacher span that may still start inside the current student token
    for start, end in student:
        if end <= start:
            groups.append(None)
            continue
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        inside, position, j = [], start, k
        while j < len(spans) and spans[j][0] < end:
            t_start, t_end, index = spans[j]
            if t_start != position or t_end > end:  # a gap, or a teacher token crossing the edge
                inside = None
                break
            inside.append(index)
            position = t_end
            j += 1
        groups.append(tuple(inside) if inside and position == end else None)
    return Alignment(groups)


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
