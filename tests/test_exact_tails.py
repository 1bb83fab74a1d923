"""Exact tails for the top-k "bucket" divergences (issue 19, item 5).

Score stores the teacher's log mass outside its top-k (``teacher_rest_logprob``) from its full softmax;
the bucket divergences use it instead of recomputing 1 - sum(top-k p) from float32 values, which is
rounding noise once the true rest is below ~1e-7. Every reference here is re-derived in float64 with
numpy from the probabilities the case is built from (the rest as a sum over the ids outside the top-k,
never as 1 - sum), not with the implementation's code.
"""

import numpy as np
import pytest
import torch

from gndpo.pipeline.methods.losses import LOGP_FLOOR, DivergenceTerm, combined_token_losses, rest_logprob, topk_divergence
from gndpo.stages.models.batches import make_batch
from gndpo.stages.models.logprobs import pair_token_stats
from gndpo.stages.models.prompt_logprobs import flat_response_logprobs
from gndpo.stages.teachers.engine import rest_logprob_from_topk
from tests.conftest import float32_sum_tol, forward_terms, round_share

KINDS = ("forward_kl", "reverse_kl", "jsd")
BETA = 0.3


def kl64(p, q):
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    nz = p > 0
    return float((p[nz] * (np.log(p[nz]) - np.log(q[nz]))).sum())


def divergence64(kind, pt, ps, beta=BETA):
    if kind == "forward_kl":
        return kl64(pt, ps)
    if kind == "reverse_kl":
        return kl64(ps, pt)
    m = beta * np.asarray(pt) + (1 - beta) * np.asarray(ps)
    return beta * kl64(pt, m) + (1 - beta) * kl64(ps, m)


def confident_case(seed, V, k, teacher_rest, student_topk_mass, positions=4):
    """Float64 probabilities of a teacher holding all but ``teacher_rest`` of its mass on k ids (ids 0..k-1,
    the top-k by construction) and a student holding ``student_topk_mass`` on those ids, at a few
    positions; with what score and train would hand the loss: float32 top-k log-probs of both, and
    the teacher's stored rest, float32(log(sum of the other ids' p))."""
    rng = np.random.default_rng(seed)
    pt = np.concatenate([rng.dirichlet(np.ones(k), positions) * (1 - teacher_rest),
                         rng.dirichlet(np.ones(V - k), positions) * teacher_rest], axis=1)
    ps = np.concatenate([rng.dirichlet(np.ones(k), positions) * student_topk_mass,
                         rng.dirichlet(np.ones(V - k), positions) * (1 - student_topk_mass)], axis=1)
    assert (pt[:, :k].min(1) > pt[:, k:].max(1)).all()
    stored = {
        "t_topk": torch.tensor(np.log(pt[:, :k]), dtype=torch.float32),
        "s_topk": torch.tensor(np.log(ps[:, :k]), dtype=torch.float32),
        "t_rest": torch.tensor(np.log(pt[:, k:].sum(1)), dtype=torch.float32),
    }
    return pt, ps, stored


def bucket64(kind, pt, ps, k):
    """The divergence between the two distributions coarsened to {each of the k ids, the rest}."""
    bt = np.append(pt[:k], pt[k:].sum())
    bs = np.append(ps[:k], ps[k:].sum())
    return divergence64(kind, bt, bs)


