"""Top-k divergences against a teacher of another vocabulary, on small tensors and small tokenizers:
the loss against a re-derivation written out bucket by bucket, the vocabulary match of a byte-level
BPE and a SentencePiece-style tokenizer, where a span's teacher top-k lands, and the student's largest
log-probs over its unmatched tokens."""

import math

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gndpo.pipeline.methods.losses import NO_ENTRY_ID, UNMATCHED_ID, OtherVocabulary, other_vocabulary_divergence
from gndpo.pipeline.settings.schema import DataConfig
from gndpo.stages.models.batches import make_batch
from gndpo.stages.models.logprobs import policy_token_logprobs
from gndpo.stages.text.align import Alignment, Span
from gndpo.stages.text.cross_tokenizer import response_topk
from gndpo.stages.text.vocabulary import VocabularyMatch, match_vocabularies
from tests.realistic import ShapeSpec, new_model


def expected_divergence(kind, ids, teacher_lp, teacher_rest, student_all, student_unmatched, beta, uld_weight):
    """One position, written out: the buckets are the matched ids plus one rest each (the teacher's
    rest holds its unmatched top-k entries too); ULD compares the sorted unmatched probabilities."""
    matched = [i for i, t in enumerate(ids) if t >= 0]
    unmatched = [i for i, t in enumerate(ids) if t == UNMATCHED_ID]
    if not matched and not unmatched:
        return 0.0
    p_s_all = np.exp(student_all)
    pt = [math.exp(teacher_lp[i]) for i in matched]
    ps = [p_s_all[ids[i]] for i in matched]
    pt.append(math.exp(teacher_rest) + sum(math.exp(teacher_lp[i]) for i in unmatched))
    ps.append(max(1.0 - sum(ps), 1e-12))
    pt, ps = np.array(pt), np.array(ps)
    if kind == "forward_kl":
        d = float(np.sum(pt * np.log(pt / ps)))
    elif kind == "reverse_kl":
        d = float(np.sum(ps * np.log(ps / pt)))
    else:
        m = beta * pt + (1 - beta) * ps
        d = float(beta * np.sum(pt * np.log(pt / m)) + (1 - beta) * np.sum(ps * np.log(ps / m)))
    teacher_sorted = sorted((math.exp(teacher_lp[i]) for i in unmatched), reverse=True)
    student_sorted = sorted(p_s_all[student_unmatched], reverse=True) + [0.0] * len(teacher_sorted)
    return d + uld_weight * sum(abs(a - b) for a, b in zip(teacher_sorted, student_sorted))


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_the_divergence_equals_a_bucket_by_bucket_rederivation(kind):
    gen = torch.Generator().manual_seed(3)
    n, k, vocab = 7, 4, 9
    student_unmatched = np.zeros(vocab, dtype=bool)
    student_unmatched[[6, 7, 8]] = True  # student ids with no teacher twin
    student_all = torch.log_softmax(torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    teacher_full = torch.log_softmax(torch.randn(n, k + 3, generator=gen, dtype=torch.float64) * 2, -1)
    teacher_lp = teacher_full[:, :k]
    teacher_rest = torch.logsumexp(teacher_full[:, k:], -1)
    ids = torch.tensor([[0, 1, 2, 3], [4, UNMATCHED_ID, 5, UNMATCHED_ID], [UNMATCHED_ID] * 4, [NO_ENTRY_ID] * 4,
                        [3, 0, UNMATCHED_ID, 1], [5, 4, 3, 2], [UNMATCHED_ID, 2, NO_ENTRY_ID, NO_ENTRY_ID]])
    masked = student_all.masked_fill(~torch.from_numpy(student_unmatched), -math.inf)
    largest = masked.topk(k, -1).values  # 3 unmatched ids: the 4th is -inf
    student = student_all.clone().requires_grad_(True)
    at_ids = student.gather(-1, ids.clamp(min=0))
    largest = torch.where(torch.isfinite(largest), student.masked_fill(~torch.from_numpy(student_unmatched), -math.inf).topk(k, -1).values, largest)
    got = other_vocabulary_divergence(kind, at_ids, teacher_lp, teacher_rest, OtherVocabulary(ids, largest, 0.7), beta=0.3)
    for i in range(n):
        want = expected_divergence(kind, ids[i].tolist(), teacher_lp[i].tolist(), float(teacher_rest[i]), student_all[i].numpy(),
                                   student_unmatched, 0.3, 0.7)
        assert float(got[i].detach()) == pytest.approx(want, rel=1e-9, abs=1e-12), i
    got.sum().backward()
    assert float(got[3].detach()) == 0.0 and torch.all(student.grad[3] == 0)  # no entry: no loss, no gradient
    assert torch.any(student.grad[2] != 0)  # unmatched only: the sorted term still teaches


def test_matching_a_byte_level_bpe_and_a_sentencepiece_style_vocabulary():
    """GPT-2-style "Ġthe" and SentencePiece-style "▁the" are the same text " the"; bytes of a character
    and special tokens match nothing except the end tokens, paired with each other; one-to-one."""
    corpus = ["the cat sat on the mat", "the dog ate the cat food", "naïve café", "a b c"] * 20
    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    spm = Tokenizer(models.BPE(byte_fallback=False))
    spm.normalizer = normalizers.Replace(" ", "▁")
    spm.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    spm.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    spm.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=60, special_tokens=["</s>", "<pad>"]))
    student = PreTrainedTokenizerFast(tokenizer_object=byte_level, eos_token="<eos>")
    teacher = PreTrainedTokenizerFast(tokenizer_object=spm, eos_token="</s>", pad_token="<pad>")
    match = match_vocabularies(student, teacher, DataConfig())
    twin = lambda text: match.student_of[teacher.convert_tokens_to_ids(text.replace(" ", "▁"))]  # noqa: E731
    assert twin(" the") == student.convert_tokens_to_ids("Ġthe") >= 0
    assert twin("mat") == student.convert_tokens_to_ids("mat") and twin(" café") == student.convert_tokens_to_ids("ĠcafÃ©")
    assert match.student_of[teacher.eos_token_id] == student.eos_token_id
    assert match.student_of[teacher.pad_token_id] == -1
    assert match.student_of[teacher.convert_tokens_to_ids("ï")] == -1  # the byte-level side has only its two bytes
    paired = match.student_of[match.student_of >= 0]
    assert len(set(paired.tolist())) == len(paired) == match.matched
    assert match.student_matched[paired].all()
    # A base-model teacher whose turns end with a text (score.teacher_end_text): its first token is the
    # student's end of turn, and the student's token of that text is left without a twin.
    ended = match_vocabularies(student, teacher, DataConfig(), teacher_end_text=" the")
    assert ended.student_of[teacher.convert_tokens_to_ids("▁the")] == student.eos_token_id
    assert not ended.student_matched[student.convert_tokens_to_ids("Ġthe")]
    assert ended.student_of[teacher.eos_token_id] == -1 and ended.matched == match.matched - 1


