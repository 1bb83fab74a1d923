"""What a stage is to the executor and the round loop: the product it makes, what it reads, how it is
launched, and the four steps of a resumable job (plan, setup, run a unit, summarize).

A stage is one class (:class:`StageJob`) and one line in the stage registry
(:mod:`gndpo.stages.registry`). Nothing above this floor decides anything by a stage's name: the round
loop and the scheduler read :attr:`StageJob.launch` (how many processes, on which devices) and
:attr:`StageJob.reads` (when it may start); the executor (:mod:`gndpo.pipeline.exec.units`) runs any
job of this shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gndpo.dist import Dist
from gndpo.pipeline.exec.inputs import Read, StageInputs
from gndpo.pipeline.observe.logs import info
from gndpo.pipeline.run.products import Product
from gndpo.pipeline.run.run import Run
from gndpo.storage.products import Commit, FileRecord, Manifest, Unit, UnitNumbers


@dataclass(frozen=True)
class Launch:
    """How a stage's processes are started on a node (:func:`gndpo.apps.rounds.stage_processes`).

    * ``collective``: one unit that every rank of a torch.distributed group computes together, under
      torchrun with ``train.num_processes`` ranks (train);
    * ``per_gpu``: on a GPU node, one ``--worker`` process per GPU, sharing the units through leases
      (rollout, score); otherwise one process;
    * ``tensor_parallel``: each such worker spans ``engine.tensor_parallel_size`` GPUs (an engine's);
    * ``actor``: it samples the policy (rollout): with ``--learner-gpus`` it runs on the actor's GPUs,
      and it may run ahead of the learner's rounds as far as the round order allows.
    """

    collective: bool = False
    per_gpu: bool = False
    tensor_parallel: bool = False
    actor: bool = False


def collective_ranks(num_processes: int, gpus: int) -> int:
    """The ranks a collective stage runs as on a node of ``gpus`` GPUs: ``num_processes`` (train's
    ``train.num_processes``), or with 0 one a GPU (one where there is none)."""
    return num_processes if num_processes > 0 else max(gpus, 1)


@dataclass(frozen=True)
class StageContext:
    """What a stage is run with besides its run and round: where it logs, the engines and models kept
    across stages (:class:`gndpo.stages.models.live.LiveModels`; None: the stage makes its own),
    whether it streams behind the stage it reads unit by unit (``follow``), its process group, and
    whether its round is the last one its caller runs (``final``: train then writes no optimizer state,
    unless ``train.final_state``)."""

    log: Callable[[str], None] = info
    live: Any = None
    follow: bool = False
    dist: Dist | None = None
    final: bool = False


class StageJob:
    """A stage of a round, as the executor runs it: a plan of work units (written once, the same for any
    number of workers), a setup done only by a worker that gets a unit, the computation of one unit
    into files the executor commits, and the manifest's metrics from all the units' numbers."""

    makes: Product  # what it commits (its name is the product's)
    reads: tuple[Read, ...] = ()  # the committed products it reads (:mod:`gndpo.pipeline.exec.inputs`)
    launch: Launch = Launch()

    def __init__(self, run: Run, round_idx: int, context: StageContext | None = None):
        context = context or StageContext()
        self.run, self.round, self.cfg, self.log, self.context = run, round_idx, run.cfg, context.log, context
        self.inputs = StageInputs(run, round_idx, self.reads, follow=context.follow)

    @classmethod
    def streams(cls) -> bool:
        """Whether it can start while the stage it reads unit by unit still runs (``--follow``)."""
        return any(read.per_unit for read in cls.reads)

    def plan(self) -> tuple[list[Unit], dict]:
        """(units, inputs): the units with stable ids, and what they were planned from."""
        raise NotImplementedError

    def setup(self) -> None:
        """Load models or engines; called once, and only if this worker gets a unit to compute."""

    def run_unit(self, unit: Unit, out_dir: str) -> tuple[list[FileRecord], UnitNumbers]:
        """Compute one unit into files under ``out_dir``; return their records and the unit's numbers."""
        raise NotImplementedError

    def summarize(self, commits: list[Commit]) -> dict:
        """Metrics for the manifest, from all the stage's commits (each unit's numbers: what
        :meth:`run_unit` returned, with the executor's ``seconds``, ``worker`` and ``phases``)."""
        raise NotImplementedError

    def live_state(self) -> dict:
        """What the worker's heartbeats carry while it holds a unit, for `gndpo status` (JSON)."""
        return {}

    def committed(self, manifest: Manifest) -> None:
        """Called in the process that ran the stage once its manifest is committed."""