# -- the lower bound holds with the stored rest, and is broken by the recomputed one -----------------
CASES = [  # (V, k, the teacher's true rest, the student's mass on the teacher's top-k)
    (1000, 16, 1e-12, 0.985),
    (1000, 16, 5.7e-11, 0.985),
    (200, 8, 1e-12, 0.5),
    (200, 8, 1e-15, 0.9),  # below REST_MASS_FLOOR: the stored rest is still used as it is
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("V,k,teacher_rest,student_mass", CASES)
def test_stored_rest_gives_the_float64_bucket_divergence_below_the_full_one(kind, V, k, teacher_rest, student_mass):
    pt, ps, stored = confident_case(0, V, k, teacher_rest, student_mass)
    # As train computes it: float32 inputs, float32 arithmetic.
    got = topk_divergence(kind, stored["s_topk"], stored["t_topk"], beta=BETA, teacher_rest_logp=stored["t_rest"])
    assert got.dtype == torch.float32
    for i in range(len(pt)):
        full = divergence64(kind, pt[i], ps[i])
        want = bucket64(kind, pt[i], ps[i], k)
        assert want <= full  # data processing, in float64
        assert float(got[i]) == pytest.approx(want, rel=2e-5, abs=1e-7)
        assert float(got[i]) <= full * (1 + 1e-6) + 1e-7


def test_recomputed_rest_breaks_the_lower_bound_at_a_confident_teacher():
    """Negative control, the issue's case: V = 1,000, k = 16, the teacher's rest 5.7e-11. From float32
    top-k values 1 - sum(p) is rounding noise (clamped at REST_MASS_FLOOR here), so the bucket reverse
    KL comes out above the full-vocabulary one; the stored rest gives the float64 bucket value."""
    pt, ps, stored = confident_case(0, 1000, 16, 5.7e-11, 0.985)
    old = topk_divergence("reverse_kl", stored["s_topk"], stored["t_topk"])
    new = topk_divergence("reverse_kl", stored["s_topk"], stored["t_topk"], teacher_rest_logp=stored["t_rest"])
    full = np.array([divergence64("reverse_kl", pt[i], ps[i]) for i in range(len(pt))])
    want = np.array([bucket64("reverse_kl", pt[i], ps[i], 16) for i in range(len(pt))])
    print("full", full, "bucket64", want, "stored rest", new.numpy(), "recomputed rest", old.numpy())
    assert (old.numpy() > full + 0.02).all()  # above the bound by far more than any rounding
    np.testing.assert_allclose(new.numpy(), want, rtol=2e-5)
    # The recomputed teacher rest itself: nowhere near 5.7e-11.
    recomputed = rest_logprob(stored["t_topk"]).squeeze(-1).exp().numpy()
    assert (np.abs(recomputed / 5.7e-11 - 1) > 0.5).all()


def test_vllm_fallback_is_one_minus_the_top_k_mass_in_float64():
    """score.backend vllm has only the top-k: its stored rest is log(1 - sum p) in float64 with the mass
    floored at REST_MASS_FLOOR, what train recomputed before (and still does for old shards)."""
    lp = np.log(np.array([[0.5, 0.25, 0.125], [0.6, 0.4, 1e-30], [0.7, 0.3, 0.1], [0.9, 0.1 - 1e-9, 1e-30]]))
    got = rest_logprob_from_topk(lp)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got[[0, 3]], np.log([0.125, 1e-9]), rtol=1e-6)
    assert got[1] == pytest.approx(np.log(1e-12), rel=1e-6)  # nothing left: the floor
    assert got[2] == pytest.approx(np.log(1e-12), rel=1e-6)  # more than all of it: the floor
    # from float32 values (what vLLM returns) a rest of 1e-9 is lost in their rounding: the limitation
    assert abs(float(rest_logprob_from_topk(lp[3:].astype(np.float32))[0]) - np.log(1e-9)) > 1.0


def test_a_servers_top_k_is_its_largest_log_probs_whatever_rank_it_reports():
    """A position as vLLM's CPU server answered it under ATEN_CPU_CAPABILITY=avx2 (on an AVX-512
    machine): the top 8 and the prompt's token 9, which has eight larger log-probs beside it but came
    with rank 6. The stored top-k is the 8 largest, in order, and its rest the mass beside them."""
    answer = {4: (1, -1.8974), 3: (2, -2.0068), 2: (3, -2.1207), 11: (4, -2.6637), 6: (5, -2.7402), 9: (6, -2.9975),
              10: (6, -2.8874), 8: (7, -2.9072), 5: (8, -2.9856)}
    got = flat_response_logprobs([[{}, answer]], [[9]], 8)
    assert got["logprobs"].tolist() == [np.float32(-2.9975)]
    assert got["topk_ids"].tolist() == [[4, 3, 2, 11, 6, 10, 8, 5]]
    want = [-1.8974, -2.0068, -2.1207, -2.6637, -2.7402, -2.8874, -2.9072, -2.9856]
    assert got["topk_logprobs"].tolist() == [np.float32(want).tolist()]
    assert float(rest_logprob_from_topk(got["topk_logprobs"])[0]) == pytest.approx(np.log1p(-np.exp(want).sum()), rel=1e-6)


