"""The two forms of the top-k divergence (method.topk_form), against re-derivations written here with
plain loops / numpy from the formulas, not with the implementation's vectorized code.

bucket:       each model -> k+1 buckets (its probabilities at the teacher's k ids, plus 1 - their sum),
              forward / reverse KL and JSD exact on those buckets, nothing renormalized.
renormalized: teacher (and, for reverse KL / JSD, student) renormalized over the k ids.
"""

import math

import numpy as np
import pytest
import torch

from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import config_from_dict
from gndpo.pipeline.methods import validate
from gndpo.pipeline.methods.losses import DivergenceTerm, combined_token_losses, topk_divergence
from gndpo.pipeline.settings.schema import MethodConfig
from tests.conftest import float32_sum_tol

KINDS = ("forward_kl", "reverse_kl", "jsd")
BETA = 0.3


def log_softmax_np(x):
    x = np.asarray(x, dtype=np.float64)
    z = x - x.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def kl(p, q):
    """KL(p || q) of two probability lists, with 0 log 0 = 0."""
    return sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, q) if a > 0)


def divergence_of(kind, p_teacher, p_student, beta=BETA):
    """forward / reverse KL or JSD between two probability lists over the same support."""
    if kind == "forward_kl":
        return kl(p_teacher, p_student)
    if kind == "reverse_kl":
        return kl(p_student, p_teacher)
    m = [beta * a + (1 - beta) * b for a, b in zip(p_teacher, p_student)]
    return beta * kl(p_teacher, m) + (1 - beta) * kl(p_student, m)


def buckets(topk_logp):
    """The k probabilities plus the rest, 1 - their sum (loops, float64)."""
    probs = [math.exp(v) for v in topk_logp]
    return probs + [max(1.0 - sum(probs), 0.0)]


def bucket_reference(kind, s_topk, t_topk, beta=BETA):
    return divergence_of(kind, buckets(t_topk), buckets(s_topk), beta)


def renormalized_reference(kind, s_topk, t_topk, beta=BETA):
    zt = sum(math.exp(v) for v in t_topk)
    pt = [math.exp(v) / zt for v in t_topk]
    if kind == "forward_kl":  # the student's unrenormalized log-probs
        return sum(p * (math.log(p) - s) for p, s in zip(pt, s_topk))
    zs = sum(math.exp(v) for v in s_topk)
    ps = [math.exp(v) / zs for v in s_topk]
    return divergence_of(kind, pt, ps, beta)


def topk_case(seed, V, k, B=2, T=3, student_scale=1.0, teacher_scale=2.0):
    rng = np.random.default_rng(seed)
    s_full = torch.tensor(log_softmax_np(rng.normal(size=(B, T, V)) * student_scale))
    t_full = torch.tensor(log_softmax_np(rng.normal(size=(B, T, V)) * teacher_scale))
    t_topk, ids = t_full.topk(k, dim=-1)
    return s_full, t_full, torch.gather(s_full, 2, ids), t_topk


# (a) ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["bucket", "renormalized"])
@pytest.mark.parametrize("kind", KINDS)
def test_full_vocabulary_k_gives_the_exact_divergence(kind, form):
    V = 7
    s_full, t_full, s_topk, t_topk = topk_case(0, V, V)
    got = topk_divergence(kind, s_topk, t_topk, beta=BETA, form=form)
    assert got.dtype == torch.float64
    for b in range(2):
        for t in range(3):
            ps = np.exp(s_full[b, t].numpy()).tolist()
            pt = np.exp(t_full[b, t].numpy()).tolist()
            want = divergence_of(kind, pt, ps)  # over the whole vocabulary, any order
            assert abs(float(got[b, t]) - want) < 1e-6


