"""`gndpo run` on one GPU: the kept DeepSpeed engine and the allocator's cached blocks are released before
a vLLM engine starts or wakes up (vLLM takes engine.gpu_memory_utilization of the device and refuses to
start or wake where less is free: at 1B on an H200 the kept trainer and the cache left 111.96 GiB free of
the 118.83 asked, bench/results/gpu_check.md). The order of operations is checked here with stand-ins
for vLLM and CUDA; the memory itself only on a GPU (bench/gpu_check.py's handover check)."""

from __future__ import annotations

import torch

from gndpo.pipeline.settings.schema import EngineConfig
from gndpo.stages.models import live as live_module
from gndpo.stages.models.live import LiveModels


class FakeEngine:
    """What LiveModels calls on a vLLM engine, recording each call with whether a trainer is kept."""

    def __init__(self, events: list, live: LiveModels):
        self.events, self.live = events, live
        events.append(("engine started", live._trainer is not None))

    def wake_up(self):
        self.events.append(("engine woken", self.live._trainer is not None))

    def sleep(self, level: int):
        self.events.append(("engine asleep", self.live._trainer is not None))


def test_the_trainer_and_the_cache_go_before_vllm_starts_or_wakes_on_a_gpu(monkeypatch):
    events: list = []
    live = LiveModels(keep=True, log=lambda *_: None)
    monkeypatch.setattr(live_module, "cuda_available", lambda: True)
    monkeypatch.setattr(live_module, "make_llm", lambda *args, **kwargs: FakeEngine(events, live))
    monkeypatch.setattr(live_module, "engine_processes", lambda llm: frozenset())
    monkeypatch.setattr(live_module, "engine_alive", lambda llm, processes: True)
    monkeypatch.setattr(live_module, "in_process_engine", lambda llm: False)
    monkeypatch.setattr(live_module, "probe_gap", lambda llm, policy: None)
    monkeypatch.setattr(live_module, "_architecture", lambda path: "arch")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append(("cache emptied", live._trainer is not None)))

    def train_round():  # what train leaves behind in a kept run: its engine, for the next round
        live.release_engine()
        live.trained(object(), SimpleConfig, 1, "rounds/r/train/model")

    cfg = EngineConfig()
    live.student_engine("/policy", cfg, seed=0)  # round 0's rollout
    train_round()
    live.student_engine("/policy", cfg, seed=0)  # round 1's rollout wakes the kept engine
    live.teacher_engine("/teacher", cfg)  # score's engine (score.backend vllm) after a train
    train_round()
    live.teacher_engine("/teacher", cfg)
    # Every start and wake-up found no trainer kept, right after the cache was emptied.
    starts = [i for i, (name, _) in enumerate(events) if name in ("engine started", "engine woken")]
    assert len(starts) == 4 and all(not events[i][1] and events[i - 1][0] == "cache emptied" for i in starts if i > 0), events
    assert ("engine woken", False) in events


class SimpleConfig:
    """The parts of a run config LiveModels.trained reads."""

    class train:
        zero_stage = 0

    model = "model"
