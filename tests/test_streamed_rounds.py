"""Train streams a round by mini-batch: its share is the same rows as the whole round read at once,
step for step and rank for rank, whether the step files stay in memory or go to disk, and it holds at
most the step being trained and the next one."""

from __future__ import annotations

import math
import random
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gndpo.storage import step_files
from gndpo.storage.step_files import StepFiles

STEPS = 5


def test_step_files_spill_past_their_buffer_and_read_back_what_was_appended():
    tables = {step: [pa.table({"x": pa.array(np.arange(part * 100, part * 100 + 50) + step)}) for part in range(3)] for step in range(4)}
    for buffer_bytes, spills in ((1 << 30, False), (1_000, True)):
        files = StepFiles(buffer_bytes=buffer_bytes)
        for part in range(3):
            for step in (0, 2, 3):  # step 1 gets no rows
                files.append(step, tables[step][part])
        files.seal()
        assert (files.bytes_on_disk() > 0) == spills
        for step in (0, 2, 3):
            assert files.read(step).column("x").to_pylist() == pa.concat_tables(tables[step]).column("x").to_pylist()
        assert files.read(1) is None
        files.close()


def whole_round(run, round_idx: int) -> tuple[pa.Table, pa.Table]:
    """The round's rollout and score rows, every shard read at once with pyarrow, scores lined up with rollouts."""

    def read(records):
        return pa.concat_tables([pq.read_table(run.fs.holding(r).path(r.path)) for r in records], promote_options="default")

    rollouts = read(run.records(round_idx, "rollout").require_manifest().row_files())
    scores = read(run.records(round_idx, "score").require_manifest().files())
    row_of = {rid: i for i, rid in enumerate(scores.column("rollout_id").to_pylist())}
    return rollouts, scores.take([row_of[rid] for rid in rollouts.column("rollout_id").to_pylist()])


def expected_steps(rollout_ids: list[str], seed: int, round_idx: int, steps: int) -> list[list[str]]:
    """The documented order: a shuffle seeded by (train seed, round) of the manifest's order, cut into equal parts."""
    order = list(rollout_ids)
    random.Random(f"{seed}:{round_idx}").shuffle(order)
    size = math.ceil(len(order) / steps)
    return [order[i : i + size] for i in range(0, len(order), size)]


def assert_same_row(got, want) -> None:
    assert (got.rollout_id, got.prompt_id, got.teacher, got.weight) == (want.rollout_id, want.prompt_id, want.teacher, want.weight)
    for name in ("prompt", "response", "old_logp", "adv", "pg_mask", "div", "mask", "topk_ids", "topk_logp", "topk_rest"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name


@pytest.mark.slow
@pytest.mark.parametrize("buffer_bytes", [None, 4_096], ids=["in-memory", "spilled"])
def test_a_streamed_share_is_the_whole_round_step_for_step_and_rank_for_rank(rolled_out, tmp_path, monkeypatch, buffer_bytes):
    from gndpo.pipeline.run.run import open_run
    from gndpo.pipeline.run.stats import round_stats
    from gndpo.stages.train import TrainJob
    from gndpo.stages.training import batch
    from tests.conftest import invoke_ok, run_stages

    if buffer_bytes is not None:
        monkeypatch.setattr(step_files, "BUFFER_BYTES", buffer_bytes)
    run_dir = tmp_path / "run"
    invoke_ok("fork", rolled_out, run_dir, "--from-round", "0", "method.name=reverse_kl", "score.teacher_topk=4",
              f"train.optimizer_steps={STEPS}", "train.seed=7")
    run_stages(run_dir, "score", "normalize")
    run = open_run(str(run_dir))

    rollouts, scores = whole_round(run, 0)
    reference = {row.rollout_id: row for row in batch._join(rollouts, scores, run, 0, round_stats(run, 0))}
    steps = expected_steps(rollouts.column("rollout_id").to_pylist(), 7, 0, STEPS)
    assert len(steps) == STEPS and len(reference) == rollouts.num_rows > STEPS * 2

    for world in (1, 2):
        for rank in range(world):
            with batch.load_share(TrainJob(run, 0).inputs, rank, world) as share:
                assert (share.step_file_bytes() > 0) == (buffer_bytes is not None)
                assert share.step_sizes == [len(ids) for ids in steps]
                for i, ids in enumerate(steps):
                    want = [reference[rid] for rid in ids[rank::world]]
                    got = share.rows(i)
                    assert [r.rollout_id for r in got] == [r.rollout_id for r in want]
                    for g, w in zip(got, want):
                        assert_same_row(g, w)
                    index = share.index[i]
                    assert index.tokens.tolist() == [r.tokens for r in want]
                    assert index.prompt_ids == [r.prompt_id for r in want]
                    assert index.loss_tokens == sum(float(r.mask.sum()) for r in want)
                    assert index.weight_sum == sum(r.weight for r in want)
                if world == 1:  # the schedule from the index is the one from the rows themselves
                    from gndpo.stages.train import schedule_steps

                    in_memory = batch.RoundShare.of_rows([[reference[rid] for rid in ids] for ids in steps])
                    assert schedule_steps(share, run.cfg.train, 64) == schedule_steps(in_memory, run.cfg.train, 64)
                    in_memory.close()


def test_a_share_reads_each_step_once_and_holds_at_most_the_next(monkeypatch):
    """rows(i) reads step i (unless read ahead) and starts reading step i + 1, nothing further."""
    from gndpo.stages.training.batch import AdvantageSums, RoundShare, StepIndex, read_step_rows

    files = StepFiles()
    for step in range(6):
        files.append(step, pa.table({"step_position": pa.array([0], pa.int64()), "x": pa.array([step])}))
    files.seal()
    reads = []
    original = files.read

    def counted(step):
        reads.append(step)
        return original(step)

    monkeypatch.setattr(files, "read", counted)
    index = [StepIndex(np.zeros(1, np.int64), np.zeros(1, np.int64), [""], 0.0, 0.0) for _ in range(6)]
    read_step = partial(read_step_rows, files, lambda rollouts, scores: rollouts.column("x").to_pylist())
    with RoundShare(index, [1] * 6, AdvantageSums(), read_step, files) as share:
        assert share.rows(2) == [2]  # a resumed round starts at a later step
        for step in range(3, 6):
            assert len(share._pending) <= 1
            assert share.rows(step) == [step]
        assert reads == [2, 3, 4, 5]
