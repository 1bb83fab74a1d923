"""Every method through the real stages: one vLLM rollout (with teacher-prefix guidance on half of the
prompts) is shared by one run per method, each running score -> normalize (DuckDB) -> train
(DeepSpeed) in the test's process. The statistics normalize commits are checked against numpy over the same shards."""

import math
import shutil

import numpy as np
import pytest
import yaml

from gndpo.pipeline.run.run import open_run
from gndpo.pipeline.run.stats import round_stats
from gndpo.storage.shards import read_shards
from tests.conftest import invoke_ok, run_stages, tiny_config_dict

pytestmark = pytest.mark.slow

# integer_format as the primary reward: the tiny student passes it on some samples, so pass rates,
# group statistics and PACED weights are not all zero.
SHARED = {
    "reward": "integer_format",
    "rollout": {"guided_fraction": 0.5, "guide_prefix_tokens": 2, "n": 3, "prompts_per_round": 12},
    "score": {"teacher_topk": 4},
}


def write_config(folder, assets, method, score=None):
    path = folder / "config.yaml"
    shared = {**SHARED, "score": {**SHARED["score"], **(score or {})}}
    path.write_text(yaml.safe_dump(tiny_config_dict(assets, method=method, **shared)))
    return path


@pytest.fixture(scope="module")
def rollout_dir(tmp_path_factory, tiny_assets):
    folder = tmp_path_factory.mktemp("methods-rollout")
    run = folder / "run"
    invoke_ok("init", run, "--config", write_config(folder, tiny_assets, {"name": "gndpo"}))
    run_stages(run, "rollout")
    return run / "rounds" / "r0000" / "rollout"


@pytest.fixture(scope="module")
def method_run(tmp_path_factory, tiny_assets, rollout_dir):
    """A function: method config -> a run whose round 0 is trained from the shared rollouts."""

    def make(method: dict, score: dict | None = None):
        folder = tmp_path_factory.mktemp(method["name"])
        run = folder / "run"
        invoke_ok("init", run, "--config", write_config(folder, tiny_assets, method, score))
        shutil.copytree(rollout_dir, run / "rounds" / "r0000" / "rollout")
        run_stages(run, "score", "normalize", "train")  # in this process: what they compute is tested here
        return open_run(str(run))

    return make


def shards(run):
    rollouts = read_shards(run.fs, run.records(0, "rollout").require_manifest().row_files()).to_pylist()
    for r in rollouts:
        r["rewards"] = dict(r["rewards"])  # Arrow maps come back as (key, value) pairs
    scores = {r["rollout_id"]: r for r in read_shards(run.fs, run.records(0, "score").require_manifest().files()).to_pylist()}
    return [(r, scores[r["rollout_id"]]) for r in rollouts]


def valid(pairs, fn):
    """fn(rollout row, score row, t) over every valid token, as a numpy array."""
    return np.array([fn(r, s, t) for r, s in pairs for t, m in enumerate(r["loss_mask"]) if m == 1], dtype=np.float64)


def assert_trained(run):
    commit = run.records(0, "train").done("update")
    losses = [s["loss"] for s in commit.numbers.steps]
    norms = [s["grad_norm"] for s in commit.numbers.steps]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert all(math.isfinite(x) and x > 0 for x in norms), norms


def test_guided_rollouts_have_teacher_prefixes(rollout_dir, method_run):
    run = method_run({"name": "tropd", "tropd": {"outlier": "fkl"}})
    pairs = shards(run)
    guided = [r for r, _ in pairs if r["teacher_prefix_len"] > 0]
    assert 0 < len(guided) < len(pairs)
    for r in guided:
        k = r["teacher_prefix_len"]
        assert r["loss_mask"][:k] == [0] * k and all(m == 1 for m in r["loss_mask"][k:])
    assert_trained(run)


