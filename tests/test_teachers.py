"""Several teachers: prompts routed to named teachers, or every token scored by their mean, on one
parent run's round-0 rollouts (two forks, so nothing is sampled twice). The stored teacher log-probs are
checked against the HF models recomputed here, and normalize's statistics against numpy over the shards."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import config_from_dict
from gndpo.pipeline.run.run import open_run
from tests.conftest import EPS32, committed_rows, invoke_ok, model_logprob_tol, model_logprobs, run_stages

pytestmark = pytest.mark.slow
CLAMP = 5.0


@pytest.fixture(scope="module")
def parent(rolled_out):
    return rolled_out


def fork_and_score(parent, folder, *settings):
    new = folder / "run"
    invoke_ok("fork", parent, new, "--from-round", "0", "teacher=", *settings)
    run_stages(new, "score", "normalize")
    return new


def moments(c):
    return c.mean(), c.var(ddof=1)


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory, tiny_assets) -> Path:
    """A second teacher distinct from the first and from the student: the toy teacher with seeded noise
    on every weight (same tokenizer), so that a router that falls back to one model, or a train that
    normalizes with the pooled statistics, gives numbers this module can tell apart."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("other-teacher") / "teacher-b"
    shutil.copytree(tiny_assets / "teacher", folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    model.save_pretrained(str(folder))
    return folder


def test_routing_scores_each_prompt_with_its_teacher(parent, tiny_assets, other_teacher, tmp_path):
    paths = {"a": tiny_assets / "teacher", "b": other_teacher}
    new = fork_and_score(parent, tmp_path, f"teachers={{a: {paths['a']}, b: {paths['b']}}}", "method.stats_scope=teacher")
    prompts = {p["prompt_id"]: p["teacher"] for p in open_run(str(new)).prompts("train")}
    rollouts = {r["rollout_id"]: r for r in committed_rows(parent)}
    scores = committed_rows(new, "score")
    assert {s["teacher"] for s in scores} == {"a", "b"}
    per_teacher = {"a": [], "b": []}
    tols = {name: model_logprob_tol(path) for name, path in paths.items()}  # two float32 forwards of each (tests/conftest.py)
    for s in scores:  # every stored value is the routed model's, recomputed here
        r = rollouts[s["rollout_id"]]
        assert s["teacher"] == prompts[r["prompt_id"]]
        want = model_logprobs(paths[s["teacher"]], r["prompt_token_ids"], r["response_token_ids"])
        np.testing.assert_allclose(s["teacher_logprobs"], want, **tols[s["teacher"]])
        c = np.clip(np.subtract(s["teacher_logprobs"], s["student_logprobs"]), -CLAMP, CLAMP)
        per_teacher[s["teacher"]].append(c[np.asarray(r["loss_mask"]) == 1])
    from gndpo.pipeline.run.stats import round_stats

    got = round_stats(open_run(str(new)), 0)
    everything = np.concatenate(per_teacher["a"] + per_teacher["b"])
    assert got["c_mean"] == pytest.approx(everything.mean(), abs=1e-9)
    assert got["c_var"] == pytest.approx(everything.var(ddof=1), rel=1e-9)
    for name, parts in per_teacher.items():
        mean, var = moments(np.concatenate(parts))
        assert got.of_teacher(name)["c_mean"] == pytest.approx(mean, abs=1e-9)
        assert got.of_teacher(name)["c_var"] == pytest.approx(var, rel=1e-9)

    # Train normalizes each response with its own teacher's statistics: its advantage range is the
    # per-teacher standardization's, re-derived here, and not the pooled one's.
    run_stages(new, "train")
    trained = open_run(str(new)).records(0, "train").manifest().metrics
    own = np.concatenate([(np.concatenate(parts) - moments(np.concatenate(parts))[0]) / np.sqrt(moments(np.concatenate(parts))[1])
                          for parts in per_teacher.values()])
    pooled = (everything - everything.mean()) / everything.std(ddof=1)
    # own leaves out the std_eps train adds to a variance (relative std_eps / (2 var) at most), and an
    # advantage may be kept in float32 (EPS32 / 2).
    rel = EPS32 + open_run(str(new)).cfg.method.std_eps / min(moments(np.concatenate(parts))[1] for parts in per_teacher.values())
    assert (trained["adv_min"], trained["adv_max"]) == (pytest.approx(own.min(), rel=rel), pytest.approx(own.max(), rel=rel))
    assert abs(pooled.min() - own.min()) + abs(pooled.max() - own.max()) > 0.05  # the check can tell them apart


def test_mean_mix_scores_every_token_with_the_mixture(parent, tiny_assets, tmp_path):
    new = fork_and_score(parent, tmp_path, f"teachers={{a: {tiny_assets / 'teacher'}, b: {tiny_assets / 'student'}}}",
                         "score.teacher_mix=mean")
    rollouts = {r["rollout_id"]: r for r in committed_rows(parent)}
    scores = committed_rows(new, "score")
    assert {s["teacher"] for s in scores} == {"mean(a,b)"}
    tol = model_logprob_tol(tiny_assets / "teacher", tiny_assets / "student")  # the mixture is no further off than a or b
    for s in scores[:4]:
        r = rollouts[s["rollout_id"]]
        lp_a = model_logprobs(tiny_assets / "teacher", r["prompt_token_ids"], r["response_token_ids"])
        lp_b = model_logprobs(tiny_assets / "student", r["prompt_token_ids"], r["response_token_ids"])
        np.testing.assert_allclose(s["teacher_logprobs"], np.log((np.exp(lp_a) + np.exp(lp_b)) / 2), **tol)
    c = np.concatenate([
        np.clip(np.subtract(s["teacher_logprobs"], s["student_logprobs"]), -CLAMP, CLAMP)[np.asarray(rollouts[s["rollout_id"]]["loss_mask"]) == 1]
        for s in scores
    ])
    from gndpo.pipeline.run.stats import round_stats

    got = round_stats(open_run(str(new)), 0)
    assert got["c_mean"] == pytest.approx(c.mean(), abs=1e-9)
    assert got["c_var"] == pytest.approx(c.var(ddof=1), rel=1e-9)


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"teacher": "x", "teachers": {"a": "p", "b": "q"}}, "names both teacher and teachers"),
        ({"teachers": {"a": "p"}}, "two or more names"),
        ({"teachers": {"a": "p", "b": "q"}, "score": {"backend": "vllm"}}, "score.backend hf or server only"),
        ({"method": {"stats_scope": "teacher"}}, "needs several teachers routed by prompt"),
        ({"teachers": {"a": "p", "b": "q"}, "score": {"teacher_mix": "mean"}, "method": {"stats_scope": "teacher"}},
         "needs several teachers routed by prompt"),
        ({"score": {"teacher_mix": "max"}}, "score.teacher_mix must be one of route, mean"),
    ],
)
def test_bad_teacher_settings_are_one_line_errors(data, fragment):
    with pytest.raises(GndpoError, match=fragment):
        config_from_dict(data)
