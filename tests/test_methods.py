"""OPD / GNDPO advantages and the policy losses, against straightforward re-derivations of
docs/reference/methods.md (opd and gndpo) written here with plain Python loops (not the implementation)."""

import math

import numpy as np
import pytest
import torch

from gndpo.errors import GndpoError
from gndpo.pipeline.methods import Response, Stats, clamped_score, get_method, gndpo_stats_from_sums, response_targets, score_partial_sums
from gndpo.pipeline.methods.losses import aggregate, token_losses
from gndpo.pipeline.settings.schema import MethodConfig


def as_response(t, s, mask) -> Response:
    z = np.zeros_like(mask)
    return Response("r", "p", mask, t, s, s, {}, 0.0, z)


def make_responses(seed=0, n=7):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(1, 9))
        t = rng.normal(-1.5, 2.0, size=length)
        s = rng.normal(-1.0, 1.0, size=length)
        if i == 0:
            t[0], s[0] = -30.0, -0.1  # far outside the clamp
        if i == 1 and length > 1:
            t[1], s[1] = -0.01, -40.0
        mask = (rng.random(length) > 0.2).astype(float)
        out.append((t, s, mask))
    return out


def reference_gndpo(responses, clamp=5.0, eps=1e-8):
    """Section 2 verbatim, with loops."""
    cs = []
    for t, s, _ in responses:
        cs.append([max(-clamp, min(clamp, a - b)) for a, b in zip(t, s)])
    valid = [c for cr, (_, _, m) in zip(cs, responses) for c, mm in zip(cr, m) if mm == 1]
    n = len(valid)
    mu = sum(valid) / n
    var = sum((c - mu) ** 2 for c in valid) / n * n / (n - 1)
    adv = [[(c - mu) / math.sqrt(var + eps) * mm for c, mm in zip(cr, m)] for cr, (_, _, m) in zip(cs, responses)]
    return n, mu, var, adv


def implementation_gndpo(responses, cfg=MethodConfig()):
    """What score (partial sums), normalize (sum of sums) and train (advantages) do, in sequence."""
    parts = [score_partial_sums(clamped_score(t, s, cfg.clamp), m) for t, s, m in responses]
    stats = gndpo_stats_from_sums(
        sum(p["n_valid"] for p in parts), sum(p["c_sum"] for p in parts), sum(p["c_sq_sum"] for p in parts)
    )
    advs = [response_targets(as_response(t, s, m), Stats(stats), cfg, 0).adv for t, s, m in responses]
    return stats, advs


def test_gndpo_statistics_and_advantages_match_reference():
    responses = make_responses()
    n, mu, var, ref_adv = reference_gndpo(responses)
    stats, advs = implementation_gndpo(responses)
    assert stats["token_count"] == n
    assert stats["c_mean"] == pytest.approx(mu, rel=1e-12, abs=1e-12)
    assert stats["c_var"] == pytest.approx(var, rel=1e-9)
    for got, want in zip(advs, ref_adv):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_gndpo_normalized_advantages_have_zero_mean_unit_std_over_valid_tokens():
    _, advs = implementation_gndpo(make_responses(seed=3, n=20))
    responses = make_responses(seed=3, n=20)
    valid = np.concatenate([a[m == 1] for a, (_, _, m) in zip(advs, responses)])
    assert abs(valid.mean()) < 1e-9
    assert valid.std(ddof=1) == pytest.approx(1.0, rel=1e-6)
    # masked tokens carry no advantage
    assert all((a[m == 0] == 0).all() for a, (_, _, m) in zip(advs, responses))


def test_gndpo_needs_two_valid_tokens():
    with pytest.raises(GndpoError):
        gndpo_stats_from_sums(1, 0.3, 0.09)


def test_opd_advantage_is_clamped_score_times_mask():
    t = np.array([-1.0, -20.0, -0.5, -3.0])
    s = np.array([-2.0, -0.5, -9.0, -3.5])
    m = np.array([1.0, 1.0, 1.0, 0.0])
    adv = response_targets(as_response(t, s, m), Stats(), MethodConfig(name="opd"), 0).adv
    np.testing.assert_allclose(adv, [1.0, -5.0, 5.0, 0.0])


def test_unknown_method_is_a_user_error():
    with pytest.raises(GndpoError):
        get_method("nope")


# -- policy losses -----------------------------------------------------------------------------


def batch(seed=0, B=4, T=5):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g) * 3).double()
    old = logp + 0.3 * torch.randn(B, T, generator=g).double()
    adv = torch.randn(B, T, generator=g).double()
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return logp, old, adv, mask


def reference_gspo(logp, old, adv, mask, eps_low=0.2, eps_high=0.2):
    """Value and d loss / d logp of GSPO-token + seq-mean-token-mean, element by element."""
    B, T = logp.shape
    loss, grad = 0.0, torch.zeros_like(logp)
    for i in range(B):
        n_i = sum(float(mask[i, t]) for t in range(T))
        lsr = sum(float((logp[i, t] - old[i, t]) * mask[i, t]) for t in range(T)) / max(1.0, n_i)
        s = math.exp(min(lsr, 10.0))
        seq = 0.0
        for t in range(T):
            if mask[i, t] == 0:
                continue
            a = float(adv[i, t])
            unclipped, clipped = -a * s, -a * min(max(s, 1 - eps_low), 1 + eps_high)
            seq += max(unclipped, clipped)
            # d s_it / d logp_it = s_it through the straight-through term; the clipped branch is flat.
            if unclipped >= clipped:
                grad[i, t] = -a * s / n_i / B
        loss += seq / n_i
    return loss / B, grad


