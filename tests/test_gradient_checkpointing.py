"""train.gradient_checkpointing recomputes each decoder layer in backward (it did nothing while the model
stayed in eval mode: transformers checkpoints a layer only in training mode; found on an H200, where
turning it on raised the 1.7B step's peak instead of lowering it, bench/results/gpu_check.md), and the
update is the same bit for bit with and without it. Its default, auto, turns it on where the GPU train
finds is too small for the step without it (stages/models/gpu_memory.py), and leaves it off on CPU."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama import modeling_llama

from gndpo.apps.fork import fork_run
from gndpo.pipeline.run.run import open_run
from gndpo.stages.models.live import LiveModels
from gndpo.stages.training import deepspeed_engine
from tests.conftest import run_stages


@pytest.mark.slow
def test_checkpointing_recomputes_the_layers_and_changes_no_weight(tmp_path, rolled_out, monkeypatch):
    """Both runs read whole sequences (model.shared_prompts false: a checkpointed layer cannot keep a
    shared prompt's keys and values), so they compute the same numbers in the same order. Both leave
    train.gradient_checkpointing at auto: off on this CPU, on where train believes it has a 1 GiB GPU."""
    calls = []
    forward = modeling_llama.LlamaDecoderLayer.forward

    def counted(self, *args, **kwargs):
        if torch.is_grad_enabled():  # train's forwards, and a checkpoint's recomputation inside backward
            calls.append("backward" if torch._C._current_graph_task_id() != -1 else "forward")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", counted)
    counts, weights = {}, {}
    for on in (False, True):
        monkeypatch.setattr(deepspeed_engine, "gpu_memory", lambda on=on: 2**30 if on else None)
        settings = ["model.shared_prompts=false"]
        run = fork_run(str(rolled_out), str(tmp_path / f"checkpointing-{on}"), 0, settings)
        calls.clear()
        live = LiveModels(keep=True)  # as `gndpo run` keeps it: the engine must still checkpoint next round
        try:
            run_stages(run.fs.url, "score", "normalize", "train", live=live)
            layers = [m for m in live._trainer.engine.module.modules() if isinstance(m, GradientCheckpointingLayer)]
            assert layers and all(m.training == on for m in layers), "the export's probe left the layers' modes changed"
            assert not live._trainer.engine.module.training  # no dropout anywhere else
        finally:
            live.close()
        counts[on] = (calls.count("forward"), calls.count("backward"))
        model_dir = open_run(run.fs.url).records(0, "train").require_manifest().metrics["model_dir"]
        weights[on] = load_file(f"{run.fs.url}/{model_dir}/model.safetensors")
    forwards = counts[False][0]
    assert forwards > 0 and counts == {False: (forwards, 0), True: (forwards, forwards)}, counts
    assert weights[True].keys() == weights[False].keys()
    for name, tensor in weights[False].items():
        assert torch.equal(tensor, weights[True][name]), name
