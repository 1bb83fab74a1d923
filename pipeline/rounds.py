"""The round loop, and running one stage as a resumable job.

``run_stage`` runs one stage of one round in this process through the work-unit executor
(:mod:`gndpo.pipeline.units`). ``run_rounds`` loops rollout -> score -> normalize -> train for each round,
skipping every stage whose manifest is already committed, so rerunning it after a crash resumes at the
first uncommitted stage. Each stage runs in its own process: vLLM and DeepSpeed each own the process they
start in, memory is returned between stages, and train can be launched with several ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from gndpo.errors import GndpoError
from gndpo.pipeline.metrics import write_metrics_jsonl
from gndpo.pipeline.runs import open_run
from gndpo.pipeline.units import Worker, run_collective
from gndpo.storage.records import STAGES


def stage_job(stage: str):
    from gndpo.stages.normalize import NormalizeJob
    from gndpo.stages.rollout import RolloutJob
    from gndpo.stages.score import ScoreJob
    from gndpo.stages.train import TrainJob

    jobs = {"rollout": RolloutJob, "score": ScoreJob, "normalize": NormalizeJob, "train": TrainJob}
    if stage not in jobs:
        raise GndpoError(f"unknown stage {stage!r}; choose one of: {', '.join(STAGES)}")
    return jobs[stage]


def check_round(run, round_idx: int, stage: str) -> None:
    """A stage of round k needs the previous stage of round k (or round k-1's train) committed."""
    if round_idx < 0:
        raise GndpoError(f"round must be >= 0, got {round_idx}")
    i = STAGES.index(stage)
    prev_round, prev_stage = (round_idx, STAGES[i - 1]) if i > 0 else (round_idx - 1, "train")
    if prev_round >= 0 and run.records(prev_round, prev_stage).manifest() is None:
        raise GndpoError(f"cannot run {stage} of round {round_idx}: {prev_stage} of round {prev_round} is not committed")


def run_stage(url: str, stage: str, round_idx: int, worker: bool = False, lease_ttl: float = 120.0, log=print) -> dict | None:
    """Run (or join, with ``worker``) one stage; returns its manifest, or None if other workers still
    hold units when this worker runs out of work."""
    run = open_run(url)
    check_round(run, round_idx, stage)
    job = stage_job(stage)(run, round_idx, log=log)
    if lease_ttl <= 0:
        raise GndpoError("--lease-ttl must be positive")
    records = run.records(round_idx, stage)
    if stage == "train" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        manifest = run_collective(records, job, ttl=lease_ttl, log=log)
    else:
        manifest = Worker(records, job, ttl=lease_ttl, log=log).run(wait_for_others=not worker)
    if manifest is not None:
        write_metrics_jsonl(run)
    return manifest


def stage_command(url: str, stage: str, round_idx: int, num_processes: int = 1) -> list[str]:
    """The command line that runs one stage in a fresh process (train under torchrun for >1 rank)."""
    tail = ["-m", "gndpo.cli", stage, url, "--round", str(round_idx)]
    if stage == "train" and num_processes > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_processes}", *tail]
    return [sys.executable, *tail]


def run_rounds(url: str, rounds: int, log=print) -> None:
    """Run rounds 0..rounds-1, skipping committed stages; a failing stage stops the loop."""
    run = open_run(url)
    for r in range(rounds):
        for stage in STAGES:
            if run.records(r, stage).manifest() is not None:
                continue
            t0 = time.time()
            log(f"round {r}: {stage} ...")
            proc = subprocess.run(stage_command(url, stage, r, run.cfg.train.num_processes))
            if proc.returncode != 0:
                raise GndpoError(f"{stage} of round {r} failed (exit code {proc.returncode}); rerun to resume")
            log(f"round {r}: {stage} committed in {time.time() - t0:.1f}s")
