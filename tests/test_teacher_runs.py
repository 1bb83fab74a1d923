"""A run's trained policy as another run's teacher (``teacher: run:RUN`` or ``run:RUN@K``): resolved once
by `gndpo init`, recorded with every file's sha256, scored with exactly those weights, unchanged when the
parent trains on, and refused in one line where it cannot be resolved."""

import shutil

import pytest
import yaml

from gndpo.pipeline.run.run import open_run
from tests.conftest import (
    assert_one_line_error,
    committed_rows,
    invoke,
    invoke_ok,
    model_logprob_tol,
    model_logprobs,
    run_stages,
    tiny_config_dict,
    write_config,
)

pytestmark = pytest.mark.slow


def init(folder, assets, **sections):
    folder.mkdir(parents=True, exist_ok=True)
    # The student's own module samples (rollout.backend hf): a teacher run's resolution does not depend on it.
    cfg = tiny_config_dict(assets, rollout={"eval_heldout": False, "backend": "hf"}, **sections)
    return invoke(*("init", folder / "run", "--config", write_config(folder, cfg)))


def export_dir(run, version: int):
    return run / open_run(str(run)).records(version - 1, "train").manifest().metrics["model_dir"]


@pytest.fixture(scope="module")
def parent(tmp_path_factory, tiny_assets):
    """A toy run with two trained policies (v1, v2)."""
    folder = tmp_path_factory.mktemp("parent")
    assert init(folder, tiny_assets, train={"lr": 1e-2}).exit_code == 0
    invoke_ok("run", folder / "run", "--rounds", 2)
    return folder / "run"


def test_a_reference_resolves_to_the_policy_and_records_its_files(parent, tiny_assets, tmp_path):
    result = init(tmp_path / "pinned", tiny_assets, teacher=f"run:{parent}@1")
    assert result.exit_code == 0, result.output
    child = tmp_path / "pinned" / "run"
    recorded = yaml.safe_load((child / "run.yaml").read_text())["teacher_runs"][f"run:{parent}@1"]
    commit = open_run(str(parent)).records(0, "train").manifest()
    model_dir = commit.metrics["model_dir"]
    want = sorted((f.path[len(model_dir) + 1:], f.sha256) for u in commit.units for f in u.files if f.path.startswith(model_dir + "/"))
    assert recorded["policy"] == 1 and recorded["model_dir"] == model_dir
    assert sorted((f["path"], f["sha256"]) for f in recorded["files"]) == want
    assert open_run(str(child)).teacher_models(0) == {f"run:{parent}@1": str(export_dir(parent, 1))}

    # Round 0 of the child, scored: the teacher's log-probs are the parent's policy v1, recomputed here.
    run_stages(child, "rollout", "score")
    rollouts = {r["rollout_id"]: r for r in committed_rows(child)}
    tol = model_logprob_tol(export_dir(parent, 1))  # two float32 forwards of it (tests/conftest.py)
    for s in committed_rows(child, "score")[:4]:
        r = rollouts[s["rollout_id"]]
        assert s["teacher"] == f"run:{parent}@1"
        want = model_logprobs(export_dir(parent, 1), r["prompt_token_ids"], r["response_token_ids"])
        assert list(s["teacher_logprobs"]) == pytest.approx(list(want), rel=tol["rtol"], abs=tol["atol"])


def test_the_newest_policy_stays_the_teacher_when_the_parent_trains_on(parent, tiny_assets, tmp_path):
    """``run:RUN`` pins the newest policy at init (v2); a third round of the parent does not change it."""
    moving = tmp_path / "moving"
    shutil.copytree(parent, moving)
    assert init(tmp_path / "child", tiny_assets, teacher=f"run:{moving}").exit_code == 0
    child = open_run(str(tmp_path / "child" / "run"))
    assert child.teacher_runs[f"run:{moving}"]["policy"] == 2
    invoke_ok("run", moving, "--rounds", 3)
    assert open_run(str(tmp_path / "child" / "run")).teacher_models(0) == {f"run:{moving}": str(export_dir(moving, 2))}


def test_references_that_cannot_resolve_are_refused_in_one_line(parent, tiny_assets, tmp_path):
    cases = [(f"run:{parent}@9", "has no policy v9; its trained policies are v1 to v2"),
             (f"run:{tmp_path}/nowhere", "not a gndpo run"),
             (f"run:{parent}@x", "the policy version after @ must be a whole number")]
    for i, (teacher, message) in enumerate(cases):
        assert_one_line_error(init(tmp_path / f"c{i}", tiny_assets, teacher=teacher), message)
        assert not (tmp_path / f"c{i}" / "run" / "run.yaml").exists()
    fresh = tmp_path / "fresh"
    assert init(fresh, tiny_assets).exit_code == 0
    assert_one_line_error(init(tmp_path / "c9", tiny_assets, teacher=f"run:{fresh / 'run'}"), "has no trained policy yet")
    tampered = tmp_path / "tampered"
    shutil.copytree(parent, tampered)
    weights = export_dir(tampered, 2) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert_one_line_error(init(tmp_path / "c10", tiny_assets, teacher=f"run:{tampered}"), "model.safetensors differs from its commit record")
    # Files removed after the child was created: the stage that needs the teacher says so in one line.
    gone = tmp_path / "gone"
    shutil.copytree(parent, gone)
    assert init(tmp_path / "c11", tiny_assets, teacher=f"run:{gone}@1").exit_code == 0
    (export_dir(gone, 1) / "model.safetensors").unlink()
    with pytest.raises(Exception, match="is gone or changed since this run was created"):
        open_run(str(tmp_path / "c11" / "run")).teacher_models(0)


def test_a_fork_keeps_its_parents_teacher_resolution(parent, tiny_assets, tmp_path):
    assert init(tmp_path / "child", tiny_assets, teacher=f"run:{parent}").exit_code == 0
    child = tmp_path / "child" / "run"
    run_stages(child, "rollout")
    invoke_ok("fork", child, tmp_path / "fork", "--from-round", "0", "method.name=opd")
    assert open_run(str(tmp_path / "fork")).teacher_runs == open_run(str(child)).teacher_runs
