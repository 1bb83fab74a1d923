"""Run folders whose records are written by hand, for tests of what the code decides from a run's
records (where an update resumes, which weights a self-teacher is) without running the stages that
would have written them: no model is read, no engine starts."""

from __future__ import annotations

from pathlib import Path

from gndpo.pipeline.config.load import config_from_dict
from gndpo.pipeline.run.run import Run
from gndpo.stages.training.checkpoint import UNIT
from gndpo.storage.records import Commit
from gndpo.storage.runfs import RunFS


def fabricated_run(folder: Path, **settings) -> Run:
    """A run at ``folder`` with nothing committed, its config made from ``settings`` (config sections)."""
    return Run(RunFS(str(folder)), config_from_dict(settings))


def committed_train(run: Run, round_idx: int, metrics: dict | None = None, **numbers) -> None:
    """Round ``round_idx``'s train committed: its one unit carrying ``numbers`` (as a train commit's
    own figures), its manifest ``metrics`` (``model_dir``, ``ema_dir``: where its exports would be)."""
    commit = Commit(UNIT, 1, [], 0, 0, 0.0, numbers)
    run.records(round_idx, "train").create_manifest({"units": [commit.to_json()], "metrics": metrics or {}})