def test_tropd_with_every_modifier_statistics_equal_numpy(method_run):
    method = {
        "name": "tropd", "tropd": {"tau_quantile": 0.3, "outlier": "clip", "clip_value": -1.0},
        "tip": {"enabled": True, "entropy_quantile": 0.9}, "paced": {"enabled": True}, "reward_beta": 0.5,
        "outcome": {"coef": 0.5, "rewards": ["integer_format"]},
    }
    run = method_run(method)
    pairs = shards(run)
    stats = round_stats(run, 0)
    # Score stored exactly the columns these methods need.
    _, s0 = pairs[0]
    assert s0["teacher_topk_ids"] is not None and len(s0["teacher_topk_ids"][0]) == 4
    assert s0["student_entropy"] is not None and s0["token_kl"] is not None and s0["teacher_entropy"] is None

    c = valid(pairs, lambda r, s, t: min(max(s["teacher_logprobs"][t] - s["student_logprobs"][t], -5), 5))
    assert stats["token_count"] == c.size
    assert stats["c_mean"] == pytest.approx(c.mean(), rel=1e-6)
    assert stats["c_var"] == pytest.approx(c.var(ddof=1), rel=1e-6)
    accept = valid(pairs, lambda r, s, t: min(math.exp(s["teacher_logprobs"][t] - s["student_logprobs"][t]), 1.0))
    assert stats["tropd_tau"] == pytest.approx(np.quantile(accept, 0.3), rel=1e-6)
    h = valid(pairs, lambda r, s, t: s["student_entropy"][t])
    d = np.maximum(valid(pairs, lambda r, s, t: s["token_kl"][t]), 0.0)
    cap = np.quantile(h, 0.9)
    assert stats["tip_h_cap"] == pytest.approx(cap, rel=1e-6)
    assert (stats["tip_h_min"], stats["tip_h_max"]) == pytest.approx((np.minimum(h, cap).min(), np.minimum(h, cap).max()), rel=1e-6)
    assert (stats["tip_d_min"], stats["tip_d_max"]) == pytest.approx((d.min(), d.max()), rel=1e-6, abs=1e-9)
    rewards = np.array([r["reward"] for r, _ in pairs])
    assert stats["responses_weighted"] == len(pairs)
    assert stats["reward_logsumexp"] == pytest.approx(np.log(np.exp(rewards / 0.5).sum()), rel=1e-9)
    for pid in {r["prompt_id"] for r, _ in pairs}:
        group = np.array([r["reward"] for r, _ in pairs if r["prompt_id"] == pid])
        assert stats.group(pid)["pass_rate"] == pytest.approx(group.mean())
        assert stats.group(pid)["weighted_reward_mean"] == pytest.approx(group.mean())
        assert stats.group(pid)["weighted_reward_std"] == pytest.approx(group.std(ddof=1), abs=1e-12)
    assert_trained(run)


@pytest.mark.parametrize("mode", ["sequence", "token"])
def test_gdpo_statistics_equal_numpy(method_run, mode):
    names, weights = ["integer_format", "answer_length"], [1.0, 0.5]
    run = method_run({"name": "gdpo", "outcome": {"rewards": names, "weights": weights, "gdpo_batch_norm": mode}})
    pairs = shards(run)
    stats = round_stats(run, 0)
    pre = []
    for r, s in pairs:
        total = 0.0
        for name, w in zip(names, weights):
            group = np.array([x["rewards"][name] for x, _ in pairs if x["prompt_id"] == r["prompt_id"]])
            std = group.std(ddof=1) if group.size > 1 else np.nan
            a = (r["rewards"][name] - group.mean()) / (std + 1e-4)
            total += w * (0.0 if np.isnan(a) else a)
        pre.append(total)
    pre = np.array(pre)
    if mode == "sequence":
        assert stats["gdpo_mean"] == pytest.approx(pre.mean(), abs=1e-9)
        assert stats["gdpo_std"] == pytest.approx(pre.std(ddof=1), rel=1e-9)
    else:
        per_token = np.repeat(pre, [sum(r["loss_mask"]) for r, _ in pairs])
        assert stats["gdpo_mean"] == pytest.approx(per_token.mean(), abs=1e-9)
        assert stats["gdpo_var"] == pytest.approx(per_token.var(ddof=1), rel=1e-9)
    assert_trained(run)


def test_minillm_and_reopold_statistics_equal_numpy(method_run):
    run = method_run({"name": "minillm"})
    pairs = shards(run)
    stats = round_stats(run, 0)
    returns = []
    for r, s in pairs:
        lr = np.array(s["teacher_logprobs"], dtype=np.float64) - np.array(s["student_logprobs"], dtype=np.float64)
        m = r["loss_mask"]
        for t in range(len(m)):
            if m[t]:
                later = [k for k in range(t, len(m)) if m[k]]
                returns.append(sum(0.95 ** (k - t) * lr[k] for k in later) / len(later))
    returns = np.array(returns)
    assert stats["minillm_mean"] == pytest.approx(returns.mean(), rel=1e-5)
    assert stats["minillm_var"] == pytest.approx(returns.var(ddof=1), rel=1e-5)
    assert_trained(run)

    run = method_run({"name": "reopold", "reopold": {"switch_round": 0, "beta": 0.2}})
    h = valid(shards(run), lambda r, s, t: s["student_entropy"][t])
    assert round_stats(run, 0)["reopold_entropy_cut"] == pytest.approx(np.quantile(h, 0.8), rel=1e-6)
    assert_trained(run)


