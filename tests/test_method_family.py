"""Every method of docs/reference/methods.md after opd/gndpo against a re-derivation written here from the
formulas, with plain loops on small hand-made responses (not the implementation's vectorized code).

The statistics go through the same DuckDB queries normalize runs, over tables built here with the
columns of normalize's ``responses`` and ``tokens`` views; tests/test_method_stages.py checks the
real normalize stage against numpy on real shards.
"""

import math

import duckdb
import numpy as np
import pytest
import torch

from gndpo.errors import GndpoError
from gndpo.pipeline.methods import (
    METHODS,
    Response,
    Stats,
    StatsQuery,
    clamped_score,
    gndpo_stats_from_sums,
    method_statistics,
    response_targets,
    score_needs,
    score_partial_sums,
)
from gndpo.pipeline.methods.divergence import scheduled_divergence
from gndpo.pipeline.methods.losses import token_losses, topk_divergence
from gndpo.pipeline.settings.schema import MethodConfig, OutcomeConfig, PacedConfig, ReopoldConfig, TipConfig, TropdConfig


def make_batch(seed=0, prompts=4, n=3, lengths=(1, 7), with_prefix=False):
    """Responses with every column a method can ask for; some groups are singletons."""
    rng = np.random.default_rng(seed)
    out = []
    for p in range(prompts):
        group = 1 if p == 0 else n  # prompt 0: a singleton group
        for s in range(group):
            L = int(rng.integers(*lengths)) + 1
            mask = (rng.random(L) > 0.15).astype(float)
            prefix = np.zeros(L)
            if with_prefix and s == 0 and L > 2:
                prefix[:2], mask[:2] = 1.0, 0.0
            rewards = {"exact_match": float(rng.random() < 0.4), "integer_format": float(rng.random() < 0.7),
                       "answer_length": float(rng.random() < 0.5)}
            out.append(Response(
                rollout_id=f"r-{p}-{s}", prompt_id=f"p{p}", mask=mask,
                teacher_lp=rng.normal(-1.5, 1.5, L), student_lp=rng.normal(-1.0, 0.8, L), sampler_lp=rng.normal(-1.0, 0.8, L),
                rewards=rewards, reward=rewards["exact_match"], prefix=prefix,
                teacher_entropy=rng.uniform(0.0, 2.0, L), student_entropy=rng.uniform(0.0, 3.0, L),
                token_kl=rng.normal(0.3, 0.4, L),
            ))
    return out


def stats_for(batch, cfg, round_idx=0) -> Stats:
    """What normalize commits: the base GNDPO statistics plus the method's DuckDB statistics, over
    tables shaped like normalize's views."""
    con = duckdb.connect()
    resp_rows, tok_rows, parts = [], [], []
    for r in batch:
        c = clamped_score(r.teacher_lp, r.student_lp, cfg.clamp)
        part = score_partial_sums(c, r.mask)
        parts.append(part)
        resp_rows.append((r.rollout_id, r.prompt_id, r.reward, r.rewards, part["n_valid"], part["c_sum"], part["c_sq_sum"]))
        for t in range(len(r.mask)):
            if r.mask[t] == 1:
                tok_rows.append((r.rollout_id, r.prompt_id, t, r.teacher_lp[t], r.student_lp[t], r.teacher_entropy[t],
                                 r.student_entropy[t], r.token_kl[t]))
    con.sql("CREATE TABLE responses (rollout_id VARCHAR, prompt_id VARCHAR, reward DOUBLE, rewards MAP(VARCHAR, DOUBLE), "
            "n_valid BIGINT, c_sum DOUBLE, c_sq_sum DOUBLE)")
    con.executemany("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)", resp_rows)
    con.sql("CREATE TABLE tokens (rollout_id VARCHAR, prompt_id VARCHAR, t BIGINT, lpT DOUBLE, lpS DOUBLE, hT DOUBLE, hS DOUBLE, kl DOUBLE)")
    con.executemany("INSERT INTO tokens VALUES (?, ?, ?, ?, ?, ?, ?, ?)", tok_rows)
    glob = gndpo_stats_from_sums(sum(p["n_valid"] for p in parts), sum(p["c_sum"] for p in parts), sum(p["c_sq_sum"] for p in parts))
    g, groups = method_statistics(StatsQuery(con), cfg, round_idx)
    return Stats({**glob, **g}, groups)


