"""When overlapping a round's stages pays: a model of one round's time in each order, from what each
stage costs and how it scales with devices.

A stage's cost (:class:`StageCost`) is its seconds in one round on every device of the machine, one
stage at a time (the default order), with the share of them that divides over devices (Amdahl): on
``d`` of ``D`` devices it takes ``seconds * (1 - parallel + parallel * D / d)``. A stage computed on
devices no other stage uses (a served teacher's) runs beside the others at no cost to them.

The orders, in the steady state (every round after the first):

* **sequential**: the stages one after another, each on every device: the sum of their seconds.
* **score streamed**: rollout, and score behind it, then the learner's stages (normalize, train).
  Stages on the same devices only take turns on them: overlapping them gains nothing unless one
  runs on devices of its own, or the devices are split (``Machine.rollout`` of them for rollout,
  the rest for the learner), each stage then slower on fewer devices.
* **rollout ahead** (``run.max_staleness`` k >= 1): rollout of round r+1 beside the learner's stages of
  round r. A round takes the busiest device set's load, and no less than the chain of one round's
  stages (rollout, its last unit's score, the learner's stages) spread over the k+1 rounds in flight.

So on 2 cores a stage that scales perfectly gains nothing from running beside another; a served
teacher's GPUs idle through rollout and train in sequence, and streaming score behind rollout hides it.

:func:`predict` gives each order's seconds; :func:`paper_costs` the costs from a config alone (before
anything has run: proportional to each stage's FLOPs, no absolute seconds), which init's line and
``run.overlap: auto`` (:func:`gndpo.apps.schedule.choose_order`) use, and :func:`measured_costs` the
seconds a run's own rounds took one stage at a time, which `gndpo run` uses once there are some.
"""

from __future__ import annotations

from dataclasses import dataclass

from gndpo.pipeline.exec.status import stage_table
from gndpo.pipeline.settings.schema import SELF_TEACHER, Config
from gndpo.stages.models.loading import parameter_count
from gndpo.stages.registry import job_class, stage_names
from gndpo.stages.teachers.registry import backend_of

SEQUENTIAL, STREAMED, AHEAD = "sequential", "score streamed", "rollout ahead"

# Seconds per FLOP of each kind of work, relative to a forward over given tokens (prefill), from the
# seeds' minutes on one 8-GPU node (an 8B teacher scoring in 11 min the tokens a 1B student samples in
# 28 and trains on in 8): sampling token by token is memory-bound (~20x a prefill FLOP), a training
# step's backward and optimizer ~2x.
DECODE_COST = (28 / (2 * 1)) / (11 / (2 * 8))
TRAIN_COST = (8 / (6 * 1)) / (11 / (2 * 8))
NORMALIZE_SHARE = 0.005  # normalize: DuckDB over the round's rows, 0.2 of the seeds' 47 minutes


@dataclass(frozen=True)
class StageCost:
    """One stage's cost in a round: ``seconds`` on every device of the machine, one stage at a time;
    ``parallel``: the share of them that divides over devices; ``own_devices``: computed on devices no
    other stage uses (a served teacher's)."""

    seconds: float
    parallel: float = 1.0
    own_devices: bool = False

    def on(self, devices: int, of: int) -> float:
        """Seconds on ``devices`` of the machine's ``of`` (its own devices' time is its own)."""
        if self.own_devices or devices >= of:
            return self.seconds
        return self.seconds * (1 - self.parallel + self.parallel * of / devices)


@dataclass(frozen=True)
class Machine:
    """The devices a round runs on: ``devices`` in all (GPUs, or cores without them), ``rollout`` of them
    rollout's when the stages overlap, the rest the learner's (``rollout == devices``: every stage shares
    every device)."""

    devices: int
    rollout: int

    @property
    def split(self) -> bool:
        return 0 < self.rollout < self.devices


@dataclass(frozen=True)
class RoundCosts:
    """Every stage's cost in one round (by stage name), the round's rollout units (score streams by
    unit) and where the figures come from (``measured``: in seconds, by this run)."""

    stages: dict[str, StageCost]
    units: int
    source: str
    measured: bool = False  # seconds this run measured, not shares on paper


