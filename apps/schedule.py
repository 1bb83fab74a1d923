"""When `gndpo run` starts each stage of each round, with every stage in processes of its own.

Three orders, all keeping every stage a resumable job whose rows do not depend on when it ran:

* **sequential**: rollout, score, normalize, train, one at a time;
* **score streamed behind rollout**: score's processes start with rollout's (``--follow``) and score
  each rollout unit once it commits; normalize still waits for every score unit;
* **rollout ahead of train** (``run.max_staleness`` s >= 1): rollout of round k starts once train of
  round k-1-s has committed, so it runs beside round k-1's score, normalize and train, sampling with
  policy k-s (:meth:`gndpo.pipeline.run.run.Run.sampling_version`), the same policy whatever the order.

:func:`choose_order` picks the order from the settings and the devices, and says why;
:func:`run_scheduled` starts each stage as soon as what it reads is committed (:func:`may_start`) and
its previous round has committed, at most one round of a stage at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from gndpo.apps.round_model import AHEAD, SEQUENTIAL, STREAMED, Machine, RoundCosts, fastest, predict, round_costs, times_line
from gndpo.apps.rounds import DeviceSets, StageGroup, StageProcess, Stay, stage_command, stage_cpus, stage_processes, worker_log
from gndpo.dist import usable_cpus
from gndpo.errors import GndpoError
from gndpo.pipeline.observe import progress
from gndpo.pipeline.observe.logs import info
from gndpo.pipeline.run.products import POLICY
from gndpo.pipeline.run.run import Run, open_run
from gndpo.pipeline.settings.schema import Config
from gndpo.stages.registry import job_class, stage_names

POLL_S = 0.5  # seconds between looks at the running stages and the committed manifests


@dataclass(frozen=True)
class RoundOrder:
    """How `gndpo run` overlaps the stages: whether score streams behind rollout, and how many rounds
    rollout may run ahead of train (0, or ``run.max_staleness``); with the reason it was chosen."""

    stream_score: bool
    rollout_ahead: int
    reason: str

    @property
    def sequential(self) -> bool:
        return not self.stream_score and self.rollout_ahead == 0

    def line(self) -> str:
        """The one line init and `gndpo run` print: the order and why."""
        if self.sequential:
            return f"rounds run one stage at a time: {self.reason}"
        parts = ["score streams behind rollout"] if self.stream_score else []
        if self.rollout_ahead:
            parts.append(f"rollout runs up to {self.rollout_ahead} round{'s' if self.rollout_ahead > 1 else ''} ahead of train")
        return f"rounds overlap ({', '.join(parts)}): {self.reason}"


def choose_order(cfg: Config, gpus: int, learner_gpus: int = 0, overlap: str | None = None, costs: RoundCosts | None = None,
                 run: Run | None = None) -> RoundOrder:
    """The order for ``cfg`` on ``gpus`` GPUs (``learner_gpus`` of them for score and train), with
    ``overlap`` (`gndpo run --overlap`) in place of ``run.overlap`` where given.

    ``run.overlap`` off: sequential; on: score streams and rollout runs ``run.max_staleness`` rounds
    ahead, whatever the devices. auto: the order :mod:`gndpo.apps.round_model` predicts fastest on
    these devices for ``costs`` (default: :func:`round_costs`, from what ``run`` measured where given),
    never one it predicts slower than sequential; rollout runs ahead only where it has devices of its own (a learner split) or on the
    CPU, since on a shared GPU the engine and the learner would hold its memory at once. In a
    sequential order every stage uses every GPU (`gndpo run` leaves a learner split unused)."""
    staleness, setting = cfg.run.max_staleness, "--overlap" if overlap else "run.overlap"
    overlap = overlap or cfg.run.overlap
    if overlap == "off":
        return RoundOrder(False, 0, f"{setting} off")
    if overlap == "on":
        return RoundOrder(True, staleness, f"{setting} on")
    machine = machine_of(gpus, learner_gpus)
    costs = costs or round_costs(cfg, run)
    times = predict(costs, machine, staleness)
    allowed = (STREAMED, AHEAD) if staleness and (machine.split or gpus == 0) else (STREAMED,)
    best = fastest(times, allowed)
    split = f" with rollout on {machine.rollout} GPUs and score and train on {learner_gpus} (--learner-gpus)" if machine.split else ""
    device = f"{gpus} GPUs" if gpus > 1 else "one GPU" if gpus == 1 else "the CPU"
    predicted = f"predicted round time on {device}{split} ({costs.source}): {times_line(times, costs)}"
    if best == SEQUENTIAL:
        unused = f"; --learner-gpus {learner_gpus} left unused" if machine.split else ""
        return RoundOrder(False, 0, f"no overlap is predicted faster{unused} ({predicted}; run.overlap on to overlap anyway)")
    return RoundOrder(True, staleness if best == AHEAD else 0, predicted)


def machine_of(gpus: int, learner_gpus: int) -> Machine:
    """The devices the round model sees: the GPUs, split with ``learner_gpus``; without GPUs this
    machine's cores, split where ``GNDPO_STAGE_CPUS`` pins rollout to cores of its own."""
    if gpus:
        return Machine(gpus, gpus - learner_gpus)
    cores, pinned = usable_cpus(), stage_cpus()
    actor = next((set(cpus) for stage, cpus in pinned.items() if job_class(stage).launch.actor), set())
    others = set().union(*(cpus for stage, cpus in pinned.items() if not job_class(stage).launch.actor))
    return Machine(cores, len(actor) if actor and others and not actor & others else cores)


