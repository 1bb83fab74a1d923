"""On-policy self-distillation: ``teacher: self`` with a privileged ``teacher_context``.

The round-0 rollouts of the shared rolled-out run (conftest ``rolled_out``) are re-scored by forks whose
teacher is the student itself reading a context the student never saw (the answer). The stored teacher
log-probs are re-derived here from a plain transformers forward over [teacher prompt | response]; the
frozen, live and EMA weights are checked against what they claim; the other-problem context never
pairs a prompt with its own row; every method computes its training targets on such a round."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import config_from_dict
from gndpo.pipeline.methods import METHODS
from gndpo.pipeline.settings.schema import SelfTeacherConfig
from gndpo.stages.text.teacher_context import TeacherPrompts, other_problem_partners
from gndpo.stages.training.ema import EmaWeights
from tests.conftest import assert_one_line_error, committed_rows, invoke, invoke_ok, model_logprob_tol, round_share, run_stages
from tests.fabricated_runs import committed_train, fabricated_run

# The toy tokenizer knows digits, "+" and "=": the teacher reads the answer, then the question.
CONTEXT = [{"role": "user", "content": "{answer}={prompt}"}]
CONTEXT_SET = "teacher_context.messages=[{role: user, content: '{answer}={prompt}'}]"


# -- fast: the pieces -------------------------------------------------------------------------------
def test_other_problem_partners_are_a_seeded_cycle_without_fixed_points():
    ids = [f"p{i:03d}" for i in range(50)]
    partners = other_problem_partners(ids, seed=3)
    assert sorted(partners) == ids and sorted(partners.values()) == ids  # every prompt lends exactly once
    assert all(partners[p] != p for p in ids)
    assert partners == other_problem_partners(list(reversed(ids)), seed=3)  # order of arrival does not matter
    assert partners != other_problem_partners(ids, seed=4)
    assert all(other_problem_partners(["a", "b"], s) == {"a": "b", "b": "a"} for s in range(5))


def test_other_problem_context_takes_every_column_but_the_prompt_from_the_partner():
    from gndpo.pipeline.settings.schema import DataConfig, TeacherContextConfig

    rows = [{"prompt_id": f"p{i}", "prompt": f"q{i}", "answer": f"a{i}", "solution": f"s{i}"} for i in range(7)]
    context = TeacherContextConfig(messages=[{"role": "user", "content": "{prompt} | {solution} | {answer}"}], other_problem=True, seed=1)
    prompts = TeacherPrompts(None, DataConfig(), context, rows)
    for row in rows:
        partner = next(r for r in rows if r["prompt_id"] == prompts.partners[row["prompt_id"]])
        (turn,) = prompts.turns(row)
        assert turn["content"] == f"{row['prompt']} | {partner['solution']} | {partner['answer']}"
        assert row["solution"] not in turn["content"] and row["answer"] not in turn["content"]
    own = TeacherPrompts(None, DataConfig(), TeacherContextConfig(messages=context.messages), rows)
    assert own.turns(rows[2])[0]["content"] == "q2 | s2 | a2"


@pytest.mark.parametrize("settings, message", [
    ({"teacher": "self", "teachers": {"a": "x", "b": "y"}}, "both teacher and teachers"),
    ({"teacher": "self", "score": {"cross_tokenizer": True}}, "cannot be combined with score.cross_tokenizer"),
    ({"teacher": "self", "rollout": {"guided_fraction": 0.5}}, "cannot be combined with rollout.guided_fraction"),
    ({"teacher": "self", "self_teacher": {"weights": "ema"}, "train": {"zero_stage": 3}}, "use train.zero_stage 0-2"),
    ({"self_teacher": {"weights": "average"}}, "self_teacher.weights must be one of frozen, live, ema"),
    ({"self_teacher": {"ema_decay": 1.0}}, "self_teacher.ema_decay must be > 0 and < 1"),
    ({"teacher_context": {"messages": [{"role": "user"}]}}, "teacher_context.messages must be a list of {role: str, content: str}"),
    ({"teacher_context": {"messages": [{"role": "user", "content": "{0}"}]}}, "{0} is not a column name"),
    ({"teacher_context": {"messages": [{"role": "user", "content": "{a b}"}]}}, "is not a column name"),
    ({"teacher_context": {"messages": [{"role": "user", "content": "x {y"}]}}, "teacher_context.messages"),
    ({"teacher_context": {"other_problem": True}}, "other_problem needs teacher_context.messages"),
    ({"method": {"pointwise_clip": -1}}, "method.pointwise_clip must be >= 0"),
])
def test_self_distillation_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(GndpoError, match=None) as err:
        config_from_dict(settings)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_ema_follows_the_hand_computation_and_exports_it(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))
    model.save_pretrained(tmp_path / "start")
    theta0 = {k: v.clone().double() for k, v in model.named_parameters()}
    d = 0.9
    ema = EmaWeights.start(model, str(tmp_path / "start"), d)
    expected = dict(theta0)
    for step in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        ema.update(model)
        expected = {k: d * expected[k] + (1 - d) * p.detach().double() for k, p in model.named_parameters()}
    for name, value in ema.tensors.items():
        torch.testing.assert_close(value.double(), expected[name], rtol=1e-6, atol=1e-7)
    ema.export(model, str(tmp_path / "ema"))
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "ema")
    torch.testing.assert_close(reloaded.lm_head.weight.double(), expected["model.embed_tokens.weight"], rtol=1e-6, atol=1e-7)
    again = EmaWeights.start(model, str(tmp_path / "start"), d)
    again.load_bytes(ema.to_bytes())
    assert all(torch.equal(again.tensors[k], ema.tensors[k]) for k in ema.tensors)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("form", ["bucket", "renormalized"])
def test_pointwise_clip_clamps_each_bucket_before_the_sum(kind, form):
    """OPSD's point-wise clipping, re-derived in float64 over the k ids and the rest bucket."""
    from gndpo.pipeline.methods.losses import topk_divergence

    torch.manual_seed(1)
    vocab, k, beta, clip = 50, 6, 0.3, 0.05
    s_full = torch.log_softmax(torch.randn(4, vocab, dtype=torch.float64) * 2, -1)
    t_full = torch.log_softmax(torch.randn(4, vocab, dtype=torch.float64) * 3, -1)
    t_top, ids = t_full.topk(k, -1)
    s_top = s_full.gather(-1, ids)
    if form == "bucket":
        pt = torch.cat([t_top.exp(), 1 - t_top.exp().sum(-1, keepdim=True)], -1)
        ps = torch.cat([s_top.exp(), 1 - s_top.exp().sum(-1, keepdim=True)], -1)
    else:
        pt, ps = torch.softmax(t_top, -1), torch.softmax(s_top, -1)
        if kind == "forward_kl":  # the student's log-probs stay unrenormalized in this form
            ps = s_top.exp()
    m = beta * pt + (1 - beta) * ps
    terms = {"forward_kl": pt * (pt.log() - ps.log()), "reverse_kl": ps * (ps.log() - pt.log()),
             "jsd": beta * pt * (pt.log() - m.log()) + (1 - beta) * ps * (ps.log() - m.log())}[kind]
    assert (terms > clip).any()  # the case clips something
    expected = terms.clamp(max=clip).sum(-1)
    got = topk_divergence(kind, s_top, t_top, beta, form=form, teacher_rest_logp=(1 - t_top.exp().sum(-1)).log(), clip=clip)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    unclipped = topk_divergence(kind, s_top, t_top, beta, form=form, teacher_rest_logp=(1 - t_top.exp().sum(-1)).log())
    assert (unclipped > got).any()