# -- the student's rest: float32 gradients as float64 ones ---------------------------------------------
def expm1_rest_reverse_kl(s_topk, t_topk, t_rest):
    """The earlier student rest, log(-expm1(logsumexp)), inside the bucket reverse KL: written out here
    as the negative control of the gradient test."""
    rest_s = torch.log(torch.clamp(-torch.expm1(torch.logsumexp(s_topk, -1)), min=1e-12))
    q, r = s_topk.exp(), rest_s.exp()
    return (q * (s_topk - t_topk)).sum(-1) + r * (rest_s - t_rest)


def closed_form_gradient(kind, s_topk, t_topk, t_rest):
    """d D / d s_i in float64, from the formulas (q_i = e^{s_i}, r_S = 1 - sum q, r_T the stored rest):
    reverse KL: q_i (s_i - t_i - log r_S + log r_T); forward KL: -p_i + r_T q_i / r_S."""
    s, t = s_topk.astype(np.float64), t_topk.astype(np.float64)
    q, p = np.exp(s), np.exp(t)
    log_rs = np.log1p(-q.sum(-1, keepdims=True))
    log_rt = t_rest.astype(np.float64)[:, None]
    if kind == "reverse_kl":
        return q * (s - t - log_rs + log_rt)
    return -p + np.exp(log_rt - log_rs) * q


@pytest.mark.parametrize("student_mass", [1e-8, 1e-6])
@pytest.mark.parametrize("kind", KINDS)
def test_float32_gradient_of_the_student_rest_matches_float64(kind, student_mass):
    _, _, stored = confident_case(1, 1000, 16, 1e-12, student_mass)
    s32 = stored["s_topk"].clone().requires_grad_()
    s64 = stored["s_topk"].double().requires_grad_()
    w = torch.tensor([1.0, -0.5, 2.0, 0.25])
    (topk_divergence(kind, s32, stored["t_topk"], BETA, teacher_rest_logp=stored["t_rest"]) * w).sum().backward()
    (topk_divergence(kind, s64, stored["t_topk"].double(), BETA, teacher_rest_logp=stored["t_rest"].double()) * w.double()).sum().backward()
    g32, g64 = s32.grad.double().numpy(), s64.grad.numpy()
    rel = np.abs(g32 - g64) / np.abs(g64)
    print(f"{kind} at top-k mass {student_mass:g}: max relative error of the float32 gradient {rel.max():.2e}")
    assert rel.max() < 1e-5
    if kind != "jsd":  # the float64 autograd value against the formula
        want = closed_form_gradient(kind, stored["s_topk"].numpy(), stored["t_topk"].numpy(), stored["t_rest"].numpy())
        np.testing.assert_allclose(g64, want * w.double().numpy()[:, None], rtol=1e-9)


def test_expm1_form_of_the_student_rest_loses_its_gradient():
    """Negative control: the expm1 form's float32 gradient at a top-k mass of 1e-8 is far off float64's."""
    _, _, stored = confident_case(1, 1000, 16, 1e-12, 1e-8)
    s32 = stored["s_topk"].clone().requires_grad_()
    s64 = stored["s_topk"].double().requires_grad_()
    expm1_rest_reverse_kl(s32, stored["t_topk"], stored["t_rest"]).sum().backward()
    expm1_rest_reverse_kl(s64, stored["t_topk"].double(), stored["t_rest"].double()).sum().backward()
    rel = (s32.grad.double() - s64.grad).abs() / s64.grad.abs()
    print(f"expm1 form: max relative error of the float32 gradient {float(rel.max()):.2e}")
    assert float(rel.max()) > 1e-3


def test_rest_logprob_is_accurate_across_the_range():
    """Value of the student's rest against float64 log1p(-sum p), from a rest of 1e-7 to a top-k mass of 1e-30."""
    for mass in (1 - 1e-6, 0.999, 0.7, 0.5, 0.2, 1e-4, 1e-8, 1e-30):
        topk = np.log(np.full(4, mass / 4))
        want = np.log1p(-mass)
        got = float(rest_logprob(torch.tensor(topk, dtype=torch.float32))[0])
        assert got == pytest.approx(want, rel=2e-6 if mass < 0.9 else 2e-2, abs=1e-12), mass


