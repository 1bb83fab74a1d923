"""The output layer's gradient computed in the forward pass (gndpo.stages.models.fused_output).

1. The closed form, in float64, against autograd through log-softmax: dL/dx for softcapped logits at a
   temperature, with the sampled token among the top-k ids (a repeated id), and the whole fused loss's
   gradients of the hidden states and the weight, for groups that fit a chunk and a response split
   over chunks, with a loss that couples a response's tokens (as GSPO's ratio does).
2. Every method's train loss on the toy student: each parameter's gradient through the fused layer
   equals the checkpointed path's (train.fused_output false), responses grouped, and split over chunks.
3. A tied output layer (the input embedding's weight): over two micro-batches the fused path's gradients,
   added into ``.grad`` with a sparse lookup gradient, equal the checkpointed path's with a dense
   lookup, the weight's gradient stays dense, and the backward allocates no second [V, H].

Tolerances. In float64 both sides compute the same sums in other orders over at most V = 300 terms: a
sum of n terms is within n u sum|terms| of exact (u = 2^-53, 1.1e-16), so 1e-12 of the gradient's
largest entry holds with a margin of 30x. In train both paths cast the logits to float32 and sum over the
toy's vocabulary (V entries per input-gradient element, N positions per weight-gradient element): two
float32 sums of n terms differ by at most 2 n u sum|terms| (u = 2^-24, 6e-8); with n <= max(V, N) and
sum|terms| bounded by the largest gradient entry times n, the bound is loose, and 2 max(V, N) u relative
to each parameter's largest entry (here 4e-5) is what is asserted.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from gndpo.pipeline.config.load import config_from_dict
from gndpo.pipeline.methods import METHODS
from gndpo.stages.models import device
from gndpo.stages.models.device import vocabulary_logits
from gndpo.stages.models.fused_output import (
    FusedLoss,
    OutputLayer,
    _FusedLossFunction,
    gathered_logprobs,
    logit_gradient_,
    response_groups,
    sparse_tied_lookup,
)
from gndpo.stages.training.batch import TrainRow
from gndpo.stages.training.objective import Objective
from tests.conftest import tiny_config_dict

U32 = 2.0**-24


def reference_logprobs(hidden, weight, ids, softcap: float, temperature: float) -> torch.Tensor:
    """log-softmax of the layer's logits at ``ids``, the textbook way (autograd differentiates it)."""
    x = hidden @ weight.t()
    y = softcap * torch.tanh(x / softcap) if softcap else x
    return torch.log_softmax(y / temperature, dim=-1).gather(-1, ids)


def coupled_loss(g: torch.Tensor, lengths: list[int], coef: torch.Tensor) -> torch.Tensor:
    """A loss of G that couples each response's tokens: per response, (mean of its sampled log-probs)^2,
    plus a weighted sum and a square of the rest (nonlinear in every entry)."""
    parts = torch.split(g[:, 0], lengths)
    return sum(p.mean() ** 2 for p in parts) + (coef * g).sum() + 0.1 * (g[:, 1:] ** 2).sum()


@pytest.mark.parametrize("softcap,temperature", [(0.0, 1.0), (3.0, 0.7)])
def test_the_closed_form_is_autograd_through_log_softmax(softcap, temperature):
    gen = torch.Generator().manual_seed(0)
    V, H, K = 300, 16, 4
    lengths = [3, 5, 9, 2, 4]  # chunk 6: groups [3], [5], [9] split in two, [2, 4]
    N = sum(lengths)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64)
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64)
    targets = torch.randint(V, (N, 1), generator=gen)
    topk = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(N)])
    topk[0, 1] = targets[0, 0]  # the sampled token among the top-k: its gradient adds up
    ids = torch.cat([targets, topk], dim=-1)
    coef = torch.randn(N, K + 1, generator=gen, dtype=torch.float64)

    # dL/dx of one position block, from G's gradient, against autograd.
    x = (hidden @ weight.t()).requires_grad_(True)
    y = softcap * torch.tanh(x / softcap) if softcap else x
    g = torch.log_softmax(y / temperature, dim=-1).gather(-1, ids)
    loss = coupled_loss(g, lengths, coef)
    want_dx, grad_g = torch.autograd.grad(loss, [x, g], retain_graph=True)[0], torch.autograd.grad(loss, g)[0]
    layer = OutputLayer(weight, softcap, temperature)
    z, factor = layer.logits(hidden)
    g_fused, total = gathered_logprobs(z, ids)
    torch.testing.assert_close(g_fused, g.detach(), rtol=0, atol=1e-12)
    got_dx = logit_gradient_(z, total, ids, grad_g, layer, factor)
    scale = want_dx.abs().max()
    assert (got_dx - want_dx).abs().max() <= 1e-12 * scale

    # The whole fused loss: hidden's and weight's gradients, groups of whole responses and a split one.
    groups = response_groups(lengths, 6)
    assert [(gr.rows.start, gr.rows.stop, gr.split) for gr in groups] == [(0, 1, False), (1, 2, False), (2, 3, True), (3, 5, False)]
    starts = np.cumsum([0] + lengths)

    def group_loss(rows: slice, tokens: slice, g: torch.Tensor) -> torch.Tensor:
        return coupled_loss(g, lengths[rows], coef[tokens])

    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    fused = FusedLoss(OutputLayer(w.detach(), softcap, temperature), h.detach(), ids, groups, group_loss)
    fused.grad_weight = torch.zeros_like(w)
    got = _FusedLossFunction.apply(h, w, fused) * 2.5  # the backward scales what the forward computed
    got.backward()
    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    want = coupled_loss(reference_logprobs(h_ref, w_ref, ids, softcap, temperature), lengths, coef) * 2.5
    want.backward()
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-12 * abs(float(want.detach()))
    for ours, theirs in ((h.grad, h_ref.grad), (w.grad, w_ref.grad)):
        assert (ours - theirs).abs().max() <= 1e-12 * theirs.abs().max()
    assert starts[-1] == N