@pytest.mark.parametrize("weights", ["live", "ema"])
def test_a_self_teacher_that_follows_the_student_is_the_policy_that_sampled_the_round(tmp_path, weights):
    """With live or EMA weights, round k's self-teacher is what train exported with the policy that
    sampled the round (version k - run.max_staleness, Run.sampling_version), not the newest policy:
    at staleness 1 the two differ from round 2 on (round 1 is sampled, and taught, by the student)."""
    student, folder = str(tmp_path / "student"), {"live": "model", "ema": "ema"}[weights]
    for staleness in (0, 1):
        run = fabricated_run(tmp_path / f"staleness-{staleness}", student=student, teacher="self", self_teacher={"weights": weights},
                             run={"max_staleness": staleness}, method={"policy_loss": "ppo"})
        for k in range(3):  # rounds 0-2 trained: policies 1-3 exported, the newest before every round
            committed_train(run, k, model_dir=f"model/v{k + 1}", ema_dir=f"ema/v{k + 1}")
        for k in range(4):
            version = max(k - staleness, 0)
            expected = student if version == 0 else str(tmp_path / f"staleness-{staleness}" / folder / f"v{version}")
            assert run.teacher_models(k) == {f"self/{weights}": expected}, (staleness, k)


# -- slow: through the stages ----------------------------------------------------------------------
def fork(rolled_out, folder, *overrides):
    new = folder / "run"
    invoke_ok("fork", rolled_out, new, "--from-round", "0", "teacher=self", *overrides)
    return new