def test_gspo_loss_value_and_gradient_match_reference():
    logp, old, adv, mask = batch()
    x = logp.clone().requires_grad_(True)
    losses, _ = token_losses("gspo", x, old, adv, mask)
    loss = aggregate(losses, mask, "seq-mean-token-mean", n_seqs=4, n_tokens=int(mask.sum()))
    loss.backward()
    want_loss, want_grad = reference_gspo(logp, old, adv, mask)
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-10)
    torch.testing.assert_close(x.grad * mask, want_grad, rtol=1e-9, atol=1e-12)


def test_gspo_at_old_policy_is_minus_mean_advantage():
    """pi_theta == pi_old (one step per rollout batch): ratio 1, loss = -seq-mean of token-mean A."""
    logp, _, adv, mask = batch(seed=1)
    losses, clipped = token_losses("gspo", logp, logp.clone(), adv, mask)
    loss = aggregate(losses, mask, "seq-mean-token-mean", 4, int(mask.sum()))
    want = -np.mean([float((adv[i] * mask[i]).sum() / mask[i].sum()) for i in range(4)])
    assert float(loss) == pytest.approx(want, rel=1e-12)
    assert float(clipped.sum()) == 0


def test_ppo_token_ratio_and_token_mean_match_reference():
    logp, old, adv, mask = batch(seed=2)
    losses, _ = token_losses("ppo", logp, old, adv, mask, 0.2, 0.28)
    got = aggregate(losses, mask, "token-mean", 4, int(mask.sum()))
    total, count = 0.0, 0
    for i in range(4):
        for t in range(5):
            if mask[i, t]:
                r = math.exp(float(logp[i, t] - old[i, t]))
                a = float(adv[i, t])
                total += max(-a * r, -a * min(max(r, 0.8), 1.28))
                count += 1
    assert float(got) == pytest.approx(total / count, rel=1e-10)


def test_reinforce_loss():
    logp, old, adv, mask = batch(seed=4)
    losses, _ = token_losses("reinforce", logp, old, adv, mask)
    got = aggregate(losses, mask, "token-mean", 4, int(mask.sum()))
    want = sum(-float(adv[i, t] * logp[i, t]) for i in range(4) for t in range(5) if mask[i, t]) / float(mask.sum())
    assert float(got) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_micro_batch_shares_sum_to_the_full_batch_loss(mode):
    """Normalising by the step's global counts makes gradient accumulation exact."""
    logp, old, adv, mask = batch(seed=5, B=6)
    full_losses, _ = token_losses("gspo", logp, old, adv, mask)
    n_seqs, n_tokens = 6, int(mask.sum())
    full = aggregate(full_losses, mask, mode, n_seqs, n_tokens)
    shares = 0.0
    for sl in (slice(0, 1), slice(1, 4), slice(4, 6)):
        part, _ = token_losses("gspo", logp[sl], old[sl], adv[sl], mask[sl])
        shares += float(aggregate(part, mask[sl], mode, n_seqs, n_tokens))
    assert shares == pytest.approx(float(full), rel=1e-12)


def test_reward_weighted_loss_is_the_weighted_mean_of_response_token_means():
    """reward_beta > 0: loss = sum_i w_i L_i / sum_i w_i, L_i response i's mean over its valid tokens,
    whatever loss_agg says (a token mean would weight long responses by their length), and the
    micro-batch shares still add up to it."""
    from gndpo.pipeline.methods import policy_settings
    from gndpo.pipeline.settings.schema import MethodConfig

    for loss_agg in ("", "token-mean", "seq-mean-token-mean"):
        assert policy_settings(MethodConfig(name="forward_kl", reward_beta=0.5, loss_agg=loss_agg))[1] == "weighted-seq-mean"
    assert policy_settings(MethodConfig(name="forward_kl"))[1] == "token-mean"

    rng = np.random.default_rng(8)
    lengths, w = [1, 7, 3, 12, 5], rng.uniform(0.1, 3.0, size=5)
    L = [rng.normal(size=n) for n in lengths]
    want = sum(wi * float(np.mean(li)) for wi, li in zip(w, L)) / float(w.sum())
    token_mean = sum(wi * float(li.sum()) for wi, li in zip(w, L)) / sum(lengths)
    assert abs(want - token_mean) > 1e-3  # the two aggregations really differ on this case

    T = max(lengths)
    losses, mask = torch.zeros(5, T, dtype=torch.float64), torch.zeros(5, T, dtype=torch.float64)
    for i, li in enumerate(L):
        losses[i, : len(li)] = torch.from_numpy(li)
        mask[i, : len(li)] = 1
    weighted = losses * torch.from_numpy(w).unsqueeze(-1)  # train multiplies by w_i before aggregating
    shares = sum(
        float(aggregate(weighted[sl], mask[sl], "weighted-seq-mean", 5, sum(lengths), float(w.sum())))
        for sl in (slice(0, 2), slice(2, 5))
    )
    assert shares == pytest.approx(want, rel=1e-12)
