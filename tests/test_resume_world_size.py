"""Train resumed by another number of ranks than wrote the state it would continue from.

ZeRO partitions are per rank, so :func:`resume_point` continues after an in-round checkpoint only where
as many ranks wrote it as resume now, and :func:`start_at` loads a carried optimizer state only then.
A checkpoint of another world size is passed over for the next source the run has (the kept engine,
the carried state, a fresh start), and the update starts again at step 0 from weights it holds: never
after steps whose weights it did not load. The records are fabricated in a run folder and the engine
is a stand-in: no model, no DeepSpeed launch."""

from __future__ import annotations

import dataclasses

import torch

from gndpo.dist import Dist
from gndpo.pipeline.config.load import config_from_dict
from gndpo.pipeline.exec.units import working_dir
from gndpo.pipeline.run.products import POLICY, CarriedState
from gndpo.stages.training.checkpoint import UNIT, CheckpointRecord, ResumePoint, Start, resume_point, start_at
from tests.fabricated_runs import committed_train, fabricated_run

CARRIED = CarriedState(world=1, files=[])  # round 0's optimizer state, written by this one rank
STEPS_TAKEN = 2  # the steps the earlier attempt took before its checkpoint


class Engine:
    """Stands in for a DeepSpeed engine: counts the states loaded into it."""

    def __init__(self):
        self.module = torch.nn.Linear(1, 1)  # no adapters: the state loads strictly
        self.loads = 0

    def load_checkpoint(self, *_args, **_kwargs):
        self.loads += 1


def left_checkpoint(run, round_idx: int, world: int, attempt: int = 1, steps: int = STEPS_TAKEN) -> CheckpointRecord:
    """Attempt ``attempt`` of the round's update claimed it and left a checkpoint after ``steps``
    steps, written by ``world`` ranks; its record (what resume_point reads), without state files."""
    records = run.records(round_idx, POLICY)
    assert records.create_claim(UNIT, attempt, {"worker": "killed"})
    record = CheckpointRecord(step=steps, history=[{"loss": 1.0}] * steps, world=world, files=[])
    assert run.fs.create_json(f"{working_dir(records, UNIT, attempt)}/step-{steps:05d}.json", record.to_json())
    return record


def test_an_in_round_checkpoint_is_continued_only_by_as_many_ranks_as_wrote_it(tmp_path):
    for written_by in (1, 2):
        run = fabricated_run(tmp_path / f"written-by-{written_by}")
        committed_train(run, 0, optimizer_state=CARRIED.to_json())
        record = left_checkpoint(run, 1, written_by)
        fresh_run = dataclasses.replace(run, cfg=config_from_dict({"train": {"carry_optimizer_state": False}}))
        # Where round 1 continues, resumed by one rank, as each source after the checkpoint would have it.
        cases = [(run, True, ResumePoint("kept")), (run, False, ResumePoint("carried", CARRIED)), (fresh_run, False, ResumePoint("fresh"))]
        for opened, kept, otherwise in cases:
            point = resume_point(opened, 1, Dist(), kept)
            engine = Engine()
            start = start_at(point, engine, opened, 1, 1, None, log=lambda _: None)
            if written_by == 1:  # the steps taken are not taken again
                assert point == ResumePoint("checkpoint", record)
                assert start == Start(record.history, STEPS_TAKEN, True) and engine.loads == 1
            else:  # the round again from its start: its weights are the kept, the carried or the exported ones
                assert point == otherwise, (kept, opened.cfg.train.carry_optimizer_state)
                assert start == Start([], 0, point.source != "fresh") and engine.loads == (point.source == "carried")


def test_a_carried_optimizer_state_of_another_number_of_ranks_starts_a_fresh_one_and_says_so(tmp_path):
    run = fabricated_run(tmp_path)
    committed_train(run, 0)
    said, engine = [], Engine()
    start = start_at(ResumePoint("carried", CarriedState(world=2)), engine, run, 1, 1, None, log=said.append)
    assert start == Start([], 0, False) and engine.loads == 0
    assert said == ["train r1: optimizer state of round 0 was written by 2 ranks; starting a fresh one"]


def test_a_newer_checkpoint_of_another_number_of_ranks_does_not_hide_this_numbers(tmp_path):
    """Attempt 1 (one rank) checkpointed after 2 steps, attempt 2 (two ranks) after 3: one rank resuming
    continues after attempt 1's step 2, not the whole round again."""
    run = fabricated_run(tmp_path)
    committed_train(run, 0, optimizer_state=CARRIED.to_json())
    ours = left_checkpoint(run, 1, world=1, attempt=1, steps=STEPS_TAKEN)
    left_checkpoint(run, 1, world=2, attempt=2, steps=STEPS_TAKEN + 1)
    assert resume_point(run, 1, Dist(), kept=False) == ResumePoint("checkpoint", ours)