def targets(batch, cfg, round_idx=0):
    stats = stats_for(batch, cfg, round_idx)
    return stats, [response_targets(r, stats, cfg, round_idx) for r in batch]


def valid_values(batch, key):
    return [v for r in batch for v, m in zip(getattr(r, key), r.mask) if m == 1]


def quantile(values, q):
    """Linear-interpolation quantile, written out (numpy's and DuckDB quantile_cont's definition)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean_var(values):
    m = sum(values) / len(values)
    return m, sum((v - m) ** 2 for v in values) / (len(values) - 1)


# -- section 10: Tinker and MiniLLM -----------------------------------------------------------------
def test_tinker_advantage_and_unclipped_importance_loss():
    batch = make_batch(seed=1)
    cfg = MethodConfig(name="tinker")
    _, ts = targets(batch, cfg)
    for r, t in zip(batch, ts):
        want = [(a - b) * m for a, b, m in zip(r.teacher_lp, r.sampler_lp, r.mask)]
        np.testing.assert_allclose(t.adv, want, rtol=1e-12)
    logp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    sampler, adv = torch.tensor([[-0.7, -0.9]]), torch.tensor([[2.0, -1.0]])
    losses, _ = token_losses("is", logp, sampler, adv, torch.ones(1, 2))
    want = [-2.0 * math.exp(-0.5 + 0.7), 1.0 * math.exp(-1.0 + 0.9)]  # no clip even far from 1
    np.testing.assert_allclose(losses.detach().numpy()[0], want, rtol=1e-6)


def test_minillm_returns_and_whitening():
    batch = make_batch(seed=2)
    cfg = MethodConfig(name="minillm", minillm_gamma=0.9)
    stats, ts = targets(batch, cfg)
    raw = []
    for r in batch:
        ret = []
        for t in range(len(r.mask)):
            later = [k for k in range(t, len(r.mask)) if r.mask[k] == 1]
            ret.append(sum(0.9 ** (k - t) * (r.teacher_lp[k] - r.student_lp[k]) for k in later) / len(later) if later else 0.0)
        raw.append(ret)
    mu, var = mean_var([a for ret, r in zip(raw, batch) for a, m in zip(ret, r.mask) if m == 1])
    assert stats["minillm_mean"] == pytest.approx(mu, rel=1e-9)
    assert stats["minillm_var"] == pytest.approx(var, rel=1e-9)
    for ret, r, t in zip(raw, batch, ts):
        want = [(a - mu) / math.sqrt(var + 1e-8) * m for a, m in zip(ret, r.mask)]
        np.testing.assert_allclose(t.adv, want, rtol=1e-7, atol=1e-12)


# -- section 3: divergences on the teacher top-k, reward weighting -----------------------------------
def divergence_reference(kind, s_full, t_topk, ids, beta=0.5):
    """Loops over the k ids: p~_T renormalized teacher, slp the student's full-softmax log-probs."""
    z_t = sum(math.exp(v) for v in t_topk)
    pt = [math.exp(v) / z_t for v in t_topk]
    s = [s_full[i] for i in ids]
    if kind == "forward_kl":
        return sum(p * (math.log(p) - si) for p, si in zip(pt, s))
    z_s = sum(math.exp(v) for v in s)
    ps = [math.exp(v) / z_s for v in s]
    if kind == "reverse_kl":
        return sum(q * (math.log(q) - math.log(p)) for p, q in zip(pt, ps))
    m = [beta * p + (1 - beta) * q for p, q in zip(pt, ps)]
    return beta * sum(p * math.log(p / mm) for p, mm in zip(pt, m)) + (1 - beta) * sum(q * math.log(q / mm) for q, mm in zip(ps, m))


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_topk_divergences_match_reference(kind):
    rng = np.random.default_rng(3)
    V, k = 11, 4
    s_full = torch.log_softmax(torch.tensor(rng.normal(size=(2, 3, V))), -1)
    t_full = torch.log_softmax(torch.tensor(rng.normal(size=(2, 3, V)) * 2), -1)
    t_topk, ids = t_full.topk(k, dim=-1)
    got = topk_divergence(kind, torch.gather(s_full, 2, ids), t_topk, beta=0.3, form="renormalized")
    for b in range(2):
        for t in range(3):
            want = divergence_reference(kind, s_full[b, t].tolist(), t_topk[b, t].tolist(), ids[b, t].tolist(), beta=0.3)
            assert float(got[b, t]) == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_full_vocabulary_topk_is_the_exact_divergence():
    rng = np.random.default_rng(4)
    V = 9
    s = torch.log_softmax(torch.tensor(rng.normal(size=(1, 2, V))), -1)
    t = torch.log_softmax(torch.tensor(rng.normal(size=(1, 2, V))), -1)
    t_topk, ids = t.topk(V, dim=-1)
    s_topk = torch.gather(s, 2, ids)
    fkl = sum(math.exp(a) * (a - b) for a, b in zip(t[0, 0].tolist(), s[0, 0].tolist()))
    rkl = sum(math.exp(b) * (b - a) for a, b in zip(t[0, 0].tolist(), s[0, 0].tolist()))
    assert float(topk_divergence("forward_kl", s_topk, t_topk, form="renormalized")[0, 0]) == pytest.approx(fkl, rel=1e-9)
    assert float(topk_divergence("reverse_kl", s_topk, t_topk, form="renormalized")[0, 0]) == pytest.approx(rkl, rel=1e-9)


