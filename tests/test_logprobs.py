"""Memory-bounded log-probs (gndpo.stages.models.logprobs) against a direct full-vocabulary computation.

The reference here is written out in the test: one ordinary forward of the whole padded sequence,
full logits, log-softmax, and the stored quantities picked out position by position. The chunked code
must agree within float32's rounding of the same sums in another order (tests/conftest.py's
float32_sum_tol) for every number score stores and for train's gradients. A second part
runs both at a real vocabulary (151,936) in subprocesses, on a 256-token and a 2,048-token response,
and checks that peak memory does not grow with vocabulary x length.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gndpo.stages.models.batches import make_batch, token_budget_batches
from gndpo.stages.models.logprobs import pair_token_stats, policy_token_logprobs
from tests.conftest import float32_sum_tol, forward_terms
from tests.realistic import ShapeSpec, build_realistic_pair, new_model

SMALL = ShapeSpec(vocab_size=3001, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, tokenizer_vocab=300, max_position_embeddings=512)


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    tok = type("Tok", (), {"eos_token_id": 2, "pad_token_id": 0})()
    student, teacher = new_model(SMALL, tok, 0).eval(), new_model(SMALL, tok, 1).eval()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 3001, size=n).tolist() for n in (5, 17, 9)]
    responses = [rng.integers(3, 3001, size=n).tolist() for n in (40, 3, 71)]
    return student, teacher, prompts, responses


def reference(model, prompts, responses, temperature=1.0):
    """Per response: the [len, V] log-softmax rows that predict its tokens, from a plain forward of
    each sequence on its own (no padding, no chunks)."""
    out = []
    for p, r in zip(prompts, responses):
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids).logits[0].float() / temperature
        out.append(torch.log_softmax(logits[len(p) - 1 : len(p) + len(r) - 1], -1))
    return out


def test_score_numbers_match_full_vocabulary_reference(pair):
    student, teacher, prompts, responses = pair
    batch = make_batch(prompts, responses, 0, torch.device("cpu"))
    got = pair_token_stats(teacher, student, batch, token_chunk=16, student_temperature=0.7, topk=5, entropies=(True, True), kl=True)
    with torch.no_grad():
        t_ref, s_ref = reference(teacher, prompts, responses), reference(student, prompts, responses, 0.7)
    # Two float32 forwards of each model, batched and in chunks against one sequence at a time: each
    # model's log-probs (and the entropy, a p-weighted sum of them) within the rounding of the chain of
    # sums behind them at their size; the KL, a difference of the two, within the sum of both.
    n = forward_terms(teacher.config, max(len(p) + len(r) for p, r in zip(prompts, responses)))
    t_size, s_size = (float(torch.cat(ref).abs().max()) for ref in (t_ref, s_ref))
    t_tol, s_tol, kl_tol = float32_sum_tol(n, t_size), float32_sum_tol(n, s_size), float32_sum_tol(n, t_size + s_size)
    start = 0
    for r, t_all, s_all in zip(responses, t_ref, s_ref):
        sl = slice(start, start + len(r))
        target = torch.tensor(r)
        np.testing.assert_allclose(got["teacher_logprobs"][sl], t_all[torch.arange(len(r)), target], **t_tol)
        np.testing.assert_allclose(got["student_logprobs"][sl], s_all[torch.arange(len(r)), target], **s_tol)
        values, ids = t_all.topk(5, -1)
        np.testing.assert_allclose(got["teacher_topk_logprobs"][sl], values, **t_tol)
        assert torch.equal(got["teacher_topk_ids"][sl].long(), ids)
        np.testing.assert_allclose(got["teacher_entropy"][sl], -(t_all.exp() * t_all).sum(-1), **t_tol)
        np.testing.assert_allclose(got["student_entropy"][sl], -(s_all.exp() * s_all).sum(-1), **s_tol)
        np.testing.assert_allclose(got["token_kl"][sl], (s_all.exp() * (s_all - t_all)).sum(-1), **kl_tol)
        start += len(r)
    assert start == batch.n_tokens


def test_train_logprobs_and_gradients_match_reference(pair):
    student, teacher, prompts, responses = pair
    batch = make_batch(prompts, responses, 0, torch.device("cpu"))
    topk_ids = torch.randint(0, SMALL.vocab_size, (batch.n_tokens, 4))
    weights = torch.randn(batch.n_tokens)
    weights_k = torch.randn(batch.n_tokens, 4)

    student.zero_grad()
    sampled, at_ids, pad_term, _ = policy_token_logprobs(student, batch, token_chunk=16, temperature=0.7, topk_ids=topk_ids, min_chunks=20)
    ((sampled * weights).sum() + (at_ids * weights_k).sum() + pad_term).backward()
    chunked = {n: p.grad.clone() for n, p in student.named_parameters()}

    student.zero_grad()
    ref = torch.cat(reference(student, prompts, responses, 0.7))
    ref_sampled = ref[torch.arange(len(ref)), torch.tensor([t for r in responses for t in r])]
    ref_at_ids = ref.gather(-1, topk_ids)
    ((ref_sampled * weights).sum() + (ref_at_ids * weights_k).sum()).backward()

    # Two float32 computations (chunked, one sequence at a time): log-probs within the rounding of the
    # forward's chain of sums at the log-probs' size; each gradient within that of the same sums run
    # backwards plus each weight's sum over the batch's positions, at the size of its largest element.
    n = forward_terms(student.config, batch.ids.shape[1])
    lp_tol = float32_sum_tol(n, float(ref.abs().max()))
    np.testing.assert_allclose(sampled.detach(), ref_sampled.detach(), **lp_tol)
    np.testing.assert_allclose(at_ids.detach(), ref_at_ids.detach(), **lp_tol)
    assert float(pad_term.detach()) == 0.0
    for name, p in student.named_parameters():
        np.testing.assert_allclose(chunked[name], p.grad, err_msg=name, **float32_sum_tol(n + batch.ids.numel(), float(p.grad.abs().max())))


def test_padded_layout_and_mask(pair):
    _, _, prompts, responses = pair
    batch = make_batch(prompts, responses, 0, torch.device("cpu"))
    flat = torch.arange(batch.n_tokens, dtype=torch.float32) + 1
    grid = batch.padded(flat)
    assert grid.shape == (3, 71)
    assert grid[1, :3].tolist() == [41.0, 42.0, 43.0] and grid[1, 3:].abs().sum() == 0
    assert batch.mask().sum(-1).tolist() == [40.0, 3.0, 71.0]
    assert batch.targets[:3].tolist() == responses[0][:3]


def test_token_budget_batches_bound_padded_tokens():
    lengths = np.array([5, 300, 40, 41, 7, 300, 39, 2000])
    batches = token_budget_batches(lengths, max_tokens=600, max_rows=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or lengths[b].max() * len(b) <= 600
    assert [7] in [b.tolist() for b in batches]  # longer than the budget: alone
    # Grouped by length: the two 300s share a batch, the short ones are together.
    assert any(set(b.tolist()) == {1, 5} for b in batches)


# -- real shapes: vocabulary 151,936, hidden 512, responses of 256 and 2,048 tokens ----------------------
PROBE = r"""
import json, sys, torch
from gndpo.dist import usable_cpus
from gndpo.stages.models.batches import make_batch
from gndpo.stages.models.logprobs import pair_token_stats, policy_token_logprobs
from gndpo.stages.models.loading import load_causal_lm
from gndpo.pipeline.methods.losses import DivergenceTerm, PolicyGradientTerm, aggregate, combined_token_losses
from tests.memory import peak_above_start
folder, length, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(min(2, usable_cpus()))  # 2 threads on 1 core wait for each other
student, teacher = load_causal_lm(folder + "/student"), load_causal_lm(folder + "/teacher").eval()
g = torch.Generator().manual_seed(0)
prompt, response = torch.randint(3, 4000, (32,), generator=g).tolist(), torch.randint(3, 4000, (length,), generator=g).tolist()
batch = make_batch([prompt], [response], 0, torch.device("cpu"))
score, stats = peak_above_start(lambda: pair_token_stats(teacher, student, batch, chunk, 1.0, topk=16, entropies=(True, True), kl=True))
del teacher

