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
``aligned`` mask score stores beside them. A multi-turn response is cut into pieces: each student turn
is aligned on its own, and between turns the teacher reads each tool's answer through its own chat
template (those tokens stay masked, with no value).

With a top-k divergence, the teacher's top-k at each span's first position (its next-token
distribution after the same text as the student's at the span's first token) is stored with the student
id of each token's text (:mod:`gndpo.stages.text.vocabulary`), or as a token without a student twin;
positions inside a span of several student tokens have no teacher distribution after the same text and
store no entry (their divergence is 0: docs/reference/methods.md, "Top-k divergences across vocabularies").

With images, a vision-language teacher of another family reads each picture through its own processor
(its expansion in the prompt, its image tensors in the forward); a text-only teacher reads the
picture's information as text from its teacher context (:mod:`gndpo.stages.text.teacher_context`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np

from gndpo.errors import GndpoError
from gndpo.pipeline.methods.losses import LOGP_FLOOR, NO_ENTRY_ID, UNMATCHED_ID
from gndpo.stages.models.batches import make_batch, token_budget_batches
from gndpo.stages.models.logprobs import pair_token_stats
from gndpo.stages.models.vision import image_inputs
from gndpo.stages.text.align import Alignment, align_spans, token_offsets
from gndpo.stages.text.chat import stop_token_ids, tool_turn_ids, turn_end_id
from gndpo.stages.text.teacher_context import TeacherPrompts
from gndpo.stages.text.vocabulary import VocabularyMatch, match_vocabularies

TOPK_COLUMNS = ("teacher_topk_ids", "teacher_topk_logprobs", "teacher_rest_logprob")


@dataclass
class CrossScores:
    """Flat over the student's response tokens: each token's teacher value, 1 where it has one
    (``aligned``), 1 where that value is a share of a span of several student tokens (``split``), and
    with a top-k the teacher's top-k columns (``topk``: TOPK_COLUMNS, ids in the student's vocabulary)."""

    values: np.ndarray
    aligned: np.ndarray
    split: np.ndarray
    topk: dict[str, np.ndarray] = field(default_factory=dict)


class TeacherColumns(Protocol):
    """Where a cross-tokenizer teacher's numbers come from: its module (:class:`TeacherModule`) or its
    vLLM engine (gndpo.stages.scoring.teachers)."""

    def columns(self, rows: list[dict], responses: list[list[int]], topk: int) -> list[dict]:
        """Per response (in the teacher's own tokens, after prompt row ``rows[i]`` as the teacher
        renders it), the teacher's numbers at each of its tokens: ``teacher_logprobs`` [n] and, with
        ``topk``, ``teacher_topk_ids`` / ``teacher_topk_logprobs`` [n, k] and ``teacher_rest_logprob`` [n]."""


