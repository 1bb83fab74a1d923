"""Span alignment of two tokenizations of one text (stages/text/align.py), on hand-made strings, against
sums written out by hand: a span's teacher value is the sum of its teacher tokens' log-probs, and each
of its student tokens gets its own log-prob plus an equal share of (teacher sum - student sum)."""

import pytest

from gndpo.stages.text.align import Span, align_spans


def spans(pieces: list[str]) -> list[tuple[int, int]]:
    """The (start, end) offsets of consecutive pieces of one text; "" is a token with no text."""
    out, at = [], 0
    for p in pieces:
        out.append((at, at + len(p)))
        at += len(p)
    return out


def test_teacher_tokens_inside_a_student_token_are_summed():
    # "1234" as one student token; the teacher splits it "12" + "34".
    a = align_spans(spans(["1234"]), spans(["12", "34"]))
    assert a.spans == [Span((0,), (0, 1))] and a.span_of == [0]
    assert a.teacher_values([-0.5, -1.25], [-3.0]) == [-1.75]


def test_one_to_one_tokens_are_their_own_spans():
    a = align_spans(spans(["a", "b", "c"]), spans(["a", "b", "c"]))
    assert a.span_of == [0, 1, 2] and a.aligned == 3 and sum(a.split) == 0
    assert a.teacher_values([-1.0, -2.0, -3.0], [-9.0, -9.0, -9.0]) == [-1.0, -2.0, -3.0]


def test_a_teacher_token_across_student_tokens_makes_one_span_whose_ratio_they_share():
    # Student "1","2","3","4"; teacher "12","34": spans "12" and "34", two student tokens each.
    a = align_spans(spans(["1", "2", "3", "4"]), spans(["12", "34"]))
    assert a.spans == [Span((0, 1), (0,)), Span((2, 3), (1,))] and sum(a.split) == 4
    student, teacher = [-1.0, -0.5, -2.0, -0.25], [-1.0, -3.0]
    values = a.teacher_values(teacher, student)
    # span "12": T = -1.0, S = -1.5, each token + 0.25; span "34": T = -3.0, S = -2.25, each - 0.375
    assert values == pytest.approx([-0.75, -0.25, -2.375, -0.625])
    for span, t in zip(a.spans, teacher):  # the per-token scores add up to the span's log-ratio
        assert sum(values[j] - student[j] for j in span.student) == pytest.approx(t - sum(student[j] for j in span.student))


def test_crossing_tokens_chain_into_one_span():
    # Student "ab" | "cd" | "e"; teacher "a" | "bc" | "d" | "e": the only shared inner boundary is
    # after "abcd", so "ab"+"cd" is one span (teacher "a","bc","d") and "e" another.
    a = align_spans(spans(["ab", "cd", "e"]), spans(["a", "bc", "d", "e"]))
    assert a.spans == [Span((0, 1), (0, 1, 2)), Span((2,), (3,))]
    values = a.teacher_values([-1.0, -2.0, -0.5, -0.1], [-1.0, -1.0, -0.2])
    assert values == pytest.approx([-1.0 + (-3.5 + 2.0) / 2, -1.0 + (-3.5 + 2.0) / 2, -0.1])
    # Student "hello", " world"; teacher "hel", "lo", " wor", "ld".
    b = align_spans(spans(["hello", " world"]), spans(["hel", "lo", " wor", "ld"]))
    assert b.teacher_values([-1.0, -2.0, -0.5, -0.25], [-7.0, -7.0]) == [-3.0, -0.75]


def test_tokens_without_text_have_no_span():
    # A student special token (no text) and a teacher template token (no text) in the middle.
    a = align_spans(spans(["12", "3", ""]), [(0, 2), (2, 2), (2, 3), (3, 3)])
    assert a.span_of == [0, 1, None] and a.spans == [Span((0,), (0,)), Span((1,), (2,))]


def test_offsets_with_gaps_are_placed_by_where_tokens_end():
    # A SentencePiece-style teacher whose offsets leave the leading space out: " b" is (2, 3), not (1, 3).
    a = align_spans(spans(["a", " b"]), [(0, 1), (2, 3)])
    assert a.span_of == [0, 1]


def test_teacher_text_that_ends_early_leaves_the_rest_unaligned():
    # The teacher's rendering stops after "ab" (a truncated response): "c" has no teacher token.
    a = align_spans(spans(["ab", "c"]), spans(["a", "b"]))
    assert a.span_of == [0, None]
    assert a.teacher_values([-1.0, -2.0], [-0.5, -0.5]) == [-3.0, None]
