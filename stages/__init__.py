"""The four stages of a round, each a resumable job (:class:`gndpo.pipeline.exec.units.StageJob`):
rollout samples, score adds the teachers' log-probs, normalize computes the round's statistics, train
updates the student. :func:`job_class` is how the layers above reach them by name."""

from __future__ import annotations

from gndpo.errors import GndpoError
from gndpo.storage.records import STAGES


def job_class(stage: str) -> type:
    """The job class of ``stage`` (one of :data:`gndpo.storage.records.STAGES`); a GndpoError naming
    the stages otherwise."""
    # Each stage's module is imported only when that stage runs: normalize needs neither torch nor
    # vLLM, and a process that runs one stage should not pay for the others' libraries.
    if stage == "rollout":
        from gndpo.stages.rollout import RolloutJob as job  # on demand, as said above
    elif stage == "score":
        from gndpo.stages.score import ScoreJob as job  # on demand, as said above
    elif stage == "normalize":
        from gndpo.stages.normalize import NormalizeJob as job  # on demand, as said above
    elif stage == "train":
        from gndpo.stages.train import TrainJob as job  # on demand, as said above
    else:
        raise GndpoError(f"unknown stage {stage!r}; choose one of: {', '.join(STAGES)}")
    return job