class CommittedStages:
    """``committed(round, stage)``: whether that stage's manifest exists (round -1's always does), read
    from the run folder until seen once: a manifest, once there, stays."""

    def __init__(self, run: Run):
        self.run, self.known = run, set()

    def __call__(self, round_idx: int, stage: str) -> bool:
        if round_idx < 0 or (round_idx, stage) in self.known:
            return True
        if self.run.records(round_idx, stage).manifest() is None:
            return False
        self.known.add((round_idx, stage))
        return True


def may_start(run: Run, order: RoundOrder, round_idx: int, stage: str, started: set[tuple[int, str]],
              committed: CommittedStages | None = None) -> bool:
    """Whether ``stage`` of ``round_idx`` may start now: its previous round has committed, and so has
    everything its class declares it reads (``reads``: a per-unit read, where score streams, once that
    stage has started here or committed); the actor (rollout) also waits for train of round
    k-1-ahead, the order's own bound. ``committed``: the scheduler's record of what has committed
    (default: a new one)."""
    committed = committed or CommittedStages(run)
    streamed = lambda read_stage, r: order.stream_score and (r, read_stage) in started  # noqa: E731
    return committed(round_idx - 1, stage) and reads_ready(run, stage, round_idx, committed, order.rollout_ahead, streamed)


def reads_ready(run: Run, stage: str, round_idx: int, committed: CommittedStages, ahead: int, streamed) -> bool:
    """Whether what ``stage`` of ``round_idx`` reads is there: every read committed, a per-unit read also
    where ``streamed(stage read, round)`` says the reading stage streams behind it; for the actor, train
    of round k-1-``ahead`` committed too."""
    job = job_class(stage)
    if job.launch.actor and not committed(round_idx - 1 - ahead, POLICY.stage):
        return False
    for read in job.reads:
        r, read_stage = read.round_of(run, round_idx), read.product.stage
        if not ((read.per_unit and streamed(read_stage, r)) or committed(r, read_stage)):
            return False
    return True