def predict(costs: RoundCosts, machine: Machine, ahead: int = 1) -> dict[str, float]:
    """Seconds per round in the steady state of each order on ``machine``: :data:`SEQUENTIAL`,
    :data:`STREAMED` and, with ``ahead`` >= 1, :data:`AHEAD` (rollout ``ahead`` rounds before train)."""
    D = machine.devices
    rollout_d, learner_d = (machine.rollout, D - machine.rollout) if machine.split else (D, D)
    actor = streamed = own = rest = 0.0
    for stage, cost in costs.stages.items():
        job = job_class(stage)
        if job.launch.actor:
            actor += cost.on(rollout_d, D)
        elif cost.own_devices:
            own += cost.seconds
        elif job.streams():
            streamed += cost.on(learner_d, D)
        else:
            rest += cost.on(learner_d, D)
    shared = 0.0 if machine.split else actor  # rollout's time on the learner's devices when they are the same
    # Score's last unit, after rollout's last (on shared devices the sum of the two already holds it).
    last_unit = (own + (streamed if machine.split else 0.0)) / max(costs.units, 1)
    times = {SEQUENTIAL: sum(cost.seconds for cost in costs.stages.values()),
             STREAMED: max(actor, shared + streamed, own) + last_unit + rest}
    if ahead >= 1:  # one round's chain is the streamed order's round, spread over the rounds in flight
        times[AHEAD] = max(actor, shared + streamed + rest, own, times[STREAMED] / (ahead + 1))
    return times


def paper_costs(cfg: Config) -> RoundCosts:
    """A round's costs from ``cfg`` alone, in units of one forward of the student over the round's
    tokens: each stage's FLOPs times the seconds a FLOP of its kind takes (:data:`DECODE_COST`,
    :data:`TRAIN_COST`), every stage scaling perfectly over devices; a served teacher on devices of its
    own (where score computes nothing itself). A teacher whose weights are not here counts as the
    student's size."""
    student = parameter_count(cfg.student) or 1
    teacher_models = [] if cfg.teacher == SELF_TEACHER else list(cfg.teacher_models().values())
    teachers = sum(parameter_count(path) or student for path in teacher_models) if teacher_models else student
    served = backend_of(cfg).capabilities.served
    recompute = cfg.score.student_logprobs != "engine"
    actor, score, train = DECODE_COST, teachers / student + (1.0 if recompute else 0.0), 3 * TRAIN_COST
    stages = {}
    for stage in stage_names():
        job = job_class(stage)
        if job.launch.actor:
            stages[stage] = StageCost(actor)
        elif job.streams():
            stages[stage] = StageCost(score, own_devices=served and not recompute)
        elif job.launch.collective:
            stages[stage] = StageCost(train)
        else:
            stages[stage] = StageCost(NORMALIZE_SHARE * (actor + score + train))
    return RoundCosts(stages, cfg.rollout.units_per_round, "on paper, from the config's FLOPs")


MARGIN = 0.01  # an order with more in flight is chosen only where predicted this much faster than a simpler one


def round_costs(cfg: Config, run=None) -> RoundCosts:
    """The costs the model runs on: what ``run``'s own rounds measured one stage at a time, where there
    are some (:func:`measured_costs`), else the config's on paper (:func:`paper_costs`)."""
    paper = paper_costs(cfg)
    return (measured_costs(run, paper) if run is not None else None) or paper


def fastest(times: dict[str, float], allowed: tuple[str, ...]) -> str:
    """The order of ``allowed`` (simplest first) with the shortest predicted round, each chosen over a
    simpler one only where :data:`MARGIN` faster: never one predicted slower than :data:`SEQUENTIAL`,
    which is always allowed."""
    best = SEQUENTIAL
    for order in allowed:
        if times[order] < times[best] * (1 - MARGIN):
            best = order
    return best


def times_line(times: dict[str, float], costs: RoundCosts) -> str:
    """Each order's predicted round time for init's and run's line: in seconds where the costs were
    measured, else as a share of the sequential round."""
    if costs.measured:
        return ", ".join(f"{order} {t:.1f} s" for order, t in times.items())
    return ", ".join(f"{order} {t / times[SEQUENTIAL]:.2f}" for order, t in times.items()) + " of the sequential round"


def measured_costs(run, paper: RoundCosts) -> RoundCosts | None:
    """The costs ``run``'s own committed rounds measured, where some ran one stage at a time: each
    stage's mean span (first claim to last commit) over those rounds, leaving round 0 out where a later
    one ran (it starts the engines); how each divides over devices, and which runs on devices of its
    own, as ``paper`` has them. None where no round ran one stage at a time."""
    rows, _ = stage_table(run)
    by_round: dict[int, list[dict]] = {}
    for row in rows:
        by_round.setdefault(row["round"], []).append(row)
    alone = [r for r, stages in sorted(by_round.items())
             if {row["stage"] for row in stages} >= set(paper.stages) and all(row["state"] == "committed" and row["seconds"] is not None
                                                                            and not row["beside"] for row in stages)]
    rounds = [r for r in alone if r > 0] or alone
    if not rounds:
        return None
    seconds = {stage: sum(row["seconds"] for r in rounds for row in by_round[r] if row["stage"] == stage) / len(rounds) for stage in paper.stages}
    stages = {stage: StageCost(seconds[stage], cost.parallel, cost.own_devices) for stage, cost in paper.stages.items()}
    span = f"round {rounds[0]}" if len(rounds) == 1 else f"rounds {rounds[0]}-{rounds[-1]}"
    return RoundCosts(stages, paper.units, f"measured over {span} of this run", measured=True)