def test_divergence_methods_train_every_sampled_token():
    batch = make_batch(seed=5)
    for name in ("reverse_kl", "forward_kl", "jsd"):
        cfg = MethodConfig(name=name)
        assert score_needs(cfg) == {"teacher_topk"}
        _, ts = targets(batch, cfg)
        for r, t in zip(batch, ts):
            np.testing.assert_array_equal(t.div, r.mask)
            assert not t.pg_mask.any() and t.weight == 1.0


def test_reward_weighted_distillation():
    batch = make_batch(seed=6)
    cfg = MethodConfig(name="forward_kl", reward_beta=0.5)
    _, ts = targets(batch, cfg)
    B = len(batch)
    z = sum(math.exp(r.reward / 0.5) for r in batch)
    for r, t in zip(batch, ts):
        assert t.weight == pytest.approx(B * math.exp(r.reward / 0.5) / z, rel=1e-9)
    assert sum(t.weight for t in ts) == pytest.approx(B)


# -- section 4: TIP -------------------------------------------------------------------------------
def test_tip_selection_matches_reference():
    batch = make_batch(seed=7, lengths=(3, 12))
    cfg = MethodConfig(name="reverse_kl", tip=TipConfig(enabled=True, keep_ratio=0.5, entropy_quantile=0.9))
    assert score_needs(cfg) == {"teacher_topk", "student_entropy", "token_kl"}
    stats, ts = targets(batch, cfg)
    cap = quantile(valid_values(batch, "student_entropy"), 0.9)
    hs = [min(h, cap) for h in valid_values(batch, "student_entropy")]
    ds = [max(d, 0.0) for d in valid_values(batch, "token_kl")]
    assert stats["tip_h_cap"] == pytest.approx(cap, rel=1e-12)
    for r, t in zip(batch, ts):
        scores = []
        for i in range(len(r.mask)):
            h = (min(r.student_entropy[i], cap) - min(hs)) / (max(hs) - min(hs))
            d = (max(r.token_kl[i], 0.0) - min(ds)) / (max(ds) - min(ds))
            scores.append(h + d - h * d)
        valid = [i for i in range(len(r.mask)) if r.mask[i] == 1]
        keep = math.floor(0.5 * len(valid))
        chosen = sorted(valid, key=lambda i: (-scores[i], i))[:keep]  # ties: the earlier token
        want = [1.0 if i in chosen else 0.0 for i in range(len(r.mask))]
        np.testing.assert_array_equal(t.mask, want)
        np.testing.assert_array_equal(t.div, want)


def test_tip_ties_keep_the_earlier_token():
    from gndpo.pipeline.methods.tip import tip_selection

    sel = tip_selection(np.array([0.5, 0.9, 0.5, 0.5]), np.ones(4), 0.5)
    np.testing.assert_array_equal(sel, [1, 1, 0, 0])