def train_step():
    opt = torch.optim.AdamW(student.parameters(), lr=1e-6)
    flat, at_ids, pad, _ = policy_token_logprobs(student, batch, chunk, 1.0, stats["teacher_topk_ids"].long())
    logp, mask = batch.padded(flat), batch.mask()
    t_topk = batch.padded(stats["teacher_topk_logprobs"])
    losses, _ = combined_token_losses(logp, PolicyGradientTerm("gspo", batch.padded(stats["student_logprobs"]), torch.ones_like(logp), mask),
                                      DivergenceTerm("reverse_kl", mask, batch.padded(at_ids), t_topk))
    (aggregate(losses, mask, "token-mean", 1, int(mask.sum())) + pad).backward()
    opt.step()
    return losses

train, losses = peak_above_start(train_step)
print(json.dumps({"score_extra_gib": score["extra_gib"], "train_extra_gib": train["extra_gib"],
                  "finite": bool(torch.isfinite(losses).all())}))
"""


def peak_memory(folder, length: int, chunk: int) -> dict:
    """Peak resident memory above its own start of scoring one response (both models) and of one train
    step (the student), each sampled while it runs (tests/memory.py): a high-water mark of the whole
    process would hide both under the models' loading where that peaks higher."""
    proc = subprocess.run([sys.executable, "-c", PROBE, str(folder), str(length), str(chunk)], capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parents[1])  # the repository root: the probe imports tests.memory
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def realistic_pair(tmp_path_factory):
    return build_realistic_pair(tmp_path_factory.mktemp("real-shapes"), ShapeSpec(layers=1), ShapeSpec(layers=2))


@pytest.mark.slow
def test_memory_does_not_grow_with_vocabulary_times_length(realistic_pair):
    """V = 151,936, hidden 512. Unchunked, one 2,048-token response's fp32 logits alone are 1.2 GB per
    copy and a log-softmax doubles that (2.5 GB per model). Chunked at 256 positions, one chunk's
    [256, V] buffer is 0.16 GB; the 256-token run is one chunk, so both runs hold the same [chunk, V]
    buffers and differ by what grows with length. Stated bound: the peak above the loaded models stays
    under 2 GiB for scoring (two models) and under 3.5 GiB for the train step (gradients and AdamW state
    of the 158M-parameter student are 1.9 GB of it), and going from 256 to 2,048 response tokens adds
    under 0.5 GB, where unchunked logits would add 1,792 x V x 4 B x 2 = 2.2 GB per model."""
    short = peak_memory(realistic_pair, 256, 256)
    long = peak_memory(realistic_pair, 2048, 256)
    print("peak above each phase's start (GiB):", json.dumps({"256": short, "2048": long}))
    assert long["finite"] and short["finite"]
    assert long["score_extra_gib"] < 2.0 and long["train_extra_gib"] < 3.5
    assert long["score_extra_gib"] - short["score_extra_gib"] < 0.5
    assert long["train_extra_gib"] - short["train_extra_gib"] < 0.5
    assert short["score_extra_gib"] > 0.1 and short["train_extra_gib"] > 1.0  # the probe saw the work: a chunk's buffers, AdamW's state
