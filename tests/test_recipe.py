"""`gndpo recipe sparse-to-dense`: GRPO on the teacher, then forward-KL distillation of the student from
the policy stage 1 ended on; resumable after a kill in either stage, shown by `gndpo report`."""

import json

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from gndpo.pipeline.run.run import open_run
from tests.conftest import committed_rows, gndpo_killed, invoke, invoke_ok, model_logprob_tol, model_logprobs, tiny_config_dict

pytestmark = pytest.mark.slow


def recipe_args(base, out):
    return ("recipe", "sparse-to-dense", out, "--config", base, "--rl-rounds", "1", "--distill-rounds", "1",
            "--set", "train.lr=1e-2", "--set", "rollout.eval_heldout=false",
            # A reward that varies within a group (the answer's length), so that GRPO moves the tiny teacher.
            "--rl-set", "method.outcome.rewards=[exact_match,answer_length]")


def export_dir(run, version: int):
    return run / open_run(str(run)).records(version - 1, "train").manifest().metrics["model_dir"]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_assets):
    path = tmp_path_factory.mktemp("base") / "base.yaml"
    # The student's own module samples (rollout.backend hf): a recipe's stages and their resumption do not
    # depend on the sampler, and each killed recipe process then starts no vLLM engine.
    path.write_text(yaml.safe_dump(tiny_config_dict(tiny_assets, rollout={"backend": "hf"})))
    return path


@pytest.fixture(scope="module")
def recipe(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe") / "out"
    invoke_ok(*recipe_args(base, out))
    return out


def test_stage_2_is_taught_by_exactly_the_policy_stage_1_ended_on(recipe, tiny_assets):
    rl, distill = recipe / "teacher-rl", recipe / "distill"
    assert open_run(str(rl)).cfg.method.name == "grpo" and open_run(str(rl)).cfg.student == str(tiny_assets / "teacher")
    child = open_run(str(distill))
    assert child.cfg.method.name == "forward_kl" and child.cfg.student == str(tiny_assets / "student")
    reference = f"run:{rl.resolve()}@1"
    assert child.cfg.teacher == reference and child.teacher_models(0) == {reference: str(export_dir(rl.resolve(), 1))}
    # Stage 1 trained: its final policy is not the teacher it started from.
    stage1 = load_file(str(export_dir(rl, 1) / "model.safetensors"))
    start = load_file(str(tiny_assets / "teacher" / "model.safetensors"))
    assert any(not np.array_equal(stage1[k], start[k]) for k in start)
    # The distill stage's stored teacher log-probs are stage 1's final policy, recomputed here.
    rollouts = {r["rollout_id"]: r for r in committed_rows(distill)}
    tol = model_logprob_tol(export_dir(rl, 1))  # two float32 forwards of it (tests/conftest.py)
    for s in committed_rows(distill, "score")[:4]:
        r = rollouts[s["rollout_id"]]
        want = model_logprobs(export_dir(rl, 1), r["prompt_token_ids"], r["response_token_ids"])
        np.testing.assert_allclose(s["teacher_logprobs"], want, **tol)
    assert json.loads((recipe / "recipe.json").read_text())["stages"][1]["name"] == "distill"
    result = invoke_ok("report", recipe)
    html = (recipe / "report" / "report.html").read_text()
    assert "teacher-rl" in html and "distill" in html, result.output


def test_a_recipe_killed_in_either_stage_resumes_to_the_same_rows_and_weights(recipe, base, tmp_path):
    """Killed at stage 1's first optimizer step, rerun and killed again at stage 2's first (stage 1's
    retry takes its two steps from the start, so the third step is stage 2's), then rerun: every
    stage's committed rows and exported weights equal the uninterrupted recipe's."""
    out = tmp_path / "out"
    for steps_before, distill_started in ((0, False), (2, True)):
        crash = {"GNDPO_CRASH_AT": "train.step", "GNDPO_CRASH_AFTER": str(steps_before)}
        assert gndpo_killed(*recipe_args(base, out), env=crash, log=tmp_path / f"crash-{steps_before}.log") == -9
        assert (out / "distill" / "run.yaml").exists() == distill_started
    assert open_run(str(out / "teacher-rl")).records(0, "train").manifest() is not None
    assert open_run(str(out / "distill")).records(0, "train").manifest() is None
    invoke_ok(*recipe_args(base, out))  # the rerun, in this process
    for stage in ("teacher-rl", "distill"):
        for kind in ("rollout", "score"):  # the teacher's name is its reference, a path inside each folder
            got, want = ([{k: v for k, v in row.items() if k != "teacher"} for row in committed_rows(r / stage, kind)] for r in (out, recipe))
            assert got == want, (stage, kind)
        got, want = (load_file(str(export_dir(r / stage, 1) / "model.safetensors")) for r in (out, recipe))
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{stage} {name}")


def test_a_recipe_folder_with_other_settings_is_refused(recipe, base):
    result = invoke("recipe", "sparse-to-dense", recipe, "--config", base, "--rl-rounds", "2", "--distill-rounds", "1",
                    "--set", "train.lr=1e-2", "--set", "rollout.eval_heldout=false")
    assert result.exit_code == 1 and "holds another recipe or other settings" in result.output