# -- section 5: PACED ------------------------------------------------------------------------------
def test_paced_weights_and_schedule():
    batch = make_batch(seed=8)
    cfg = MethodConfig(name="paced", paced=PacedConfig(a=1.0, b=2.0))
    stats, ts = targets(batch, cfg)
    for r, t in zip(batch, ts):
        group = [x.reward for x in batch if x.prompt_id == r.prompt_id]
        p = sum(group) / len(group)
        assert stats.group(r.prompt_id)["pass_rate"] == pytest.approx(p)
        assert t.weight == pytest.approx(p * (1 - p) ** 2)
    from gndpo.pipeline.methods import divergence_of

    assert [divergence_of(MethodConfig(name="paced"), r) for r in range(3)] == ["forward_kl", "reverse_kl", "reverse_kl"]
    sched = MethodConfig(name="reverse_kl", schedule="fkl:2,jsd:1,rkl:1")
    assert [divergence_of(sched, r) for r in range(6)] == ["forward_kl", "forward_kl", "jsd", "reverse_kl", "reverse_kl", "reverse_kl"]
    with pytest.raises(GndpoError):
        scheduled_divergence("fkl:0", 0)


# -- sections 6, 7, 8: TrOPD, EOPD, REOPOLD -----------------------------------------------------------
@pytest.mark.parametrize("outlier", ["mask", "clip", "fkl"])
def test_tropd_trust_region_and_guidance(outlier):
    batch = make_batch(seed=9, with_prefix=True)
    cfg = MethodConfig(name="tropd", tropd=TropdConfig(outlier=outlier, tau_quantile=0.4, clip_value=-1.0, fkl_coef=0.7))
    stats, ts = targets(batch, cfg)
    accept = [min(math.exp(a - b), 1.0) for r in batch for a, b, m in zip(r.teacher_lp, r.student_lp, r.mask) if m == 1]
    tau = quantile(accept, 0.4)
    assert stats["tropd_tau"] == pytest.approx(tau, rel=1e-9)
    mu, var = stats["c_mean"], stats["c_var"]
    for r, t in zip(batch, ts):
        for i in range(len(r.mask)):
            ratio = r.teacher_lp[i] - r.student_lp[i]
            trusted = r.mask[i] == 1 and min(math.exp(ratio), 1.0) >= tau
            outl = r.mask[i] == 1 and not trusted
            if outlier == "clip" and outl:
                ratio = max(ratio, -1.0)
            c = max(-5.0, min(5.0, ratio))
            pg = trusted or (outlier == "clip" and outl)
            want_adv = (c - mu) / math.sqrt(var + 1e-8) if pg else 0.0
            want_div = (0.7 if (outlier == "fkl" and outl) else 0.0) + r.prefix[i]
            assert t.adv[i] == pytest.approx(want_adv, rel=1e-9, abs=1e-12)
            assert t.pg_mask[i] == float(pg)
            assert t.div[i] == pytest.approx(want_div)
            assert t.mask[i] == float(pg or want_div > 0)
            if r.prefix[i]:
                assert t.pg_mask[i] == 0  # teacher-written tokens never get a policy-gradient term


def test_eopd_targets():
    batch = make_batch(seed=10)
    cfg = MethodConfig(name="eopd")
    assert score_needs(cfg) == {"teacher_topk", "teacher_entropy"}
    _, ts = targets(batch, cfg)
    for r, t in zip(batch, ts):
        for i in range(len(r.mask)):
            assert t.adv[i] == pytest.approx((r.teacher_lp[i] - r.student_lp[i]) * r.mask[i])
            assert t.div[i] == (1.0 if r.teacher_entropy[i] > 0.8 and r.mask[i] else 0.0)