class CrossTokenizerTeacher:
    """A teacher with its own tokenizer, scoring responses written in the student's tokens."""

    def __init__(self, teacher: TeacherColumns, prompts: TeacherPrompts, student_tok, end_text: str = ""):
        """``prompts`` renders each prompt row as the teacher reads it (its chat template, its context);
        ``end_text`` (score.teacher_end_text): the text that ends a turn for the teacher, if not its
        end-of-turn token (else EOS)."""
        self.teacher, self.prompts, self.teacher_tok, self.student_tok = teacher, prompts, prompts.tok, student_tok
        self.student_stops = set(stop_token_ids(student_tok, prompts.data))
        self.end_text = end_text
        if end_text:
            self.teacher_end = list(self.teacher_tok(end_text, add_special_tokens=False)["input_ids"])
        else:
            end = turn_end_id(self.teacher_tok, prompts.data)
            self.teacher_end = [end] if end is not None else []

    @cached_property
    def vocabulary(self) -> VocabularyMatch:
        """The two vocabularies' shared tokens (built on first use: about a second for a 262k vocabulary)."""
        return match_vocabularies(self.student_tok, self.teacher_tok, self.prompts.data, self.end_text)

    def score(self, rows: list[dict], responses: list[np.ndarray], student_lp: np.ndarray, topk: int = 0,
              masks: list[np.ndarray] | None = None, tool_results: list[list[str]] | None = None) -> CrossScores:
        """The teacher's columns of ``responses`` (:class:`CrossScores`), flat in order; ``rows`` are
        their prompts' rows, ``student_lp`` the student's flat log-probs, ``topk`` the teacher top-k
        to store (0: none). Multi-turn responses: ``masks`` (each response's loss mask) and
        ``tool_results`` (the text of each executed tool call) say where the tool turns are."""
        pieces = [self.pieces(row, np.asarray(ids), masks[i] if masks else None, tool_results[i] if tool_results else [])
                  for i, (row, ids) in enumerate(zip(rows, responses))]
        teacher = self.teacher.columns(rows, [[t for piece in p for t in piece.teacher] for p in pieces], topk)
        offsets = np.cumsum([0] + [len(ids) for ids in responses])
        parts = [piece_columns(p, columns, student_lp[offsets[i] : offsets[i + 1]], topk and self.vocabulary)
                 for i, (p, columns) in enumerate(zip(pieces, teacher))]
        if not parts:
            return CrossScores(np.zeros(0, np.float32), np.zeros(0, np.int8), np.zeros(0, np.int8))
        values, aligned, split, *top = (np.concatenate(column) for column in zip(*parts))
        return CrossScores(values, aligned, split, dict(zip(TOPK_COLUMNS, top)))

    def pieces(self, row: dict, ids: np.ndarray, mask: np.ndarray | None, tool_results: list[str]) -> list[Piece]:
        """One response cut into the student's own text (a guided prefix included) and the tool turns
        (the loss-masked runs after its first trained token), each with the teacher tokens that stand
        for it: the teacher's tokens of the same text, closed by its end token where the student's end
        token closed the response, or the teacher's own rendering of the tool's answer."""
        mask = np.ones(len(ids), np.int8) if mask is None else np.asarray(mask)
        trained = np.flatnonzero(mask)
        tool = np.zeros(len(ids), bool)
        if len(trained):
            tool[trained[0]:] = mask[trained[0]:] == 0
        edges = [0, *np.flatnonzero(np.diff(tool.astype(np.int8))) + 1, len(ids)]
        runs = [range(a, b) for a, b in zip(edges, edges[1:]) if b > a]
        # A tool turn cut to nothing by the response budget leaves a result without a run: the last one.
        tool_turns = sum(tool[r.start] for r in runs)
        if tool_turns > len(tool_results):
            raise GndpoError(f"a response has {tool_turns} tool turns but {len(tool_results)} tool results")
        answers = iter(tool_results)
        out = []
        for k, run in enumerate(runs):
            if tool[run.start]:
                out.append(Piece(run, tool_turn_ids(self.teacher_tok, row, self.prompts.data, next(answers)), None))
                continue
            text, spans = token_offsets(self.student_tok, ids[run.start : run.stop])
            enc = self.teacher_tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ended = k == len(runs) - 1 and int(ids[run.stop - 1]) in self.student_stops and bool(self.teacher_end)
            alignment = align_spans(spans[:-1] if ended else spans, [tuple(o) for o in enc["offset_mapping"]])
            end = self.teacher_end if ended else []
            out.append(Piece(run, list(enc["input_ids"]) + end, alignment, len(end)))
        return out


@dataclass(frozen=True)
class Piece:
    """A run of a response's student tokens and the teacher tokens that stand for it: the student's own
    text (``alignment``: its spans; ``end_tokens``: how many teacher tokens at the end stand for the
    student's end token that closed the response, 0 if none did) or a tool turn (``alignment`` None:
    loss-masked, no teacher values)."""

    student: range
    teacher: list[int]
    alignment: Alignment | None
    end_tokens: int = 0


def piece_columns(pieces: list[Piece], teacher: dict, student_lp: np.ndarray, vocabulary: VocabularyMatch | None) -> tuple[np.ndarray, ...]:
    """One response's (teacher value, aligned, split) per student token, and with ``vocabulary`` its
    top-k columns, from its pieces and the teacher's numbers at the pieces' teacher tokens in order."""
    n = len(student_lp)
    values, aligned, split = np.array(student_lp, dtype=np.float32), np.zeros(n, np.int8), np.zeros(n, np.int8)
    top = None
    if vocabulary:
        k = teacher["teacher_topk_ids"].shape[-1]
        top = [np.full((n, k), NO_ENTRY_ID, np.int32), np.full((n, k), LOGP_FLOOR, np.float32), np.zeros(n, np.float32)]
    at = 0
    for piece in pieces:
        own = {name: column[at : at + len(piece.teacher)] for name, column in teacher.items()}
        at += len(piece.teacher)
        if piece.alignment is None:  # a tool turn: masked, no values
            continue
        where = slice(piece.student.start, piece.student.stop)
        values[where], aligned[where], split[where] = response_values(piece.alignment, own["teacher_logprobs"], student_lp[where], piece.end_tokens)
        if top is not None:
            for column, part in zip(top, response_topk(piece.alignment, own, len(piece.student), piece.end_tokens, vocabulary)):
                column[where] = part
    return (values, aligned, split, *(top or ()))