def test_a_spans_first_student_token_gets_the_teachers_top_k_at_its_first_teacher_token():
    """Student tokens a|b|cd|e over text "abcde", teacher tokens ab|c|de: spans "ab" (student 0, 1),
    "cde" (student 2, 3): students 0 and 2 get teacher positions 0 and 1; 1 and 3 no entry; the ended
    response's last token (4) the teacher's end position (3)."""
    alignment = Alignment([Span((0, 1), (0,)), Span((2, 3), (1, 2))], [0, 0, 1, 1])
    teacher = {"teacher_logprobs": np.zeros(4), "teacher_topk_ids": np.array([[0, 5], [1, 2], [3, 4], [6, 0]]),
               "teacher_topk_logprobs": -np.arange(8, dtype=np.float64).reshape(4, 2) - 1, "teacher_rest_logprob": np.array([-5.0, -6, -7, -8])}
    vocabulary = VocabularyMatch(np.array([10, -1, 12, 13, -1, 15, 16]), np.zeros(20, dtype=bool))
    ids, logprobs, rest = response_topk(alignment, teacher, 5, 1, vocabulary)
    assert ids.tolist() == [[10, 15], [NO_ENTRY_ID] * 2, [UNMATCHED_ID, 12], [NO_ENTRY_ID] * 2, [16, 10]]
    assert logprobs[[0, 2, 4]].tolist() == [[-1, -2], [-3, -4], [-7, -8]]
    assert rest.tolist() == [-5, 0, -6, 0, -8]


def test_the_students_largest_log_probs_over_its_unmatched_tokens():
    tok = type("Tok", (), {"eos_token_id": 2, "pad_token_id": 0})()
    model = new_model(ShapeSpec(vocab_size=40, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, tokenizer_vocab=40,
                                max_position_embeddings=64), tok, 0).eval()
    among = torch.zeros(40, dtype=torch.bool)
    among[[3, 7, 11, 19, 23]] = True
    batch = make_batch([[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11]], 0, torch.device("cpu"))
    ids = torch.randint(0, 40, (batch.n_tokens, 3))
    ids[0, 1] = UNMATCHED_ID
    out = policy_token_logprobs(model, batch, 4, 1.0, ids, largest_among=among)
    with torch.no_grad():
        full = policy_token_logprobs(model, batch, 4, 1.0, torch.arange(40).expand(batch.n_tokens, 40)).at_ids
    torch.testing.assert_close(out.largest, full[:, among].sort(-1, descending=True).values[:, :3])
    torch.testing.assert_close(out.at_ids[0, 1], full[0, 0])  # a negative id reads id 0; the loss masks it
    # Rows scored by two teachers (routed): each token's largest over its own teacher's unmatched ids,
    # two of them only for the second (the third entry is -inf).
    other = torch.zeros(40, dtype=torch.bool)
    other[[5, 30]] = True
    which = torch.tensor([0, 1, 1, 0, 1, 0])
    both = policy_token_logprobs(model, batch, 4, 1.0, ids, largest_among=torch.stack([among, other]), among_row=which).largest
    for t, m in enumerate(which.tolist()):
        want = full[t, [among, other][m]].sort(descending=True).values[:3]
        torch.testing.assert_close(both[t, : len(want)], want)
        assert torch.all(both[t, len(want):] == -math.inf)
