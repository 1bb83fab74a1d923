"""The scheduler's view of what is committed, a following stage's per-unit reads, and which of rollout's
files a stage reads, on a run folder's real records: plans, commits and manifests are written by hand,
no stage runs."""

from __future__ import annotations

import pytest

from gndpo.apps.schedule import CommittedStages, RoundOrder, may_start
from gndpo.errors import GndpoError
from gndpo.pipeline.exec import inputs
from gndpo.pipeline.exec.inputs import StageInputs
from gndpo.pipeline.run.products import ROLLOUTS, RolloutNumbers
from gndpo.pipeline.run.run import Run
from gndpo.pipeline.settings.schema import Config
from gndpo.stages.normalize import NormalizeJob
from gndpo.stages.rollout import HELDOUT_UNIT
from gndpo.stages.score import ScoreJob
from gndpo.storage.products import FileKind, FileRecord, Unit
from gndpo.storage.runfs import RunFS

SEQUENTIAL, STREAMED = RoundOrder(False, 0, ""), RoundOrder(True, 0, "")


def bare_run(tmp_path) -> Run:
    return Run(RunFS(str(tmp_path / "run")), Config())


def commit_manifest(run: Run, round_idx: int, stage: str) -> None:
    run.records(round_idx, stage).create_manifest({"units": [], "metrics": {}})


def test_a_stage_counts_as_committed_only_once_its_manifest_is_written(tmp_path):
    run = bare_run(tmp_path)
    committed = CommittedStages(run)  # one for the whole loop, as run_scheduled keeps it
    assert committed(-1, "train")  # before the first round there is nothing to wait for
    for _poll in range(3):  # the scheduler asks again on every poll: asking commits nothing
        assert not committed(0, "rollout")
        assert not may_start(run, SEQUENTIAL, 0, "score", {(0, "rollout")}, committed)
    # A streamed score may start beside a rollout this scheduler started, not before it.
    assert not may_start(run, STREAMED, 0, "score", set(), committed)
    assert may_start(run, STREAMED, 0, "score", {(0, "rollout")}, committed)
    commit_manifest(run, 0, "rollout")
    assert committed(0, "rollout") and may_start(run, SEQUENTIAL, 0, "score", set(), committed)
    for _poll in range(2):  # normalize reads score too
        assert not may_start(run, STREAMED, 0, "normalize", {(0, "rollout"), (0, "score")}, committed)
    commit_manifest(run, 0, "score")
    assert may_start(run, SEQUENTIAL, 0, "normalize", set(), committed)


def test_a_following_score_unit_waits_for_its_own_rollout_unit(tmp_path, monkeypatch):
    monkeypatch.setattr(inputs, "READY_LIST_S", 0.0)  # list the commits on every ask
    run = bare_run(tmp_path)
    rollout = run.records(0, ROLLOUTS)
    rollout.create_plan([Unit("u00000"), Unit("u00001")], {})
    reads = StageInputs(run, 0, ScoreJob.reads, follow=True)
    assert reads.plan_units(ROLLOUTS) == [Unit("u00000"), Unit("u00001")]  # planned from rollout's plan
    assert not reads.unit_ready("u00000") and not reads.unit_ready("u00001")
    rollout.commit(Unit("u00001"), 0, [], RolloutNumbers())
    assert reads.unit_ready("u00001") and not reads.unit_ready("u00000")  # each unit its own input unit
    assert reads.unit_commit(ROLLOUTS, "u00001").unit == "u00001"
    with pytest.raises(GndpoError, match="^rollout unit u00000 of round 0 is not committed$"):
        reads.unit_commit(ROLLOUTS, "u00000")
    rollout.commit(Unit("u00000"), 0, [], RolloutNumbers())
    assert reads.unit_ready("u00000")


def test_the_rollouts_a_stage_reads_are_the_response_shards_not_the_evaluation_units_files(tmp_path):
    run = bare_run(tmp_path)
    records = run.records(0, ROLLOUTS)
    shard = FileRecord("rounds/r0000/rollout/attempts/u00000/a000/part-00000.parquet", 10, "0", 4)
    # The held-out unit's accuracy table, and its held-out responses (rollout rows, for score's label-free measure).
    accuracy = FileRecord("rounds/r0000/rollout/attempts/eval-heldout/a000/eval.parquet", 10, "0", 4, FileKind.HELDOUT_ACCURACY)
    heldout = FileRecord("rounds/r0000/rollout/attempts/eval-heldout/a000/heldout.parquet", 10, "0", 4, FileKind.HELDOUT_ROLLOUTS)
    records.commit(Unit("u00000"), 0, [shard], RolloutNumbers())
    records.commit(HELDOUT_UNIT, 0, [accuracy, heldout], RolloutNumbers())
    records.create_manifest({"units": [records.done(u).to_json() for u in ("u00000", HELDOUT_UNIT.id)], "metrics": {}})
    assert StageInputs(run, 0, NormalizeJob.reads).files(ROLLOUTS) == [shard]  # never a held-out prompt's response
    assert records.manifest().heldout().files == [accuracy, heldout]
