"""train.state_every: the optimizer state written after every N-th round only, and replayed where a
train starts without it.

Two toy runs of 3 rounds with ``state_every: 3`` (rounds 0 and 1 write no optimizer state, round 2
does). The first is one `gndpo run --rounds 3` (in the test's process), whose kept DeepSpeed engine carries the
state in memory. The second stops after 2 rounds and a second `gndpo run` goes on to round 3, as after a crash: its
round-2 train starts without the state and rebuilds it by replaying rounds 0 and 1 from their committed rows.
Both must commit the same rows and the same weights, byte for byte.

By default (``train.final_state`` false) a run's last round writes no state: a one-round job writes
none, and extending it (`gndpo run --rounds 2`) replays its round instead, to the same weights.
"""

import hashlib
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from gndpo.pipeline.run.products import POLICY, TrainNumbers
from gndpo.pipeline.run.run import open_run
from gndpo.storage.products import Commit
from tests.conftest import committed_rows, gndpo_killed, invoke_ok, run_log, tiny_config_dict, write_config

pytestmark = pytest.mark.slow
ROUNDS = 3


# The student's own module samples (rollout.backend hf): what is tested is train's optimizer state, and
# the killed `gndpo run` process then starts no vLLM engine.
ROLLOUT = {"eval_heldout": False, "backend": "hf"}


def new_run(folder, assets):
    run = folder / "run"
    # final_state: the runs' last round writes its state too, as every third round does.
    config = write_config(folder, tiny_config_dict(assets, train={"state_every": 3, "final_state": True}, rollout=ROLLOUT))
    invoke_ok("init", run, "--config", config)
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_assets):
    """(the uninterrupted run, the run continued by a new process after round 1, its second log)."""
    # In this process, each run's rounds with one kept DeepSpeed engine, as `gndpo run` keeps it; the
    # resumed run's last round is a call of its own, whose models (made and closed by that call) never
    # held the state.
    whole = new_run(tmp_path_factory.mktemp("whole"), tiny_assets)
    invoke_ok("run", whole, "--rounds", ROUNDS)
    resumed = new_run(tmp_path_factory.mktemp("resumed"), tiny_assets)
    invoke_ok("run", resumed, "--rounds", ROUNDS - 1)
    invoke_ok("run", resumed, "--rounds", ROUNDS)  # a new call: its kept engine never held the state
    return whole, resumed, run_log(resumed)


def weights(run, round_idx: int) -> dict:
    model_dir = open_run(str(run)).records(round_idx, "train").manifest().metrics["model_dir"]
    return load_file(str(run / model_dir / "model.safetensors"))


def assert_rounds_equal(run, whole, rounds: int) -> None:
    """``run``'s first ``rounds`` rounds committed ``whole``'s rollout and score rows and weights, byte for byte."""
    for round_idx in range(rounds):
        for stage in ("rollout", "score"):
            assert committed_rows(run, stage, round_idx) == committed_rows(whole, stage, round_idx), (stage, round_idx)
        got, want = weights(run, round_idx), weights(whole, round_idx)
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"round {round_idx} {name}")


def train_commit(run, round_idx: int) -> Commit[TrainNumbers]:
    return open_run(str(run)).records(round_idx, POLICY).require_manifest().only()


def test_only_every_third_round_writes_the_optimizer_state(runs):
    """Rounds 0 and 1 write no state; round 2 writes it after its commit (train.state_async, as `gndpo
    run` keeps the engine): the commit names the record, which lists the files by sha256."""
    whole, resumed, _ = runs
    for run in (whole, resumed):
        for round_idx in range(ROUNDS):
            commit = train_commit(run, round_idx)
            # What a round commits is its export: no more than the policy's bytes; the state comes later.
            assert not [f for f in commit.files if "/optimizer/" in f.path]
            assert commit.bytes == sum(f.bytes for f in commit.files if "/model/" in f.path)
            assert (commit.numbers.optimizer_state is not None) == (round_idx == 2), (run.name, round_idx)
        record = json.loads((run / train_commit(run, 2).numbers.optimizer_state.pending).read_text())
        assert record["world"] == 1 and record["bytes"] == sum(f["bytes"] for f in record["files"]) > 0
        for f in record["files"]:
            assert "/optimizer/" in f["path"] and hashlib.sha256((run / f["path"]).read_bytes()).hexdigest() == f["sha256"]


def test_a_replayed_state_gives_the_rows_and_weights_of_the_uninterrupted_run(runs):
    whole, resumed, log = runs
    assert "optimizer state replayed from round 0 to round 1" in log, log[-3000:]
    assert "replay" in train_commit(resumed, 2).numbers.phases and "replay" not in train_commit(whole, 2).numbers.phases
    for run in (whole, resumed):  # the state continued in every round after the first, replayed or kept
        assert [train_commit(run, r).numbers.optimizer_state_resumed for r in range(ROUNDS)] == [False, True, True]
    assert_rounds_equal(resumed, whole, ROUNDS)


def test_a_crash_before_a_deferred_state_is_recorded_costs_a_replay_not_a_wrong_state(runs, tmp_path, tiny_assets):
    """train.state_every 1 with train.state_async: the process is killed while round 0's state is
    being written behind round 1's rollout (its files written, its record not). The state does not
    exist; the rerun's round-1 train replays round 0 and both rounds end on the uninterrupted run's
    rows and weights, byte for byte."""
    whole = runs[0]
    run = tmp_path / "run"
    config = write_config(tmp_path, tiny_config_dict(tiny_assets, train={"state_every": 1}, rollout=ROLLOUT))
    invoke_ok("init", run, "--config", config)
    assert gndpo_killed("run", run, "--rounds", 2, env={"GNDPO_CRASH_AT": "train.state_write"}, log=tmp_path / "crash.log") == -9
    assert train_commit(run, 0).numbers.optimizer_state.pending and not (run / train_commit(run, 0).numbers.optimizer_state.pending).exists()
    invoke_ok("run", run, "--rounds", 2)  # the rerun, in this process
    log = run_log(run)
    assert "optimizer state replayed from round 0 to round 0" in log, log[-3000:]
    assert_rounds_equal(run, whole, 2)


def test_a_one_round_job_writes_no_state_and_extending_it_replays_exactly(runs, tmp_path, tiny_assets):
    """Defaults (train.state_every 1, train.final_state false): `gndpo run --rounds 1` commits its policy
    and writes no optimizer state; `gndpo run --rounds 2` then rebuilds round 0's state by replay, and
    round 1 ends on the uninterrupted run's rows and weights, byte for byte (and, the run's last round
    now, writes no state either)."""
    whole = runs[0]
    run = tmp_path / "run"
    invoke_ok("init", run, "--config", write_config(tmp_path, tiny_config_dict(tiny_assets, rollout=ROLLOUT)))
    invoke_ok("run", run, "--rounds", 1)
    assert train_commit(run, 0).numbers.optimizer_state is None
    assert not [p for p in run.rglob("*") if "optimizer" in p.parts]
    invoke_ok("run", run, "--rounds", 2)
    log = run_log(run)
    assert "optimizer state replayed from round 0 to round 0" in log, log[-3000:]
    assert [train_commit(run, r).numbers.optimizer_state_resumed for r in range(2)] == [False, True]
    assert train_commit(run, 1).numbers.optimizer_state is None
    assert_rounds_equal(run, whole, 2)
