"""Character-offset alignment of two tokenizations of one text (stages/text/align.py), on hand-made strings."""

from gndpo.stages.text.align import align_by_offsets


def spans(pieces: list[str]) -> list[tuple[int, int]]:
    """The (start, end) offsets of consecutive pieces of one text; "" is a token with no text."""
    out, at = [], 0
    for p in pieces:
        out.append((at, at + len(p)))
        at += len(p)
    return out


def test_teacher_tokens_inside_a_student_token_are_summed():
    # "1234" as one student token; the teacher splits it "12" + "34".
    a = align_by_offsets(spans(["1234"]), spans(["12", "34"]))
    assert a.groups == [(0, 1)]
    assert a.teacher_values([-0.5, -1.25]) == [-1.75]


def test_one_to_one_tokens_align_each():
    a = align_by_offsets(spans(["a", "b", "c"]), spans(["a", "b", "c"]))
    assert a.groups == [(0,), (1,), (2,)] and a.aligned == 3


def test_a_teacher_token_across_student_tokens_aligns_neither():
    # Student "1","2","3","4"; teacher merges digit pairs "12","34": no student token is covered exactly.
    a = align_by_offsets(spans(["1", "2", "3", "4"]), spans(["12", "34"]))
    assert a.groups == [None, None, None, None] and a.aligned == 0


def test_split_across_a_boundary_spoils_only_the_tokens_it_touches():
    # Student "ab" | "cd" | "e"; teacher "a" | "bc" | "d" | "e": "bc" crosses the first boundary.
    a = align_by_offsets(spans(["ab", "cd", "e"]), spans(["a", "bc", "d", "e"]))
    assert a.groups == [None, None, (3,)]
    # Student "hello", " world"; teacher "hel", "lo", " wor", "ld".
    b = align_by_offsets(spans(["hello", " world"]), spans(["hel", "lo", " wor", "ld"]))
    assert b.groups == [(0, 1), (2, 3)]
    assert b.teacher_values([-1.0, -2.0, -0.5, -0.25]) == [-3.0, -0.75]


def test_tokens_without_text_never_align():
    # A student end-of-turn token (no text), and a teacher template token (no text) in the middle.
    student = spans(["12", "3", ""])
    teacher = [(0, 2), (2, 2), (2, 3), (3, 3)]
    a = align_by_offsets(student, teacher)
    assert a.groups == [(0,), (2,), None]


def test_mixed_merges_like_a_digit_pair_tokenizer():
    # A teacher that merges some digit pairs: "9", "01", "7" over the student's single digits.
    a = align_by_offsets(spans(["9", "0", "1", "7"]), spans(["9", "01", "7"]))
    assert a.groups == [(0,), None, None, (2,)] and a.aligned == 2


def test_teacher_text_that_ends_early_leaves_the_rest_unaligned():
    # The teacher's rendering stops after "ab" (a truncated response): "c" has nothing inside it.
    a = align_by_offsets(spans(["ab", "c"]), spans(["a", "b"]))
    assert a.groups == [(0, 1), None]