@pytest.mark.parametrize("round_idx", [0, 1])
def test_reopold_phases(round_idx):
    batch = make_batch(seed=11)
    cfg = MethodConfig(name="reopold", reopold=ReopoldConfig(switch_round=1, lam=0.1, beta=0.2))
    stats, ts = targets(batch, cfg, round_idx)
    floor = math.log(0.1) / 0.9
    cut = quantile(valid_values(batch, "student_entropy"), 0.8) if round_idx else None
    if round_idx:
        assert stats["reopold_entropy_cut"] == pytest.approx(cut, rel=1e-12)
    for r, t in zip(batch, ts):
        for i in range(len(r.mask)):
            R = r.teacher_lp[i] - r.student_lp[i]
            keep = (R >= floor) if round_idx == 0 else (r.student_entropy[i] >= cut)
            m = float(r.mask[i] == 1 and keep)
            assert t.mask[i] == m
            assert t.adv[i] == pytest.approx(max(R, floor) * m)
    logp = torch.tensor([[-0.5, -2.0]])
    losses, _ = token_losses("reinforce", logp, logp, torch.tensor([[1.5, floor]]), torch.ones(1, 2))
    np.testing.assert_allclose(losses.numpy()[0], [-1.5 * -0.5, -floor * -2.0], rtol=1e-6)


# -- section 9: GRPO, GDPO, outcome mixing ----------------------------------------------------------
def group_mean_std(batch, prompt_id, name):
    vals = [r.rewards[name] for r in batch if r.prompt_id == prompt_id]
    if len(vals) < 2:
        return vals[0] if vals else 0.0, float("nan")
    m, v = mean_var(vals)
    return m, math.sqrt(v)


def test_grpo_advantages():
    batch = make_batch(seed=12)
    cfg = MethodConfig(name="grpo", outcome=OutcomeConfig(rewards=["integer_format"]))
    _, ts = targets(batch, cfg)
    for r, t in zip(batch, ts):
        m, s = group_mean_std(batch, r.prompt_id, "integer_format")
        if math.isnan(s):
            m, s = 0.0, 1.0  # a singleton group: mean 0, std 1
        want = (r.rewards["integer_format"] - m) / (s + 1e-6)
        np.testing.assert_allclose(t.adv, want * r.mask, rtol=1e-9)


def test_grpo_sums_the_weighted_rewards_before_the_group_normalization():
    """Several rewards: r_i = sum_k w_k R_k,i first, then (r_i - mean_g) / (std_g + 1e-6) (TRL)."""
    batch = make_batch(seed=15, prompts=5)
    cfg = MethodConfig(name="grpo", outcome=OutcomeConfig(rewards=["exact_match", "integer_format"], weights=[1.0, 0.25]))
    _, ts = targets(batch, cfg)
    summed = {id(r): r.rewards["exact_match"] + 0.25 * r.rewards["integer_format"] for r in batch}
    spread = 0
    for r, t in zip(batch, ts):
        group = [summed[id(x)] for x in batch if x.prompt_id == r.prompt_id]
        m, s = (mean_var(group)[0], math.sqrt(mean_var(group)[1])) if len(group) > 1 else (0.0, 1.0)
        want = (summed[id(r)] - m) / (s + 1e-6)
        np.testing.assert_allclose(t.adv, want * r.mask, rtol=1e-9, atol=1e-12)
        spread += len(set(group)) > 1
    assert spread  # some group's rewards differ, so the weights matter


@pytest.mark.parametrize("mode", ["sequence", "token"])
def test_gdpo_advantages(mode):
    batch = make_batch(seed=13, prompts=5)
    cfg = MethodConfig(name="gdpo", outcome=OutcomeConfig(rewards=["exact_match", "integer_format"], weights=[1.0, 0.5], gdpo_batch_norm=mode))
    _, ts = targets(batch, cfg)
    pre = []
    for r in batch:
        total = 0.0
        for name, w in (("exact_match", 1.0), ("integer_format", 0.5)):
            m, s = group_mean_std(batch, r.prompt_id, name)
            a = (r.rewards[name] - m) / (s + 1e-4)
            total += w * (0.0 if math.isnan(a) else a)
        pre.append(total)
    if mode == "sequence":
        mu, var = mean_var(pre)
        want = [(a - mu) / (math.sqrt(var) + 1e-4) for a in pre]
    else:  # every valid token carries its response's A_pre
        per_token = [a for a, r in zip(pre, batch) for m in r.mask if m == 1]
        mu, var = mean_var(per_token)
        want = [(a - mu) / math.sqrt(var + 1e-8) for a in pre]
    for w, r, t in zip(want, batch, ts):
        np.testing.assert_allclose(t.adv, w * r.mask, rtol=1e-7, atol=1e-12)