def ordered_processes(url: str, run: Run, stage: str, rounds: int | Stay, gpus: int, devices: DeviceSets, order: RoundOrder,
                      cpus: tuple[int, ...] = (), final: bool = False) -> list[StageProcess]:
    """The processes of ``stage`` for ``rounds`` (one round, ``final`` if the run's last, or every round
    staying) in ``order``: as its class launches, on its device set, pinned to ``cpus``, following the
    stage it streams behind where the order streams."""
    job = job_class(stage)
    per = run.cfg.engine.tensor_parallel_size if job.launch.tensor_parallel else 1
    return stage_processes(url, stage, rounds, gpus, run.cfg.train.num_processes, gpus_per_worker=per,
                           devices=devices.of_stage(stage) if devices.split else None, follow=job.streams() and order.stream_score,
                           cpus=cpus, final=final)


def stage_group(url: str, run: Run, stage: str, round_idx: int, gpus: int, devices: DeviceSets, order: RoundOrder,
                cpus: tuple[int, ...] = (), log=info, final: bool = False) -> StageGroup:
    """Start the processes of ``stage`` of ``round_idx`` (``final``: the run's last) on its device set,
    pinned to ``cpus``."""
    job = job_class(stage)
    follow = job.streams() and order.stream_score
    procs = ordered_processes(url, run, stage, round_idx, gpus, devices, order, cpus, final)
    workers = [p for p in procs if p.log_path]
    where = f" on {len(workers)} workers (logs: {Path(workers[0].log_path).parent}/)" if workers else ""
    behind = ", ".join(read.product.stage for read in job.reads if read.per_unit)
    log(f"round {round_idx}: {stage}{where}{f' (streaming behind {behind})' if follow else ''} ...")
    return StageGroup(procs, stage, round_idx)


def finishing_group(url: str, group: StageGroup, final: bool = False) -> StageGroup:
    """One more process for a stage whose processes all exited and none committed it (one lost a race,
    or all found the last units leased): it takes over what is left and commits (``final``: the run's
    last round)."""
    first = group.procs[0]
    finish = StageProcess(stage_command(url, group.stage, group.round, final=final), dict(first.env) if first.log_path else {}, None,
                          cpus=first.cpus)
    return StageGroup([finish], group.stage, group.round, started_at=group.started_at, finishing=True)


def run_scheduled(url: str, rounds: int, gpus: int, order: RoundOrder, learner_gpus: int = 0, log=info) -> None:
    """Run rounds 0..rounds-1 in ``order``, each stage as the processes :func:`stage_processes` plans,
    skipping committed stages; the first stage that fails stops every other and the loop."""
    run = open_run(url)
    devices, cpus = DeviceSets.of(gpus, learner_gpus), stage_cpus()  # both refused in one line before anything starts
    stages = stage_names()
    todo = [(r, stage) for r in range(rounds) for stage in stages if run.records(r, stage).manifest() is None]
    started: set[tuple[int, str]] = set()
    running: dict[str, StageGroup] = {}  # stage -> the round of it that runs now
    committed = CommittedStages(run)

    with worker_log(url, "run"), progress.task("rounds", total=rounds * len(stages), unit="stages", draw=False) as bar:
        bar.advance(rounds * len(stages) - len(todo))
        try:
            while todo or running:
                looked: set[str] = set()
                for r, stage in list(todo):
                    if stage in looked:  # each stage's rounds run in order: only its earliest to do may start
                        continue
                    looked.add(stage)
                    if stage not in running and may_start(run, order, r, stage, started, committed):
                        running[stage] = stage_group(url, run, stage, r, gpus, devices, order, cpus.get(stage, ()), log, final=r == rounds - 1)
                        started.add((r, stage))
                        todo.remove((r, stage))
                for stage, group in list(running.items()):
                    if not group.exited():
                        continue
                    group.raise_if_failed()
                    if committed(group.round, stage):
                        log(f"round {group.round}: {stage} committed in {time.time() - group.started_at:.1f}s")
                        bar.advance(1)
                        del running[stage]
                    elif not group.finishing:
                        running[stage] = finishing_group(url, group, final=group.round == rounds - 1)
                    else:
                        raise GndpoError(f"{stage} of round {group.round} finished without committing its manifest; rerun to resume")
                time.sleep(POLL_S)
        finally:
            for group in running.values():
                group.terminate()
