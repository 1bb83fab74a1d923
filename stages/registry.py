"""The stage registry: every stage of a round, in the order a round runs them, by name.

Adding a stage is a module with its :class:`~gndpo.pipeline.exec.stage.StageJob` class (what it makes,
reads and how it launches) and one line here (docs/how-to/extending.md). The round loop, the scheduler
and the stage commands take their stages from :data:`STAGE_REGISTRY`; nothing else names a stage.

A stage's module is imported when the stage is looked up, not before: normalize needs neither torch nor
vLLM, and a process that runs one stage should not pay for the others' libraries.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from gndpo.errors import GndpoError
from gndpo.pipeline.exec.stage import StageJob


@dataclass(frozen=True)
class JobRef:
    """Where a stage's job class is (its module and class name, imported on first use), and the line
    its command's help shows."""

    module: str
    name: str
    help: str

    def load(self) -> type[StageJob]:
        return getattr(importlib.import_module(self.module), self.name)


STAGE_REGISTRY: dict[str, JobRef] = {
    "rollout": JobRef("gndpo.stages.rollout", "RolloutJob", "The round's student samples responses (vLLM, or rollout.backend)."),
    "score": JobRef("gndpo.stages.score", "ScoreJob", "Teacher and recomputed student log-probs of every sampled token."),
    "normalize": JobRef("gndpo.stages.normalize", "NormalizeJob", "DuckDB statistics of the round over the committed score shards."),
    "train": JobRef("gndpo.stages.train", "TrainJob", "DeepSpeed update of the student; exports the next round's student."),
}


def stage_names() -> list[str]:
    """The registered stages, in the order a round runs them."""
    return list(STAGE_REGISTRY)


def job_class(stage: str) -> type[StageJob]:
    """The job class of ``stage``; a GndpoError naming the stages otherwise."""
    ref = STAGE_REGISTRY.get(stage)
    if ref is None:
        raise GndpoError(f"unknown stage {stage!r}; choose one of: {', '.join(STAGE_REGISTRY)}")
    return ref.load()
