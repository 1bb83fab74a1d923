"""Crash safety and shared stages, through the real stages on tiny models.

A reference run goes through round 0 uninterrupted, its vLLM engine in processes of its own. A second
run with the same config but the engine inside each stage's process (engine.in_process) is killed with
SIGKILL at several points (during generation, half-way through a shard write, between the data write
and the commit, during training) and rerun each time; it must end with exactly the reference's rows and
the same trained weights. The shard-write and commit crashes hit the score stage: every stage writes
and commits through the same storage and executor code, and score restarts without a vLLM engine.
Copies of the reference's committed rollouts then serve the concurrency, stale-lease and corruption
tests, so the module starts vLLM three times (the reference, the crash during generation, the rerun).
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from gndpo.pipeline.exec.status import stage_rows
from gndpo.pipeline.exec.units import working_dir
from gndpo.pipeline.run.run import open_run
from tests.conftest import committed_rows, gndpo, gndpo_killed, invoke, invoke_ok, run_stages, tiny_config_dict, write_config

pytestmark = pytest.mark.slow
ROUND = ("--round", "0")


def make_config(folder, assets, in_process: bool):
    """The toy config; ``in_process``: the vLLM engine inside the stage's process (engine.in_process)."""
    cfg = tiny_config_dict(
        assets,
        rollout={"prompts_per_unit": 4},  # 4 generation units + the held-out eval unit
        train={"optimizer_steps": 3, "checkpoint_every": 1},
        engine={"in_process": in_process},
    )
    return write_config(folder, cfg)


def crashed(run, stage, point, after=0):
    """Run a stage that SIGKILLs itself at ``point``, then kill what it started."""
    log = run.parent / f"crash-{stage}-{point}.log"
    code = gndpo_killed(stage, run, *ROUND, env={"GNDPO_CRASH_AT": point, "GNDPO_CRASH_AFTER": str(after)}, log=log)
    assert code == -signal.SIGKILL, log.read_text()[-2000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_assets):
    folder = tmp_path_factory.mktemp("reference")
    run = folder / "run"
    # The engine in processes of its own here, in the stage's process in the crashed run: the two
    # layouts must commit the same rows and weights.
    invoke_ok("init", run, "--config", make_config(folder, tiny_assets, in_process=False))
    gndpo("rollout", run, *ROUND)
    # Keep a copy with only the rollouts committed, for the concurrency and lease tests.
    shutil.copytree(run, folder / "after-rollout")
    run_stages(run, "score", "normalize", "train")  # in this process: the crashed run tests the processes
    return folder


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory, tiny_assets):
    folder = tmp_path_factory.mktemp("crashed")
    run = folder / "run"
    invoke_ok("init", run, "--config", make_config(folder, tiny_assets, in_process=True))
    # The crashes are real processes killed mid-stage; each rerun goes through the same stage code in
    # this process (no interpreter start and import of vLLM or DeepSpeed per rerun).
    crashed(run, "rollout", "rollout.generate", after=1)  # u00000 committed, dies generating u00001
    run_stages(run, "rollout")
    crashed(run, "score", "storage.write")  # dies with half of u00000's score shard on disk
    crashed(run, "score", "units.before_commit")  # u00000's files complete, no commit record
    run_stages(run, "score", "normalize")
    crashed(run, "train", "train.step", after=1)  # two optimizer steps taken, one checkpointed
    run_stages(run, "train")
    return run


def test_crashed_rollout_has_exactly_the_reference_rows(reference, crashed_run):
    want, got = committed_rows(reference / "run"), committed_rows(crashed_run)
    ids = [r["rollout_id"] for r in got]
    assert len(ids) == len(set(ids)) == 32
    assert ids == [r["rollout_id"] for r in want]
    assert [r["response_token_ids"] for r in got] == [r["response_token_ids"] for r in want]
    run = open_run(str(crashed_run))
    assert run.records(0, "rollout").done("u00001").attempt == 2
    assert run.records(0, "score").done("u00000").attempt == 3
    assert committed_rows(crashed_run, "score") == committed_rows(reference / "run", "score")