class TeacherModule:
    """A cross-tokenizer teacher's numbers from its Hugging Face module (``score.backend: hf``), in
    token-budget batches."""

    def __init__(self, model, prompts: TeacherPrompts, device, token_chunk: int, max_tokens: int, max_rows: int):
        self.model, self.prompts, self.device = model, prompts, device
        self.token_chunk, self.max_tokens, self.max_rows = token_chunk, max_tokens, max_rows

    def columns(self, rows: list[dict], responses: list[list[int]], topk: int) -> list[dict]:
        """See :class:`TeacherColumns`. Each prompt shows the teacher its pictures, through its own
        processor (none for a text teacher)."""
        prompts = [self.prompts.token_ids(row) for row in rows]
        out: list[dict] = [{} for _ in responses]
        pad = self.prompts.tok.pad_token_id or 0
        spans = np.array([len(p) + len(r) for p, r in zip(prompts, responses)])
        for batch_rows in token_budget_batches(spans, self.max_tokens, self.max_rows):
            batch = make_batch([prompts[i] for i in batch_rows], [responses[i] for i in batch_rows], pad, self.device)
            if self.prompts.processor is not None:
                batch.images = image_inputs(self.prompts.processor, [self.prompts.images(rows[i]) for i in batch_rows], self.device)
            flat = {name: values.double().numpy() if values.is_floating_point() else values.numpy()
                    for name, values in pair_token_stats(self.model, None, batch, self.token_chunk, 1.0, topk).items()}
            at = 0
            for i in batch_rows:
                out[i] = {name: values[at : at + len(responses[i])] for name, values in flat.items()}
                at += len(responses[i])
        return out


def response_values(alignment: Alignment, teacher_lp, student_lp: np.ndarray, end_tokens: int) -> tuple[np.ndarray, ...]:
    """One response's (teacher value, aligned, in a split span) per student token, from its alignment
    and the teacher's log-probs of its own tokens, the last ``end_tokens`` of them its end of the turn
    (0: the response did not end on the student's end token)."""
    teacher_lp = [float(v) for v in teacher_lp]
    text_lp = teacher_lp[: len(teacher_lp) - end_tokens]
    values = np.array(student_lp, dtype=np.float32)  # an unaligned token's score is 0
    aligned, split = np.zeros(len(values), dtype=np.int8), np.zeros(len(values), dtype=np.int8)
    for j, value in enumerate(alignment.teacher_values(text_lp, student_lp.tolist())):
        if value is not None:
            values[j], aligned[j] = value, 1
    split[: len(alignment.span_of)] = alignment.split
    if end_tokens:  # the student's end-of-turn: the teacher's own, after the same text
        values[-1], aligned[-1] = sum(teacher_lp[len(text_lp):]), 1
    return values, aligned, split


def response_topk(alignment: Alignment, teacher: dict, n_student: int, end_tokens: int, vocabulary: VocabularyMatch) -> tuple[np.ndarray, ...]:
    """One response's teacher top-k per student token ([n, k] ids in the student's vocabulary, [n, k]
    log-probs, [n] rest), from the teacher's own top-k at its tokens (``teacher``: one response's
    :meth:`TeacherColumns.columns`, the last ``end_tokens`` standing for the student's end token):
    each span's first student token gets the teacher's distribution at the span's first teacher token
    (both predict the text after the same prefix), an ended response's last token the teacher's at its
    first end token; every other token no entry."""
    k = teacher["teacher_topk_ids"].shape[-1]
    ids = np.full((n_student, k), NO_ENTRY_ID, dtype=np.int32)
    logprobs = np.full((n_student, k), LOGP_FLOOR, dtype=np.float32)
    rest = np.zeros(n_student, dtype=np.float32)  # no entry: all of the mass in the rest (log 1)
    pairs = [(span.student[0], span.teacher[0]) for span in alignment.spans]
    if end_tokens:
        pairs.append((n_student - 1, len(teacher["teacher_logprobs"]) - end_tokens))
    if not pairs:
        return ids, logprobs, rest
    students, teachers = (np.array(side) for side in zip(*pairs))
    teacher_ids = teacher["teacher_topk_ids"][teachers].astype(np.int64)
    known = teacher_ids < len(vocabulary.student_of)  # an output row past the tokenizer's ids has no text
    twin = vocabulary.student_of[np.where(known, teacher_ids, 0)]
    ids[students] = np.where(known & (twin >= 0), twin, UNMATCHED_ID)
    logprobs[students] = teacher["teacher_topk_logprobs"][teachers]
    rest[students] = teacher["teacher_rest_logprob"][teachers]
    return ids, logprobs, rest