def test_response_groups_hold_whole_responses_up_to_the_chunk():
    groups = response_groups([2, 2, 3, 8, 1, 1], 4)
    assert [(g.rows, g.tokens, g.split) for g in groups] == [
        (slice(0, 2), slice(0, 4), False), (slice(2, 3), slice(4, 7), False), (slice(3, 4), slice(7, 15), True), (slice(4, 6), slice(15, 17), False)
    ]
    assert response_groups([], 4) == []


def random_rows(model, vocab: int, k: int, seed: int) -> list[TrainRow]:
    """Responses of 2-9 tokens (some longer than the test's chunk of 6), two per prompt, with random
    targets: advantages of both signs, masks with holes, old log-probs near the model's own (so PPO's
    clip bites on some tokens), and a teacher's top-k with its rest."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(8):
        prompt = rng.integers(3, vocab, size=3 + i % 3)
        n = int(rng.integers(2, 10))
        response = rng.integers(3, vocab, size=n)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(np.concatenate([prompt, response])[None])).logits[0, len(prompt) - 1 : -1]
            own = torch.log_softmax(logits.double(), -1)[torch.arange(n), torch.tensor(response)].numpy()
        teacher = np.log(rng.dirichlet(np.full(vocab, 0.3), n))
        ids = np.argsort(-teacher, axis=-1)[:, :k]
        top = np.take_along_axis(teacher, ids, -1)
        rest = np.log1p(-np.exp(top).sum(-1).clip(max=1 - 1e-9))
        mask = (rng.random(n) > 0.2).astype(np.float32)
        mask[0] = 1.0
        rows.append(TrainRow(
            rollout_id=f"r{i}", prompt=prompt, response=response, old_logp=(own + rng.normal(0, 0.3, n)).astype(np.float32),
            adv=rng.normal(0, 1, n).astype(np.float32), pg_mask=(rng.random(n) > 0.3).astype(np.float32),
            div=rng.random(n).astype(np.float32), mask=mask, weight=float(rng.uniform(0.5, 1.5)), topk_ids=ids.astype(np.int32),
            topk_logp=top.astype(np.float32), topk_rest=rest.astype(np.float32), prompt_id=f"p{i // 2}",
        ))
    return rows


def gradients(model, objective: Objective, rows: list[TrainRow]) -> tuple[float, tuple, dict[str, torch.Tensor]]:
    model.zero_grad()
    n_tokens = int(sum(r.mask.sum() for r in rows))
    loss, stats = objective.micro_batch_loss(model, rows, 0, len(rows), n_tokens, sum(r.weight for r in rows))
    (loss * 2.0).backward()  # as DeepSpeed scales by the rank count
    return float(loss.detach()), stats, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


VARIANTS = [{"name": m} for m in METHODS] + [
    {"name": "jsd", "topk_form": "renormalized"},
    {"name": "reverse_kl", "pointwise_clip": 0.05},
    {"name": "gndpo", "reward_beta": 0.5},  # weighted-seq-mean
    {"name": "minillm", "clip_low": 0.05, "clip_high": 0.05},
]


@pytest.mark.parametrize("method", VARIANTS, ids=lambda m: "-".join(str(v) for v in m.values()))
def test_every_method_s_gradients_equal_the_checkpointed_path_s(method, tiny_assets):
    K = 4
    cfg = config_from_dict(tiny_config_dict(tiny_assets, method=method, score={"teacher_topk": K}, rollout={"temperature": 0.8},
                                            model={"token_chunk": 6}))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_assets / "student"), dtype=torch.float32)
    assert OutputLayer.fits(model)
    vocab = model.get_output_embeddings().out_features
    rows = random_rows(model, vocab, K, seed=len(str(method)))
    fused = Objective.of(cfg, 0, 0, torch.device("cpu"), fusable=True)
    checkpointed = dataclasses.replace(fused, fused=False)
    assert fused.fused and not checkpointed.fused
    loss, stats, got = gradients(model, fused, rows)
    want_loss, want_stats, want = gradients(model, checkpointed, rows)
    assert loss != 0.0 and got.keys() == want.keys()
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(stats, want_stats, rtol=1e-5, atol=1e-6)
    n_positions = sum(len(r.response) for r in rows)
    tol = 2 * max(vocab, n_positions) * U32
    for name, g in want.items():
        scale = float(g.abs().max())
        assert float((got[name] - g).abs().max()) <= tol * scale, (name, float((got[name] - g).abs().max()), scale)


def tied_student(vocab: int = 4096) -> torch.nn.Module:
    """A two-layer Llama whose output layer is its input embedding (as Gemma's and SmolLM2's), seeded."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).float().eval()


