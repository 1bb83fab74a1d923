"""`gndpo fork`: a new run that re-scores a parent run's committed rollouts with other settings, reading
them where they are (never copied or recomputed), resumable after a crash, refused where it cannot be
what it says."""

import signal

import pytest
import yaml

from gndpo.pipeline.run.run import open_run
from tests.conftest import assert_one_line_error, committed_rows, gndpo, gndpo_killed, invoke, invoke_ok, run_stages

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def parent(rolled_out):
    """A run with round 0's rollouts committed, and nothing after."""
    return rolled_out


@pytest.fixture(scope="module")
def forked(parent, tmp_path_factory):
    """A fork at round 0 with another method, through round 0 with `gndpo run`."""
    new = tmp_path_factory.mktemp("fork-child") / "run"
    out = gndpo("fork", parent, new, "--from-round", "0", "method.name=opd", "train.lr=5e-4").stdout
    assert "forked from" in out
    invoke_ok("run", new, "--rounds", "1")
    return new


def test_the_fork_recomputes_no_rollout_and_records_its_lineage(parent, forked):
    assert not (forked / "rounds" / "r0000" / "rollout").exists()  # nothing sampled, nothing copied
    assert (forked / "rounds" / "r0000" / "train" / "_MANIFEST.json").exists()
    run = open_run(str(forked))
    assert run.lineage == {"parent": str(parent), "from_round": 0, "parent_fingerprint": open_run(str(parent)).cfg.fingerprint()}
    assert run.cfg.method.name == "opd" and run.cfg.train.lr == 5e-4
    assert yaml.safe_load((forked / "run.yaml").read_text())["lineage"]["parent"] == str(parent)
    # Round 0's rollouts are the parent's rows, read in the parent's folder.
    rollouts = run.records(0, "rollout").manifest()
    assert all(f.run == str(parent) for u in rollouts.units for f in u.files)
    scored = committed_rows(forked, "score")
    assert [r["rollout_id"] for r in scored] == [r["rollout_id"] for r in committed_rows(parent)]
    # The SQL views read them there too.
    out = invoke_ok("sql", forked, "SELECT count(*) AS n FROM rollouts JOIN scores USING (rollout_id)").stdout
    assert "32" in out


def test_a_crashed_forked_round_resumes_to_the_same_rows(parent, forked, tmp_path):
    new = tmp_path / "run"
    invoke_ok("fork", parent, new, "--from-round", "0", "method.name=opd", "train.lr=5e-4")
    code = gndpo_killed("score", new, "--round", "0", env={"GNDPO_CRASH_AT": "units.before_commit"}, log=tmp_path / "crash.log")
    assert code == -signal.SIGKILL, (tmp_path / "crash.log").read_text()[-2000:]
    assert open_run(str(new)).records(0, "score").manifest() is None
    run_stages(new, "score")
    assert committed_rows(new, "score") == committed_rows(forked, "score")
    # Forking again with the same settings is a no-op; with others, refused.
    invoke_ok("fork", parent, new, "--from-round", "0", "method.name=opd", "train.lr=5e-4")
    assert_one_line_error(invoke("fork", parent, new, "--from-round", "0", "method.name=gndpo"), "already exists with other settings")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--from-round", "1"), "its rollout of round 1 is not committed"),
        (("--from-round", "0", "rollout.temperature=0.5"), "fork: rollout cannot change"),
        (("--from-round", "0", "student=/elsewhere"), "fork: student cannot change"),
        (("--from-round", "0", "method.name=grpo", "method.outcome.rewards=[tests.custom_rewards:length]"),
         "did not record the reward(s) tests.custom_rewards:length"),
    ],
)
def test_refusals_are_one_line_and_write_nothing(parent, tmp_path, args, fragment):
    new = tmp_path / "new"
    assert_one_line_error(invoke("fork", parent, new, *args), fragment)
    assert not new.exists()


def test_forking_into_a_file_names_the_file(parent, tmp_path):
    """Every other check passes (round 0 is committed, the settings may change): the file in the way is
    the one reason, and it is left as it was."""
    file = tmp_path / "file"
    file.write_text("not a run\n")
    assert_one_line_error(invoke("fork", parent, file, "--from-round", "0", "method.name=opd"), "not a folder", str(file))
    assert file.read_text() == "not a run\n" and list(tmp_path.iterdir()) == [file]


def test_inherited_stages_are_never_rerun(forked):
    result = invoke("rollout", forked, "--round", "0")
    assert result.exit_code == 0 or "inherited" in result.stderr
    assert not (forked / "rounds" / "r0000" / "rollout").exists()