def test_empty_stored_rest_stays_finite():
    """k = vocabulary: score stores LOGP_FLOOR for an empty rest; values and gradients stay finite and the
    divergence is the full one."""
    rng = np.random.default_rng(3)
    pt, ps = rng.dirichlet(np.ones(6), 2), rng.dirichlet(np.ones(6), 2)
    for kind in KINDS:
        s = torch.tensor(np.log(ps), requires_grad=True)
        out = topk_divergence(kind, s, torch.tensor(np.log(pt)), BETA, teacher_rest_logp=torch.full((2,), LOGP_FLOOR, dtype=torch.float64))
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(s.grad).all()
        for i in range(2):
            assert float(out[i].detach()) == pytest.approx(divergence64(kind, pt[i], ps[i]), abs=1e-7)


def test_bucket_divergence_is_the_full_one_when_k_is_the_vocabulary():
    """k = V: nothing lies outside the top-k, so the bucket divergence must equal the full-vocabulary
    one (float64, to rounding), and reverse KL must never exceed it. With a rest bucket kept, the
    student's rest floored at 1e-12 against the teacher's stored LOGP_FLOOR added ~1e-8 per token."""
    rng = np.random.default_rng(5)
    V = 7
    pt, ps = rng.dirichlet(np.ones(V), 3), rng.dirichlet(np.ones(V), 3)
    empty = torch.full((3,), LOGP_FLOOR, dtype=torch.float64)
    for kind in KINDS:
        got = topk_divergence(kind, torch.tensor(np.log(ps)), torch.tensor(np.log(pt)), BETA, teacher_rest_logp=empty, covers_vocabulary=True)
        for i in range(3):
            want = divergence64(kind, pt[i], ps[i])
            assert abs(float(got[i]) - want) < 1e-14, (kind, float(got[i]) - want)


def test_train_drops_the_rest_bucket_exactly_when_k_is_the_vocabulary(tiny_assets, monkeypatch):
    """Train's micro-batch loss tells the divergence that the teacher's top-k covers the vocabulary
    when k = V (the student's output width), and only then."""
    from transformers import AutoModelForCausalLM

    from gndpo.pipeline.config.load import config_from_dict
    from gndpo.stages.training import objective as loss_module
    from gndpo.stages.training.batch import TrainRow

    model = AutoModelForCausalLM.from_pretrained(tiny_assets / "student").eval()
    V = model.config.vocab_size
    seen = []

    def spy(logp, policy, divergence):
        seen.append(divergence.covers_vocabulary)
        return combined_token_losses(logp, policy, divergence)

    monkeypatch.setattr(loss_module, "combined_token_losses", spy)
    cfg = config_from_dict({"student": str(tiny_assets / "student"), "teacher": str(tiny_assets / "teacher"),
                            "data": {"train": "x"}, "method": {"name": "reverse_kl"}})
    objective = loss_module.Objective.of(cfg, 0, 0, torch.device("cpu"))
    for k, covers in ((V, True), (4, False)):
        n = 3
        logp = np.log(np.random.default_rng(k).dirichlet(np.ones(V), n)).astype(np.float32)
        ids = np.argsort(-logp, axis=-1)[:, :k].astype(np.int32)
        row = TrainRow("r", np.array([1, 4, 5]), np.array([6, 7, 2]), np.full(n, -1.0, np.float32), np.zeros(n, np.float32),
                       np.zeros(n, np.float32), np.ones(n, np.float32), np.ones(n, np.float32), 1.0,
                       ids, np.take_along_axis(logp, ids, -1), np.full(n, LOGP_FLOOR if k == V else -1.0, np.float32))
        objective.micro_batch_loss(model, [row], 0, 1, n, 1.0)
        assert seen[-1] is covers


def test_combined_token_losses_passes_the_stored_rest():
    _, _, stored = confident_case(0, 1000, 16, 5.7e-11, 0.985)
    s, t, r = (stored[n].view(2, 2, *stored[n].shape[1:]) for n in ("s_topk", "t_topk", "t_rest"))
    zeros, ones = torch.zeros(2, 2), torch.ones(2, 2)
    losses, _ = combined_token_losses(zeros, None, DivergenceTerm("reverse_kl", ones, s, t, teacher_rest_logp=r))
    assert torch.equal(losses, topk_divergence("reverse_kl", s, t, teacher_rest_logp=r))
    assert not torch.equal(losses, topk_divergence("reverse_kl", s, t))