def teacher_ids(tok, prompt: str, answer: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": f"{answer}={prompt}"}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def rederived_teacher_logprobs(model_dir, rows, prompts_by_id, context_of) -> list[np.ndarray]:
    """Per score row: the teacher's log-prob of each response token after its own prompt, float64."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for row in rows:
        prompt = prompts_by_id[row["prompt_id"]]
        ids = teacher_ids(tok, prompt["prompt"], context_of(row["prompt_id"])["answer"])
        response = row["response_token_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids + response])).logits[0].double(), -1)
        out.append(np.array([float(logp[len(ids) + k - 1, t]) for k, t in enumerate(response)]))
    return out


@pytest.fixture(scope="module")
def ema_run(rolled_out, tmp_path_factory):
    """A self-distillation fork (EMA teacher, decay 0.5, one optimizer step) trained through round 0."""
    run = fork(rolled_out, tmp_path_factory.mktemp("sd-ema"), CONTEXT_SET, "self_teacher.weights=ema", "self_teacher.ema_decay=0.5",
               "train.optimizer_steps=1")
    run_stages(run, "score", "normalize", "train")
    return run


@pytest.mark.slow
def test_teacher_log_probs_are_the_student_reading_the_context(ema_run, rolled_out, tiny_assets):
    from gndpo.pipeline.run.run import open_run

    rows = {r["rollout_id"]: r for r in committed_rows(rolled_out, "rollout")}
    scores = committed_rows(ema_run, "score")
    prompts = {p["prompt_id"]: p for p in open_run(str(ema_run)).prompts("train")}
    rollout_rows = [rows[s["rollout_id"]] for s in scores]
    expected = rederived_teacher_logprobs(tiny_assets / "student", rollout_rows, prompts, lambda pid: prompts[pid])
    tol = model_logprob_tol(tiny_assets / "student")  # two float32 forwards of the self-teacher (tests/conftest.py)
    for s, e in zip(scores, expected):
        np.testing.assert_allclose(s["teacher_logprobs"], e, **tol)
        assert s["teacher"] == "self/ema"
    # The context changes what the teacher says: the same student without it scores otherwise.
    assert max(np.abs(np.asarray(s["teacher_logprobs"]) - np.asarray(s["student_logprobs"])).max() for s in scores) > 1e-2


@pytest.mark.slow
def test_frozen_live_and_ema_weights_are_what_they_claim(ema_run, tiny_assets):
    from safetensors.numpy import load_file

    from gndpo.pipeline.run.run import open_run

    run = open_run(str(ema_run))
    theta0 = load_file(str(tiny_assets / "student" / "model.safetensors"))
    theta1 = load_file(f"{run.policy_path(1)}/model.safetensors")
    ema = load_file(f"{run.teacher_models(1)['self/ema']}/model.safetensors")
    assert ema.keys() == theta1.keys()
    for name in theta1:  # one optimizer step: theta_ema = d theta_0 + (1 - d) theta_1, d = 0.5
        np.testing.assert_allclose(ema[name], 0.5 * theta0[name] + 0.5 * theta1[name], rtol=1e-6, atol=1e-7, err_msg=name)
    assert any(not np.array_equal(theta0[n], theta1[n]) for n in theta1)
    assert run.teacher_models(0) == {"self/ema": str(tiny_assets / "student")}
    for weights, expected in (("frozen", str(tiny_assets / "student")), ("live", run.policy_path(1))):
        other = dataclasses.replace(run, cfg=dataclasses.replace(run.cfg, self_teacher=SelfTeacherConfig(weights=weights)))
        assert other.teacher_models(1) == {f"self/{weights}": expected}


@pytest.mark.slow
def test_other_problem_scores_with_another_prompts_answer(rolled_out, tmp_path, tiny_assets):
    from gndpo.pipeline.run.run import open_run

    run = fork(rolled_out, tmp_path, CONTEXT_SET, "teacher_context.other_problem=true", "teacher_context.seed=7")
    run_stages(run, "score")
    prompts = {p["prompt_id"]: p for p in open_run(str(run)).prompts("train")}
    partners = other_problem_partners(list(prompts), 7)
    rows = {r["rollout_id"]: r for r in committed_rows(rolled_out, "rollout")}
    scores = committed_rows(run, "score")
    assert all(partners[s["prompt_id"]] != s["prompt_id"] for s in scores)
    expected = rederived_teacher_logprobs(tiny_assets / "student", [rows[s["rollout_id"]] for s in scores], prompts,
                                          lambda pid: prompts[partners[pid]])
    tol = model_logprob_tol(tiny_assets / "student")  # two float32 forwards of the self-teacher (tests/conftest.py)
    for s, e in zip(scores, expected):
        np.testing.assert_allclose(s["teacher_logprobs"], e, **tol)


@pytest.mark.slow
def test_init_refuses_a_context_column_the_prompts_lack_and_a_context_that_does_not_fit(rolled_out, tmp_path):
    missing = invoke("fork", rolled_out, tmp_path / "a", "--from-round", "0", "teacher=self",
                     "teacher_context.messages=[{role: user, content: '{solution}'}]")
    assert_one_line_error(missing, "teacher (self)", "solution")
    long = "{answer}" * 40
    too_long = invoke("fork", rolled_out, tmp_path / "b", "--from-round", "0", "teacher=self",
                      f"teacher_context.messages=[{{role: user, content: '{long}'}}]")
    assert_one_line_error(too_long, "exceeds its context length")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_every_method_computes_its_targets_on_a_self_distillation_round(rolled_out, tmp_path):
    """score -> normalize in process for each method (the teacher module kept across them), then the
    same join train makes (targets for every response, finite)."""
    from gndpo.apps.fork import fork_run
    from gndpo.pipeline.run.run import open_run
    from gndpo.stages.models.live import LiveModels

    live = LiveModels(keep=True, log=lambda *_: None)
    for name in sorted(METHODS):
        url = str(tmp_path / name)
        method = {"name": name, "pointwise_clip": 0.5}
        overrides = ["teacher=self", CONTEXT_SET, f"method={method}", "score.teacher_topk=4"]
        if name in ("grpo", "gdpo"):
            overrides.append("method.outcome.rewards=[exact_match, integer_format]")
        fork_run(str(rolled_out), url, 0, overrides)
        run_stages(url, "score", "normalize", live=live)
        with round_share(open_run(url), 0) as share:
            rows = share.all_rows()
        assert len(rows) == sum(share.step_sizes) > 0, name
        for row in rows:
            for value in (row.adv, row.div, row.mask, row.old_logp):
                assert np.isfinite(value).all(), name


@pytest.mark.slow
def test_the_vllm_backend_scores_the_same_context(ema_run, rolled_out, tmp_path, tiny_assets):
    """score.backend vllm: the teacher engine reads [teacher prompt | response] too; its log-probs equal
    the HF backend's (round 0: every self-teacher is the initial student)."""
    run = fork(rolled_out, tmp_path, CONTEXT_SET, "score.backend=vllm", "score.engine.max_model_len=64")
    run_stages(run, "score")
    by_hf = {s["rollout_id"]: s for s in committed_rows(ema_run, "score")}
    tol = model_logprob_tol(tiny_assets / "student")  # two float32 forwards of the initial student (tests/conftest.py)
    for s in committed_rows(run, "score"):
        np.testing.assert_allclose(s["teacher_logprobs"], by_hf[s["rollout_id"]]["teacher_logprobs"], **tol)
        assert s["teacher"] == "self/frozen"
