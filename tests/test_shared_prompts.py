"""Shared prompts (model.shared_prompts): a batch reads each distinct prompt once and its responses
against the prompt's keys and values. The reference is written out here: an ordinary forward of each
prompt + response on its own, full logits, log-softmax. Score's numbers, train's log-probs and the
gradients they give must equal it within float32's rounding of the same sums in another order
(tests/conftest.py's float32_sum_tol): for an untied and a tied model, a model
with sliding-window layers shorter than the prompts (Gemma 3), prompts of several lengths whose samples
are not next to each other in the batch, and a teacher reading its own prompts (self-distillation).
"""

import numpy as np
import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from gndpo.stages.models.batches import make_batch, token_budget_batches
from gndpo.stages.models.logprobs import pair_token_stats, policy_token_logprobs
from tests.conftest import float32_sum_tol, forward_terms

VOCAB = 211
CPU = torch.device("cpu")


def llama(tied: bool, seed: int):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=tied, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def gemma(seed: int):
    """Two sliding-window layers (window 6, shorter than most prompts here) and a global one."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=1, head_dim=16, sliding_window=6, max_position_embeddings=256,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    return Gemma3ForCausalLM(config).eval()


MODELS = {"llama-untied": lambda seed: llama(False, seed), "llama-tied": lambda seed: llama(True, seed), "gemma3-sliding": gemma}


@pytest.fixture(scope="module")
def rows():
    """Three prompts (3, 17 and 9 tokens) sampled 3, 2 and 3 times, their samples interleaved, with
    responses of 1 to 23 tokens."""
    rng = np.random.default_rng(0)
    distinct = [rng.integers(3, VOCAB, size=n).tolist() for n in (3, 17, 9)]
    which = [0, 1, 2, 0, 2, 1, 0, 2]
    prompts = [distinct[i] for i in which]
    responses = [rng.integers(3, VOCAB, size=n).tolist() for n in (5, 1, 23, 4, 12, 6, 9, 2)]
    return prompts, responses


def reference(model, prompts, responses, temperature=1.0):
    """[N, V]: the log-softmax rows that predict every response token, response by response, from a
    plain forward of each prompt + response alone."""
    out = []
    for p, r in zip(prompts, responses):
        logits = model(input_ids=torch.tensor([p + r])).logits[0].float() / temperature
        out.append(torch.log_softmax(logits[len(p) - 1 : len(p) + len(r) - 1], -1))
    return torch.cat(out)


def picked(logp_all, responses):
    return logp_all[torch.arange(len(logp_all)), torch.tensor([t for r in responses for t in r])]


def close(got, want, what, model, prompts, responses, size):
    """Two float32 computations of the same numbers (shared prompts, separate forwards): within the
    rounding of ``model``'s forward's chain of sums over the longest sequence, at the numbers' ``size``
    (their log-probs' largest; for a difference of two models' log-probs, the sum of both)."""
    context = max(len(p) + len(r) for p, r in zip(prompts, responses))
    tol = float32_sum_tol(forward_terms(model.config, context), size)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), err_msg=what, **tol)


def test_the_batch_holds_each_distinct_prompt_once(rows):
    prompts, responses = rows
    batch = make_batch(prompts, responses, 0, CPU, share_prompts=True)
    assert batch.prefix_ids.shape == (3, 17)  # left-padded to the longest prompt
    assert batch.prefix_of.tolist() == [0, 1, 2, 0, 2, 1, 0, 2]
    assert batch.prefix_rows.tolist() == [0, 1, 2]
    assert batch.prefix_ids[0, -3:].tolist() == prompts[0] and batch.prefix_mask[0].sum() == 3
    assert batch.targets.tolist() == [t for r in responses for t in r]
    # With image keys, equal token ids showing other pictures are other prompts.
    keyed = make_batch(prompts, responses, 0, CPU, share_prompts=True, image_keys=["a", "b", "c", "d", "c", "b", "a", "c"])
    assert keyed.prefix_rows.tolist() == [0, 1, 2, 3] and keyed.prefix_of.tolist() == [0, 1, 2, 3, 2, 1, 0, 2]


@pytest.mark.parametrize("name", MODELS)
def test_score_numbers_equal_separate_forwards(rows, name):
    prompts, responses = rows
    student, teacher = MODELS[name](0), MODELS[name](1)
    batch = make_batch(prompts, responses, 0, CPU, share_prompts=True)
    got = pair_token_stats(teacher, student, batch, token_chunk=7, student_temperature=0.7, topk=5, entropies=(True, True), kl=True)
    with torch.no_grad():
        t_all, s_all = reference(teacher, prompts, responses), reference(student, prompts, responses, 0.7)
    t_size, s_size = float(t_all.abs().max()), float(s_all.abs().max())
    close(got["teacher_logprobs"], picked(t_all, responses), "teacher log-probs", teacher, *rows, t_size)
    close(got["student_logprobs"], picked(s_all, responses), "student log-probs", student, *rows, s_size)
    close(got["teacher_topk_logprobs"], t_all.topk(5, -1).values, "teacher top-k", teacher, *rows, t_size)
    close(got["token_kl"], (s_all.exp() * (s_all - t_all)).sum(-1), "KL", student, *rows, t_size + s_size)
    close(got["student_entropy"], -(s_all.exp() * s_all).sum(-1), "student entropy", student, *rows, s_size)


def test_a_teacher_reading_its_own_prompts_equals_separate_forwards(rows):
    """Self-distillation: the teacher reads a longer privileged prompt per prompt, shared by its samples."""
    prompts, responses = rows
    student, teacher = llama(False, 0), llama(False, 1)
    context = {tuple(p): [7, 8, 9, 10, 11, *p] for p in prompts}
    teacher_prompts = [context[tuple(p)] for p in prompts]
    batch = make_batch(prompts, responses, 0, CPU, share_prompts=True)
    teacher_batch = make_batch(teacher_prompts, responses, 0, CPU, share_prompts=True)
    got = pair_token_stats(teacher, student, batch, token_chunk=7, student_temperature=1.0, teacher_batch=teacher_batch)
    with torch.no_grad():
        t_all, s_all = reference(teacher, teacher_prompts, responses), reference(student, prompts, responses)
    close(got["teacher_logprobs"], picked(t_all, responses), "teacher log-probs", teacher, teacher_prompts, responses, float(t_all.abs().max()))
    close(got["student_logprobs"], picked(s_all, responses), "student log-probs", student, prompts, responses, float(s_all.abs().max()))


@pytest.mark.parametrize("name", MODELS)
def test_train_logprobs_and_gradients_equal_separate_forwards(rows, name):
    """The gradient through a prompt's positions is the sum over every response that read it."""
    prompts, responses = rows
    model = MODELS[name](0)
    batch = make_batch(prompts, responses, 0, CPU, share_prompts=True)
    topk_ids = torch.randint(0, VOCAB, (batch.n_tokens, 4), generator=torch.Generator().manual_seed(0))
    weights, weights_k = torch.randn(batch.n_tokens), torch.randn(batch.n_tokens, 4)

    model.zero_grad()
    sampled, at_ids, pad_term, _ = policy_token_logprobs(model, batch, token_chunk=7, temperature=0.7, topk_ids=topk_ids, min_chunks=12)
    ((sampled * weights).sum() + (at_ids * weights_k).sum() + pad_term).backward()
    shared = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    ref = reference(model, prompts, responses, 0.7)
    ref_sampled, ref_at_ids = picked(ref, responses), ref.gather(-1, topk_ids)
    ((ref_sampled * weights).sum() + (ref_at_ids * weights_k).sum()).backward()

    size = float(ref.abs().max())
    close(sampled.detach(), ref_sampled.detach(), "sampled log-probs", model, prompts, responses, size)
    close(at_ids.detach(), ref_at_ids.detach(), "log-probs at the top-k ids", model, prompts, responses, size)
    # Each gradient: the forward's sums run backwards, then each weight's sum over every position
    # read (the separate forwards'), within their rounding at the size of its largest element.
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    n_terms = forward_terms(model.config, max(lengths)) + sum(lengths)
    for n, p in model.named_parameters():
        np.testing.assert_allclose(shared[n], p.grad, err_msg=n, **float32_sum_tol(n_terms, float(p.grad.abs().max())))


def test_budget_batches_keep_a_prompts_samples_together():
    lengths = np.array([30, 12, 31, 12, 29, 40, 11, 10])
    keys = ["a", "b", "a", "b", "a", "c", "b", "c"]
    batches = token_budget_batches(lengths, max_tokens=100, max_rows=8, prompt_keys=keys)
    assert [b.tolist() for b in batches] == [[5, 7], [2, 0, 4], [1, 3, 6]]  # c (longest 40), a (31), b (12)
    for b in batches:
        assert lengths[b].max() * len(b) <= 100