# opd and forward_kl also train in tests/test_e2e.py::test_compare_two_methods, jsd in test_data_parallel.py.
@pytest.mark.parametrize("name", ["tinker", "reverse_kl", "paced", "eopd", "grpo"])
def test_method_trains_end_to_end(method_run, name):
    method = {"name": name}
    if name == "grpo":
        method["outcome"] = {"rewards": ["integer_format"]}
    run = method_run(method)
    assert_trained(run)
    commit = run.records(0, "train").done("update")
    if name == "reverse_kl":
        assert commit.numbers.divergence == name and commit.numbers.adv_min is None
    if name == "paced":
        assert commit.numbers.divergence == "forward_kl"  # round 0 of the default fkl-then-rkl schedule


def test_bfloat16_score_storage(method_run):
    """score.dtype bfloat16: every stored value is a bf16 number (torch's rounding as the reference),
    the statistics are those of the stored values, the student's stored log-probs stay within bf16
    precision of the sampler's, and train runs on them."""
    import torch

    run = method_run({"name": "gndpo"}, score={"dtype": "bfloat16"})
    pairs = shards(run)
    for column in ("teacher_logprobs", "student_logprobs"):
        values = np.array([v for _, s in pairs for v in s[column]], dtype=np.float32)
        np.testing.assert_array_equal(values, torch.from_numpy(values).to(torch.bfloat16).float().numpy())
    stats = round_stats(run, 0)
    c = valid(pairs, lambda r, s, t: min(max(s["teacher_logprobs"][t] - s["student_logprobs"][t], -5), 5))
    assert stats["c_mean"] == pytest.approx(c.mean(), rel=1e-6)
    student = valid(pairs, lambda r, s, t: s["student_logprobs"][t])
    sampler = valid(pairs, lambda r, s, t: r["sampler_logprobs"][t])
    # bf16 keeps 8 significant bits, so rounding to nearest moves a value by at most 2^-8 of itself (its
    # unit roundoff), plus the sampler's own float32 difference (1e-4 allowed). Measured: at most 0.0030
    # relative on the toy, every value inside 2^-8 alone.
    assert np.all(np.abs(student - sampler) <= np.abs(sampler) * 2**-8 + 1e-4)
    assert_trained(run)


def test_cosine_lr_schedule_over_the_round(tmp_path, tiny_assets, rollout_dir):
    """train.lr_schedule cosine: step i of n trains at lr_min + (lr - lr_min)(1 + cos(pi i/(n-1)))/2, the
    lr each step records, and the DeepSpeed engine's optimizer ends the round at lr * lr_min_ratio."""
    from gndpo.stages.models.live import LiveModels

    run = tmp_path / "run"
    invoke_ok("init", run, "--config", write_config(tmp_path, tiny_assets, {"name": "gndpo"}),
              "train.lr_schedule=cosine", "train.lr=1e-3", "train.lr_min_ratio=0.2", "train.optimizer_steps=4", "train.micro_batch_size=8")
    shutil.copytree(rollout_dir, run / "rounds" / "r0000" / "rollout")
    live = LiveModels(keep=True)
    try:
        run_stages(run, "score", "normalize", "train", live=live)
        optimizer_lrs = {group["lr"] for group in live._trainer.engine.optimizer.param_groups}
    finally:
        live.close()
    steps = open_run(str(run)).records(0, "train").done("update").numbers.steps
    want = [2e-4 + 8e-4 * (1 + math.cos(math.pi * i / 3)) / 2 for i in range(4)]
    assert [s["lr"] for s in steps] == pytest.approx(want, rel=1e-12)
    assert want[0] == pytest.approx(1e-3) and want[-1] == pytest.approx(2e-4)
    assert len(optimizer_lrs) == 1 and optimizer_lrs.pop() == pytest.approx(2e-4, rel=1e-12)
