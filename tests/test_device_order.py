"""Train's process group on GPUs: each rank chooses its CUDA device before it joins the group (NCCL ties a
rank's communicator to the current device when the group is made, and run_collective broadcasts at
once). Train's own all-reduces run on that device; NCCL refusing a CPU tensor ("No backend type
associated with device type cpu") shows only on GPUs: bench/gpu_check.py's collectives check covers it,
and the data-parallel tests run the same all-reduces over gloo on CPU."""

from __future__ import annotations

import sys
import types

from gndpo.dist import Dist
from gndpo.stages.training import deepspeed_engine


def test_the_device_is_chosen_before_the_group_is_joined(monkeypatch):
    order = []
    fake = types.ModuleType("deepspeed")
    fake.init_distributed = lambda **kwargs: order.append("join the group")
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    monkeypatch.setattr(deepspeed_engine, "forget_destroyed_world_group", lambda: None)
    monkeypatch.setattr(deepspeed_engine, "local_device", lambda: order.append("choose the device"))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    deepspeed_engine.init_distributed(Dist(rank=1, world=2, local_rank=1, launched=True))
    assert order == ["choose the device", "join the group"]
