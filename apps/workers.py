"""Workers that stay: in the overlapped orders `gndpo run` starts one process per stage (per device set)
for the whole run instead of one per stage and round.

A worker that stays (:func:`work_rounds`, `gndpo STAGE RUN --rounds N`) loads its models once and keeps
them (:class:`gndpo.stages.models.live.LiveModels` with ``keep``: the rollout engine takes each new policy
into the running engine from the exported files, train keeps its DeepSpeed engine and optimizer state),
and works its stage round after round through the same plans, leases and commits as a stage command:
each round once what it reads is committed, woken by the run's commits (:mod:`gndpo.storage.bell`).
Rows and weights are the stage commands' own, whoever computes them and when.

:func:`run_with_workers` is the scheduler for them: it starts every stage's workers at once, shows the
rounds as their stages commit, restarts a worker that was killed (it resumes from the run folder) and
stops them all when one fails.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

from gndpo.apps.rounds import DeviceSets, StageGroup, Stay, run_stage, stage_cpus, worker_log, worker_log_dir
from gndpo.apps.schedule import POLL_S, CommittedStages, RoundOrder, ordered_processes, reads_ready
from gndpo.errors import GndpoError
from gndpo.pipeline.exec.units import WAIT_HELD, WAIT_INPUT
from gndpo.pipeline.observe import progress
from gndpo.pipeline.observe.logs import info
from gndpo.pipeline.run.run import open_run
from gndpo.stages.models.live import LiveModels
from gndpo.stages.registry import stage_names
from gndpo.storage.bell import CommitBell

RESTARTS = 2  # times a killed worker of one stage is started again before the run stops


def work_rounds(url: str, stage: str, stay: Stay, follow: bool = False, lease_ttl: float = 120.0, log=info) -> None:
    """Work ``stage`` in every round up to ``stay.rounds`` in this process, keeping its models: each
    round once its own previous round and what it reads are committed (a read it streams behind, with
    ``follow``, as soon as that stage plans), the actor at most ``stay.ahead`` rounds before the learner.
    A round this worker finds committed is skipped; one it finishes it waits for, so its manifest is
    written before the next round begins (a unit another worker abandoned is taken over)."""
    run = open_run(url)
    committed, bell = CommittedStages(run), CommitBell(run.fs)
    live = LiveModels(keep=True, log=log)
    try:
        for r in range(stay.rounds):
            if committed(r, stage):
                continue
            waited = wait_for_round(run, stage, r, stay, follow, committed, bell)
            if any(waited.values()):
                run.records(r, stage).note_wait(f"{socket.gethostname()}:{os.getpid()}:before", waited)
            run_stage(url, stage, r, lease_ttl=lease_ttl, log=log, live=live, follow=follow, run=run, final=r == stay.rounds - 1)
            live.release_engine()  # on a GPU the kept engines sleep while this worker waits for its next round
    finally:
        bell.close()
        live.close()


def wait_for_round(run, stage: str, round_idx: int, stay: Stay, follow: bool, committed: CommittedStages, bell: CommitBell) -> dict:
    """Block until ``stage`` may start ``round_idx`` (:func:`work_rounds`); the seconds it waited, by
    cause: for its input (:data:`WAIT_INPUT`), or, its reads there, held by the actor's bound ahead of
    the learner (:data:`WAIT_HELD`)."""
    streamed = lambda _read_stage, _round: follow  # noqa: E731 - a followed read is awaited by the stage itself
    waited = {WAIT_INPUT: 0.0, WAIT_HELD: 0.0}
    while not (committed(round_idx - 1, stage) and reads_ready(run, stage, round_idx, committed, stay.ahead, streamed)):
        # Held: ready but for the actor's bound (``ahead`` of round_idx lifts it).
        held = committed(round_idx - 1, stage) and reads_ready(run, stage, round_idx, committed, round_idx, streamed)
        start = time.monotonic()
        bell.wait(run.cfg.run.poll_seconds)
        waited[WAIT_HELD if held else WAIT_INPUT] += time.monotonic() - start
    return {cause: round(seconds, 3) for cause, seconds in waited.items()}


def start_workers(url: str, run, stage: str, stay: Stay, gpus: int, devices: DeviceSets, order: RoundOrder, cpus: tuple[int, ...]) -> StageGroup:
    """The processes of ``stage`` that stay for every round, on its device set, pinned to ``cpus``."""
    return StageGroup(ordered_processes(url, run, stage, stay, gpus, devices, order, cpus), stage, stay.rounds - 1, label=f"the {stage} worker")


def killed(group: StageGroup) -> bool:
    """Whether a process of the exited ``group`` was killed by a signal (it did not fail on its own)."""
    return any(proc.returncode in (-signal.SIGKILL, -signal.SIGTERM, -signal.SIGSEGV) for _, proc in group.running)


def run_with_workers(url: str, rounds: int, gpus: int, order: RoundOrder, learner_gpus: int = 0, log=info) -> None:
    """Run rounds 0..rounds-1 in ``order`` with one set of workers per stage for the whole run. The
    first worker that fails stops every other and the loop; one that was killed is started again (at
    most :data:`RESTARTS` times a stage) and resumes from the run folder."""
    run = open_run(url)
    stages, stay = stage_names(), Stay(rounds, order.rollout_ahead)
    devices, cpus = DeviceSets.of(gpus, learner_gpus), stage_cpus()
    committed, bell, started = CommittedStages(run), CommitBell(run.fs), time.time()
    log(f"rounds 0-{rounds - 1}: {', '.join(stages)}, each in workers that stay for the whole run"
        f"{f' (logs: {Path(worker_log_dir(url))}/)' if gpus else ''} ...")
    groups = {stage: start_workers(url, run, stage, stay, gpus, devices, order, cpus.get(stage, ())) for stage in stages}
    restarts = {stage: 0 for stage in stages}
    shown: set[tuple[int, str]] = set()
    try:
        with worker_log(url, "run"), progress.task("rounds", total=rounds * len(stages), unit="stages", draw=False) as bar:
            while groups:
                for r in range(rounds):
                    for stage in stages:
                        if (r, stage) not in shown and committed(r, stage):
                            shown.add((r, stage))
                            log(f"round {r}: {stage} committed at {time.time() - started:.1f}s")
                            bar.advance(1)
                for stage, group in list(groups.items()):
                    if not group.exited():
                        continue
                    if killed(group) and restarts[stage] < RESTARTS and not all(committed(r, stage) for r in range(rounds)):
                        restarts[stage] += 1
                        log(f"the {stage} worker was killed; starting it again ({restarts[stage]} of {RESTARTS})")
                        groups[stage] = start_workers(url, run, stage, stay, gpus, devices, order, cpus.get(stage, ()))
                        continue
                    group.raise_if_failed()
                    if not all(committed(r, stage) for r in range(rounds)):
                        raise GndpoError(f"the {stage} worker exited before every round's {stage} was committed; rerun to resume")
                    del groups[stage]
                bell.wait(POLL_S)
    finally:
        bell.close()
        for group in groups.values():
            group.terminate()
    log(f"rounds 0-{rounds - 1} committed in {time.time() - started:.1f}s")