# (b) ---------------------------------------------------------------------------------------------
def assert_each_position(got, reference, kind, s_topk, t_topk):
    """Every (response, position) value of ``got`` equals the pure-Python ``reference`` on its top-k."""
    for b in range(got.shape[0]):
        for t in range(got.shape[1]):
            want = reference(kind, s_topk[b, t].tolist(), t_topk[b, t].tolist())
            assert float(got[b, t]) == pytest.approx(want, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_bucket_form_is_the_divergence_on_k_plus_one_buckets(kind):
    s_full, _, s_topk, t_topk = topk_case(1, V=11, k=4)
    got = topk_divergence(kind, s_topk, t_topk, beta=BETA)  # bucket is the default
    assert torch.equal(got, topk_divergence(kind, s_topk, t_topk, beta=BETA, form="bucket"))
    assert_each_position(got, bucket_reference, kind, s_topk, t_topk)


@pytest.mark.parametrize("kind", KINDS)
def test_renormalized_form_keeps_the_earlier_definition(kind):
    _, _, s_topk, t_topk = topk_case(2, V=11, k=4)
    got = topk_divergence(kind, s_topk, t_topk, beta=BETA, form="renormalized")
    assert_each_position(got, renormalized_reference, kind, s_topk, t_topk)


@pytest.mark.parametrize("kind", KINDS)
def test_bucket_form_lower_bounds_the_full_vocabulary_divergence(kind):
    """Coarsening both distributions to {k ids, rest} cannot increase an f-divergence."""
    s_full, t_full, s_topk, t_topk = topk_case(3, V=13, k=5, B=3, T=4)
    got = topk_divergence(kind, s_topk, t_topk, beta=BETA)
    for b in range(3):
        for t in range(4):
            full = divergence_of(kind, np.exp(t_full[b, t].numpy()).tolist(), np.exp(s_full[b, t].numpy()).tolist())
            assert float(got[b, t]) <= full + 1e-12


# (c) ---------------------------------------------------------------------------------------------
def test_bucket_reverse_kl_sees_the_students_tail():
    """Teacher: 3 ids hold ~99.9% of its mass. Student: the same shape on those ids, but 90% of its mass
    spread over the other 47 ids. Renormalizing the student hides all of that; the buckets do not."""
    V, k = 50, 3
    t_probs = np.full(V, 1e-3 / (V - k))
    t_probs[:k] = np.array([0.5, 0.3, 0.2]) * (1 - 1e-3)
    s_probs = np.full(V, 0.9 / (V - k))
    s_probs[:k] = np.array([0.5, 0.3, 0.2]) * 0.1
    s_topk = torch.tensor(np.log(s_probs[:k]))[None, None]
    t_topk = torch.tensor(np.log(t_probs[:k]))[None, None]
    full = kl(s_probs.tolist(), t_probs.tolist())
    bucket = float(topk_divergence("reverse_kl", s_topk, t_topk, form="bucket")[0, 0])
    renorm = float(topk_divergence("reverse_kl", s_topk, t_topk, form="renormalized")[0, 0])
    assert renorm < 1e-6  # same shape on the k ids: the tail is invisible
    assert bucket > renorm + 4.0
    assert full > 4.0
    # the rest bucket is the whole story: the student's tail is uniform, as is the teacher's
    assert bucket == pytest.approx(full, rel=1e-9)
    # and in a less tidy case (random tails) it stays close, and below, the full value
    rng = np.random.default_rng(5)
    s_tail = rng.dirichlet(np.ones(V - k)) * 0.9
    s_probs2 = np.concatenate([s_probs[:k], s_tail])
    full2 = kl(s_probs2.tolist(), t_probs.tolist())
    bucket2 = float(topk_divergence("reverse_kl", torch.tensor(np.log(s_probs2[:k]))[None, None], t_topk)[0, 0])
    assert bucket2 == pytest.approx(bucket)  # only the student's tail mass matters to the buckets
    assert bucket2 <= full2 and bucket2 > 0.8 * full2


# (d) ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_empty_rest_bucket_gives_finite_values_and_gradients(kind, dtype):
    V = 7
    _, _, s_topk, t_topk = topk_case(6, V, V)
    # rounding can put a model's top-k mass a hair above 1: the rest must stay finite anyway
    s_topk = (s_topk.to(dtype) + torch.tensor([0.0, 1e-7, -1e-7], dtype=dtype).view(1, 3, 1)).requires_grad_()
    t_topk = t_topk.to(dtype) + 1e-7
    loss = topk_divergence(kind, s_topk, t_topk, beta=BETA)
    assert torch.isfinite(loss).all()
    loss.sum().backward()
    assert torch.isfinite(s_topk.grad).all()
    # a one-hot-like model (a top-k log-prob of 0, the rest -inf): still finite
    s1 = torch.tensor([[0.0, -float("inf"), -50.0]], dtype=dtype, requires_grad=True)
    t1 = torch.tensor([[0.0, -float("inf"), -60.0]], dtype=dtype)
    out = topk_divergence(kind, s1, t1, beta=BETA)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(s1.grad).all()
    # Zero but for the JSD mixture's rounding in float32: the logs of BETA and 1 - BETA added to the
    # two log-probs, then a logaddexp's exp, log1p and add, at the size of those logs.
    assert float(out.detach()[0]) == pytest.approx(0.0, abs=float32_sum_tol(5, abs(math.log(min(BETA, 1 - BETA))))["atol"])


# (e) ---------------------------------------------------------------------------------------------
def direct_bucket_reverse_kl(s_topk, t_topk):
    """reverse KL on k+1 buckets, written out: sum_i q_i (s_i - t_i) + r_S (log r_S - log r_T)."""
    q = s_topk.exp()
    r_s = 1 - q.sum(-1)
    r_t = 1 - t_topk.exp().sum(-1)
    return (q * (s_topk - t_topk)).sum(-1) + r_s * (r_s.log() - r_t.log())


def test_bucket_reverse_kl_gradient_matches_a_direct_reimplementation():
    _, _, s_topk, t_topk = topk_case(7, V=12, k=4)
    s1 = s_topk.clone().requires_grad_()
    s2 = s_topk.clone().requires_grad_()
    w = torch.tensor(np.random.default_rng(8).normal(size=(2, 3)))
    (topk_divergence("reverse_kl", s1, t_topk) * w).sum().backward()
    (direct_bucket_reverse_kl(s2, t_topk) * w).sum().backward()
    assert torch.allclose(s1.grad, s2.grad, rtol=1e-9, atol=1e-12)
    # the closed form: d/ds_i = q_i (s_i - t_i - log(r_S / r_T)); the rest bucket is part of it
    q = s_topk.exp()
    r_s, r_t = 1 - q.sum(-1, keepdim=True), 1 - t_topk.exp().sum(-1, keepdim=True)
    closed = q * (s_topk - t_topk - (r_s.log() - r_t.log())) * w.unsqueeze(-1)
    assert torch.allclose(s1.grad, closed, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_bucket_gradients_match_finite_differences(kind):
    _, _, s_topk, t_topk = topk_case(9, V=10, k=3, B=1, T=2)
    s = s_topk.clone().requires_grad_()
    topk_divergence(kind, s, t_topk, beta=BETA).sum().backward()
    h = 1e-6
    for idx in np.ndindex(*s_topk.shape):
        plus, minus = s_topk.clone(), s_topk.clone()
        plus[idx] += h
        minus[idx] -= h
        fd = (bucket_reference(kind, plus[idx[:2]].tolist(), t_topk[idx[:2]].tolist())
              - bucket_reference(kind, minus[idx[:2]].tolist(), t_topk[idx[:2]].tolist())) / (2 * h)
        assert float(s.grad[idx]) == pytest.approx(fd, rel=1e-5, abs=1e-8)


# combined_token_losses passes the form through -----------------------------------------------------
@pytest.mark.parametrize("form", ["bucket", "renormalized"])
def test_combined_token_losses_passes_topk_form(form):
    _, _, s_topk, t_topk = topk_case(10, V=9, k=3)
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    w = torch.tensor([[1.0, 0.5, 0.0], [2.0, 1.0, 1.0]], dtype=torch.float64)
    losses, _ = combined_token_losses(zeros, None, DivergenceTerm("reverse_kl", w, s_topk, t_topk, form=form))
    ref = renormalized_reference if form == "renormalized" else bucket_reference
    for b in range(2):
        for t in range(3):
            want = float(w[b, t]) * ref("reverse_kl", s_topk[b, t].tolist(), t_topk[b, t].tolist())
            assert float(losses[b, t]) == pytest.approx(want, rel=1e-9, abs=1e-12)


# (f) ---------------------------------------------------------------------------------------------
def test_the_config_refuses_an_unknown_topk_form():
    """An unknown form is refused when the config is read (gndpo init), so the loss never sees one."""
    assert MethodConfig().topk_form == "bucket"
    for form in ("bucket", "renormalized"):
        validate(config_from_dict({"method": {"name": "reverse_kl", "topk_form": form}}).method)
    with pytest.raises(GndpoError, match="method.topk_form must be one of bucket, renormalized, got 'foo'") as err:
        config_from_dict({"method": {"name": "jsd", "topk_form": "foo"}})
    assert "\n" not in str(err.value)