def test_crashed_train_resumes_without_repeating_steps(reference, crashed_run):
    run = open_run(str(crashed_run))
    commit = run.records(0, "train").done("update")
    assert commit.attempt == 2 and commit.numbers.resumed_after_step == 1 and len(commit.numbers.steps) == 3
    ref = open_run(str(reference / "run"))
    got = load_file(str(crashed_run / run.records(0, "train").manifest().metrics["model_dir"] / "model.safetensors"))
    want = load_file(str(reference / "run" / ref.records(0, "train").manifest().metrics["model_dir"] / "model.safetensors"))
    assert got.keys() == want.keys()
    for key in want:  # "the same trained weights": bit for bit, as resume promises
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_gc_removes_only_unreferenced_attempts(crashed_run):
    out = gndpo("gc", crashed_run).stdout
    run = open_run(str(crashed_run))
    rollout, score = run.records(0, "rollout"), run.records(0, "score")
    assert not (crashed_run / rollout.attempt_dir("u00001", 1)).exists()
    assert (crashed_run / rollout.attempt_dir("u00001", 2)).exists()
    for attempt in (1, 2):
        assert not (crashed_run / score.attempt_dir("u00000", attempt)).exists()
    assert (crashed_run / score.attempt_dir("u00000", 3)).exists()
    train = run.records(0, "train")
    assert not (crashed_run / train.attempt_dir("update", 1)).exists()
    # The committed train attempt keeps its export; its in-round checkpoint (after step 2), which only a
    # retry of the uncommitted round would read, goes.
    assert (crashed_run / train.attempt_dir("update", 2) / "model" / "model.safetensors").is_file()
    assert not (crashed_run / working_dir(train, "update", 2)).exists()
    # rollout u00001's attempt 1 died before writing anything, so the folders to remove are score
    # u00000's attempts 1 and 2, train's attempt 1 and the committed attempt's checkpoints
    assert "4 unreferenced folder(s) removed" in out
    committed_rows(crashed_run)  # everything committed still reads


def start_worker(run, stage, *extra, env=None):
    return subprocess.Popen(
        [sys.executable, "-m", "gndpo.cli", stage, str(run), *ROUND, "--worker", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_three_workers_commit_every_unit_once(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference / "after-rollout", run)
    workers = [start_worker(run, "score") for _ in range(3)]
    for w in workers:
        _, err = w.communicate(timeout=300)
        assert w.returncode == 0, err[-2000:]
    rec = open_run(str(run)).records(0, "score")
    units = rec.plan().ids()
    assert len(units) == 4 and rec.done_units() == set(units)
    for unit in units:  # exactly one attempt was ever made per unit: no duplicate work, no loser
        assert rec.attempts(unit) == [1]
    assert rec.manifest().rows == 32
    assert committed_rows(run, "score") == committed_rows(reference / "run", "score")


def process_state(pid: int) -> str:
    """The one-letter state in /proc (T = stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_stale_lease_is_taken_over_and_the_late_commit_is_rejected(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference / "after-rollout", run)
    # The first worker freezes (heartbeats included) right before committing its first unit.
    slow = start_worker(run, "score", "--lease-ttl", "2", env={"GNDPO_PAUSE_AT": "units.before_commit"})
    rec = open_run(str(run)).records(0, "score")
    deadline = time.time() + 180
    while process_state(slow.pid) != "T" and time.time() < deadline:
        time.sleep(0.5)
    assert process_state(slow.pid) == "T", "the first worker never reached its pause point"
    time.sleep(3)  # longer than its 2 s ttl: no heartbeat comes from a stopped process
    score = next(r for r in stage_rows(open_run(str(run))) if r["stage"] == "score")
    assert score["stale"] == 1 and score["done"] == 0
    run_stages(run, "score")  # a worker in this process takes u00000 over as attempt 2 and finishes the stage
    assert rec.done("u00000").attempt == 2
    os.kill(slow.pid, signal.SIGCONT)
    _, err = slow.communicate(timeout=120)
    assert slow.returncode == 0, err[-2000:]
    assert rec.done("u00000").attempt == 2  # the late commit lost
    assert not (run / rec.attempt_dir("u00000", 1)).exists()  # and cleaned up after itself
    assert committed_rows(run, "score") == committed_rows(reference / "run", "score")


def test_corrupt_shard_is_refused_by_name(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference / "after-rollout", run)
    shard = next(f for f in open_run(str(run)).records(0, "rollout").manifest().row_files())
    path = run / shard.path
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    result = invoke("score", run, *ROUND)  # in this process: its progress lines, then the error as the last line
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == f"error: corrupt shard (checksum mismatch with its commit record): {path}"
    assert open_run(str(run)).records(0, "score").manifest() is None