def micro_batch_backward(model, objective: Objective, rows: list[TrainRow]) -> None:
    n_tokens = int(sum(r.mask.sum() for r in rows))
    loss, _ = objective.micro_batch_loss(model, rows, 0, len(rows), n_tokens, sum(r.weight for r in rows))
    (loss * 2.0).backward()


def test_a_tied_output_layer_takes_its_lookup_rows_in_place_and_matches_the_checkpointed_path(tiny_assets):
    K = 4
    cfg = config_from_dict(tiny_config_dict(tiny_assets, method={"name": "forward_kl"}, score={"teacher_topk": K}, model={"token_chunk": 6}))
    reference, model = tied_student(), tied_student()
    sparse_tied_lookup(model)
    assert OutputLayer.of(model).tied and model.get_input_embeddings().sparse and not reference.get_input_embeddings().sparse
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    first, second = random_rows(reference, vocab, K, seed=1), random_rows(reference, vocab, K, seed=2)
    fused = Objective.of(cfg, 0, 0, torch.device("cpu"), fusable=True)
    checkpointed = dataclasses.replace(fused, fused=False)
    for rows in (first, second):  # two micro-batches of one step: the second adds into existing .grad
        micro_batch_backward(reference, checkpointed, rows)
    micro_batch_backward(model, fused, first)
    n_tokens = int(sum(r.mask.sum() for r in second))
    loss, _ = fused.micro_batch_loss(model, second, 0, len(second), n_tokens, sum(r.weight for r in second))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as backward:
        (loss * 2.0).backward()
    weight = model.get_input_embeddings().weight
    assert weight.grad.layout == torch.strided
    n_positions = sum(len(r.response) for r in first + second)
    tol = 2 * max(vocab, n_positions) * U32
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        scale = float(q.grad.abs().max())
        assert float((p.grad - q.grad).abs().max()) <= tol * scale, (name, float((p.grad - q.grad).abs().max()), scale)
    # The forward allocated the weight's gradient; the backward allocates nothing of its size (a dense
    # lookup gradient would be one, autograd's out-of-place sum of a dense and a sparse gradient another).
    allocations = [e.self_cpu_memory_usage for e in backward.events()]
    assert any(a > 0 for a in allocations), "the profile saw the backward's allocations"
    assert max(allocations) < vocab * hidden * 4, max(allocations)


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "mm"])
def test_vocabulary_logits_are_the_product_within_float32_rounding(onednn, monkeypatch):
    """Score's and the fused loss's logits (oneDNN's linear on the CPU in float32, or mm where torch
    lacks it): each entry within the float32 bound of a sum of H products, H u sum|h_i w_i|, of the
    float64 product; bf16 inputs on the CPU give mm's product, promoted to float32."""
    if not onednn:
        monkeypatch.setattr(device, "ONEDNN_LINEAR", None)
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(37, 64, generator=g), torch.randn(5000, 64, generator=g)
    z = vocabulary_logits(hidden, weight)
    assert z.dtype == torch.float32 and z.shape == (37, 5000)
    exact = hidden.double() @ weight.double().t()
    bound = 64 * U32 * (hidden.double().abs() @ weight.double().abs().t())
    assert bool(((z.double() - exact).abs() <= bound).all())
    half = vocabulary_logits(hidden.bfloat16(), weight.bfloat16())
    assert half.dtype == torch.float32 and torch.equal(half, torch.mm(hidden.bfloat16(), weight.bfloat16().t()).float())
