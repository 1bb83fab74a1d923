"""Where a retried update starts from an in-round checkpoint (:func:`start_at`): after the checkpoint's
steps, with the steps' history and the EMA average it saved, not the round's first ones. No DeepSpeed:
the engine only records what it is asked to load."""

from __future__ import annotations

import torch

from gndpo.pipeline.run.run import Run
from gndpo.pipeline.settings.schema import Config
from gndpo.stages.training.checkpoint import CHECKPOINT_TAG, EMA_FILE, CheckpointRecord, ResumePoint, Start, start_at
from gndpo.stages.training.ema import EmaWeights
from gndpo.storage.runfs import RunFS


class Engine:
    """A DeepSpeed engine's loading, recorded."""

    def __init__(self, module):
        self.module, self.loaded = module, []

    def load_checkpoint(self, folder, tag, **kwargs):
        self.loaded.append(tag)


def averages(module, value: float | None = None) -> EmaWeights:
    """An EMA of ``module``: its weights (the round's start), or every weight ``value``."""
    tensors = {n: p.detach().float().clone() if value is None else torch.full_like(p, value, dtype=torch.float32)
               for n, p in module.named_parameters()}
    return EmaWeights(tensors, 0.9)


def test_a_retried_update_continues_after_the_checkpoint_with_its_history_and_average(tmp_path):
    run = Run(RunFS(str(tmp_path / "run")), Config())
    module = torch.nn.Linear(3, 2)
    history = [{"loss": 1.0, "grad_norm": 2.0}, {"loss": 0.5, "grad_norm": 1.0}]
    saved = averages(module, 0.25)  # the average after the checkpoint's two steps
    state = CheckpointRecord(step=2, history=history, world=1, files=[], ema=run.fs.write_new(f"ckpt/step-00002/{EMA_FILE}", saved.to_bytes()).to_json())
    engine, ema, lines = Engine(module), averages(module), []
    start = start_at(ResumePoint("checkpoint", state), engine, run, 0, 1, ema, lines.append)
    assert start == Start(history, 2, True)
    assert engine.loaded == [CHECKPOINT_TAG]
    assert all(torch.equal(ema.tensors[name], value) for name, value in saved.tensors.items())
    assert lines == ["train r0: resuming after step 2 from a checkpoint"]