def test_outcome_advantage_mixed_into_distillation():
    batch = make_batch(seed=14)
    cfg = MethodConfig(name="gndpo", outcome=OutcomeConfig(coef=0.3, rewards=["exact_match"]))
    stats, ts = targets(batch, cfg)
    for r, t in zip(batch, ts):
        m, s = group_mean_std(batch, r.prompt_id, "exact_match")
        if math.isnan(s):
            m, s = 0.0, 1.0
        outcome = (r.reward - m) / (s + 1e-6)
        for i in range(len(r.mask)):
            c = max(-5.0, min(5.0, r.teacher_lp[i] - r.student_lp[i]))
            want = ((c - stats["c_mean"]) / math.sqrt(stats["c_var"] + 1e-8) + 0.3 * outcome) * r.mask[i]
            assert t.adv[i] == pytest.approx(want, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(
    "cfg_kwargs, fragment",
    [
        ({"name": "gdpo", "outcome": {"rewards": ["nope"]}}, "unknown reward 'nope'"),
        ({"name": "gdpo", "outcome": {"rewards": []}}, "method.outcome.rewards is empty"),
        ({"name": "gdpo", "outcome": {"rewards": ["exact_match"], "weights": [1, 2]}}, "method.outcome.weights must be 1 numbers"),
        ({"name": "reverse_kl", "schedule": "fkl:two"}, "method.schedule: bad entry 'fkl:two'"),
        ({"name": "dpo"}, "config key method.name must be one of opd, gndpo,"),
    ],
)
def test_method_settings_the_schema_cannot_declare_are_refused_by_validate(cfg_kwargs, fragment):
    """What is left to methods.validate (run by gndpo init and fork, never by a stage): the method's name,
    the schedule's entries and the outcome rewards. Choices and ranges are the schema's
    (tests/test_config.py); a bad setting never reaches normalize."""
    from gndpo.pipeline.config.load import config_from_dict
    from gndpo.pipeline.methods import validate

    cfg = config_from_dict({"method": cfg_kwargs}).method
    with pytest.raises(GndpoError, match=fragment) as err:
        validate(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "cfg_kwargs, fragment",
    [
        ({"name": "gdpo", "outcome": {"gdpo_batch_norm": "batch"}}, "method.outcome.gdpo_batch_norm must be one of sequence, token, got 'batch'"),
        ({"name": "tropd", "tropd": {"outlier": "drop"}}, "method.tropd.outlier must be one of mask, clip, fkl, got 'drop'"),
        ({"name": "tropd", "tropd": {"base": "x"}}, "method.tropd.base must be one of opd, gndpo, got 'x'"),
        ({"name": "minillm", "minillm_gamma": 0}, "method.minillm_gamma must be > 0 and <= 1, got 0"),
        ({"name": "jsd", "jsd_beta": 1.0}, "method.jsd_beta must be > 0 and < 1"),
        ({"name": "gndpo", "policy_loss": "dpo"}, "method.policy_loss must be one of"),
    ],
)
def test_bad_method_knobs_are_refused_when_the_config_is_read(cfg_kwargs, fragment):
    """Formerly accepted by init and refused at normalize; now the schema's choices and ranges."""
    from gndpo.pipeline.config.load import config_from_dict

    with pytest.raises(GndpoError, match=None) as err:
        config_from_dict({"method": cfg_kwargs})
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_eopd_loss_is_ppo_opd_plus_gated_forward_kl():
    """Section 7 at the loss level: L_t = L_OPD_t + [H^T_t > 0.8] forward_kl_topk_t, global token mean."""
    from gndpo.pipeline.methods.losses import DivergenceTerm, PolicyGradientTerm, aggregate, combined_token_losses

    rng = np.random.default_rng(16)
    B, T, V, k = 2, 3, 7, 3
    s_full = torch.log_softmax(torch.tensor(rng.normal(size=(B, T, V))), -1)
    t_full = torch.log_softmax(torch.tensor(rng.normal(size=(B, T, V)) * 2), -1)
    ids = torch.tensor(rng.integers(0, V, size=(B, T, 1))).expand(B, T, 1)
    logp = torch.gather(s_full, 2, ids).squeeze(-1)
    old = logp + torch.tensor(rng.normal(0, 0.3, size=(B, T)))
    adv = torch.tensor(rng.normal(size=(B, T)))
    gate = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    t_topk, top_ids = t_full.topk(k, dim=-1)
    losses, _ = combined_token_losses(logp, PolicyGradientTerm("ppo", old, adv, mask),
                                      DivergenceTerm("forward_kl", gate * mask, torch.gather(s_full, 2, top_ids), t_topk, form="renormalized"))
    got = aggregate(losses, mask, "token-mean", B, int(mask.sum()))
    total = 0.0
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            ratio = math.exp(float(logp[b, t] - old[b, t]))
            a = float(adv[b, t])
            ppo = max(-a * ratio, -a * min(max(ratio, 0.8), 1.2))
            fkl = divergence_reference("forward_kl", s_full[b, t].tolist(), t_topk[b, t].tolist(), top_ids[b, t].tolist())
            total += ppo + float(gate[b, t]) * fkl
    assert float(got) == pytest.approx(total / float(mask.sum()), rel=1e-9)


# -- multi-turn responses: tool and template tokens (loss mask 0) -----------------------------------
@pytest.mark.parametrize("name", sorted(METHODS))
def test_no_method_trains_or_counts_masked_tokens(name):
    """Every method, with the outcome mix on: targets are zero wherever the loss mask is 0 (a tool turn
    in a multi-turn response), and what tool tokens hold changes neither the round's statistics nor any
    target at the student's tokens."""
    cfg = MethodConfig(name=name, outcome=OutcomeConfig(coef=0.5))
    batch = make_batch(seed=3)
    stats, out = targets(batch, cfg)
    for r, t in zip(batch, out):
        off = r.mask == 0
        for field in ("adv", "pg_mask", "div", "mask"):
            assert np.all(getattr(t, field)[off] == 0), (name, field)
    rng = np.random.default_rng(9)
    for r in batch:  # different "tool outputs": new values at every masked position
        off = r.mask == 0
        for key in ("teacher_lp", "student_lp", "sampler_lp", "teacher_entropy", "student_entropy", "token_kl"):
            getattr(r, key)[off] = rng.normal(-3.0, 2.0, off.sum())
    stats2, out2 = targets(batch, cfg)
    assert stats2.round_wide == pytest.approx(stats.round_wide)
    assert stats2.groups == stats.groups
    for r, t, t2 in zip(batch, out, out2):
        on = r.mask == 1
        for field in ("adv", "pg_mask", "div", "mask"):
            assert getattr(t2, field)[on] == pytest.approx(getattr(t, field)[on]), (name, field)


def test_tip_exact_ties_at_the_top_score_keep_the_earlier_token():
    """Tokens at or above the entropy cap and the batch's maximum-KL token all score exactly 1 under
    the rule; which of them are kept must follow position, not float rounding of the soft OR."""
    from fractions import Fraction

    from gndpo.pipeline.methods.tip import tip_scores, tip_selection

    rng = np.random.default_rng(11)
    for trial in range(200):
        L = int(rng.integers(4, 16))
        entropy = rng.uniform(0.0, 3.0, L)
        kl = rng.uniform(0.0, 2.0, L)
        cap = float(np.quantile(entropy, 0.6))  # several tokens reach the cap: h^ = 1 exactly there
        kl[rng.integers(L)] = 2.5  # the batch's maximum KL: d^ = 1 exactly
        stats = {"tip_h_cap": cap, "tip_h_min": float(entropy.min()), "tip_h_max": cap, "tip_d_min": 0.0, "tip_d_max": 2.5}
        keep_ratio = float(rng.choice([0.3, 0.5, 0.7]))
        got = tip_selection(tip_scores(entropy, kl, stats), np.ones(L), keep_ratio)

        def exact_score(i):  # the rule in exact rational arithmetic
            h = (Fraction(min(entropy[i], cap)) - Fraction(stats["tip_h_min"])) / (Fraction(cap) - Fraction(stats["tip_h_min"]))
            d = Fraction(kl[i]) / Fraction(2.5)
            return h + d - h * d

        keep = math.floor(keep_ratio * L)
        chosen = sorted(range(L), key=lambda i: (-exact_score(i), i))[:keep]
        want = [1.0 if i in chosen else 0.0 for i in range(L)]
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}")