# -- score's stored column: the full softmax's rest ------------------------------------------------------
def test_score_stores_the_full_softmax_rest(tiny_assets):
    """pair_token_stats on the toy pair against a plain transformers forward: the stored rest equals a
    float64 logsumexp over the log-probs of the ids outside the teacher's top-k."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny_assets / "teacher").eval()
    student = AutoModelForCausalLM.from_pretrained(tiny_assets / "student").eval()
    V = teacher.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, V, size=n).tolist() for n in (4, 7)]
    responses = [rng.integers(3, V, size=n).tolist() for n in (6, 3)]
    batch = make_batch(prompts, responses, 0, torch.device("cpu"))
    for k in (4, V):
        got = pair_token_stats(teacher, student, batch, 4, 1.0, topk=k)
        assert got["teacher_rest_logprob"].dtype == torch.float32
        at = 0
        for p, r in zip(prompts, responses):
            with torch.no_grad():
                logits = teacher(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1]
            logp = torch.log_softmax(logits.double(), -1)
            # Two float32 forwards (batched, alone); the rest, a log-sum-exp of log-probs, within their
            # rounding at the log-probs' size (tests/conftest.py).
            tol = float32_sum_tol(forward_terms(teacher.config, len(p) + len(r)), float(logp.abs().max()))
            for j in range(len(r)):
                ids = got["teacher_topk_ids"][at + j].long()
                others = np.setdiff1d(np.arange(V), ids.numpy())
                want = float(torch.logsumexp(logp[j, others], -1)) if len(others) else LOGP_FLOOR
                assert float(got["teacher_rest_logprob"][at + j]) == pytest.approx(want, rel=tol["rtol"], abs=tol["atol"])
                assert set(ids.tolist()) == set(logp[j].topk(k).indices.tolist())
            at += len(r)


# -- through the stages: score writes the column, train reads it, and shards without it still train -------
@pytest.mark.slow
def test_score_writes_the_rest_and_train_reads_it_or_recomputes_it(rolled_out, tmp_path, monkeypatch):
    """Round 0's rollouts re-scored for reverse KL (top-4) with score.dtype bfloat16: the rest column is
    there for every token, in full float32 (not bf16-rounded) and consistent with the top-k. A second
    fork scored as before this column existed (the schema without it) gives train rows without a stored
    rest, and both train."""
    from gndpo.pipeline.run.run import open_run
    from gndpo.stages.scoring import shard as score_shard
    from gndpo.storage import shards
    from tests.conftest import committed_rows, invoke_ok, run_stages

    new, old = tmp_path / "new" / "run", tmp_path / "old" / "run"
    for run_dir in (new, old):
        invoke_ok("fork", rolled_out, run_dir, "--from-round", "0", "method.name=reverse_kl", "score.teacher_topk=4", "score.dtype=bfloat16")
    run_stages(new, "score")
    rests = []
    for row in committed_rows(new, "score"):
        rest = np.asarray(row["teacher_rest_logprob"], np.float32)
        topk = np.asarray(row["teacher_topk_logprobs"], np.float64)
        assert len(rest) == len(row["teacher_logprobs"]) and np.isfinite(rest).all()
        total = np.logaddexp(np.logaddexp.reduce(topk, axis=-1), rest)  # the whole distribution: log 1
        assert np.abs(total).max() < 2e-2  # the top-k values are bf16-rounded
        rests.append(rest)
    assert (np.concatenate(rests).view(np.uint32) & 0xFFFF).any()  # not rounded to bf16

    def schema_before(topk):
        schema = shards.scores_schema(topk)
        return schema.remove(schema.get_field_index("teacher_rest_logprob"))

    monkeypatch.setattr(score_shard, "scores_schema", schema_before)  # where the score stage builds its table
    run_stages(old, "score")
    monkeypatch.undo()
    assert "teacher_rest_logprob" not in committed_rows(old, "score")[0]

    for run_dir, stored in ((new, True), (old, False)):
        run_stages(run_dir, "normalize")
        with round_share(open_run(str(run_dir)), 0) as share:
            rows = share.all_rows()
        assert rows and all((r.topk_rest is not None) == stored for r in rows)
        if stored:
            assert all(len(r.topk_rest) == len(r.response) for r in rows)
        run_stages(run_dir, "train")
        metrics = open_run(str(run_dir)).records(0, "train").require_manifest().metrics
        assert np.isfinite(metrics["loss_mean"]) and np.isfinite(metrics["grad_norm_mean"])
