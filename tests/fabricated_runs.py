"""Run folders whose records are written by hand, for tests of what the code decides from a run's
records (where an update resumes, which weights a self-teacher is) without running the stages that
would have written them: no model is read, no engine starts."""

from __future__ import annotations

from pathlib import Path

from gndpo.pipeline.config.load import config_from_dict
from gndpo.pipeline.run.products import POLICY, TrainNumbers
from gndpo.pipeline.run.run import Run
from gndpo.stages.training.checkpoint import UNIT
from gndpo.storage.products import Commit
from gndpo.storage.runfs import RunFS


def fabricated_run(folder: Path, **settings) -> Run:
    """A run at ``folder`` with nothing committed, its config made from ``settings`` (config sections)."""
    return Run(RunFS(str(folder)), config_from_dict(settings))


def committed_train(run: Run, round_idx: int, **numbers) -> None:
    """Round ``round_idx``'s train committed: its one unit carrying ``numbers`` (its
    :class:`~gndpo.pipeline.run.products.TrainNumbers`: ``model_dir``, ``ema_dir``, where its exports
    would be; ``optimizer_state``), its manifest's metrics naming the same folders."""
    update = TrainNumbers.of(numbers)
    commit = Commit(UNIT, 1, [], 0, 0, 0.0, update)
    metrics = {"model_dir": update.model_dir, **({"ema_dir": update.ema_dir} if update.ema_dir else {})}
    run.records(round_idx, POLICY).create_manifest({"units": [commit.to_json()], "metrics": metrics})
