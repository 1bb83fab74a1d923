"""Loading models for GPUs. model.attn_implementation flash_attention_2 where flash-attn cannot run (not
installed, which the gpu extra does not do, or no CUDA GPU): stages load the model with sdpa and say so
in one warning, and init warns on the machine it runs on, instead of a run configured for GPU nodes
failing where it lands. And a model for a GPU is read onto it, not built in host memory first."""

from __future__ import annotations

import logging

import torch

from gndpo.pipeline.settings.schema import ModelConfig
from gndpo.stages.models import device
from gndpo.stages.models.loading import load_causal_lm
from tests.conftest import invoke_ok


def test_flash_attention_falls_back_to_sdpa_with_one_warning(tiny_assets, caplog, monkeypatch):
    monkeypatch.setattr(device, "flash_attn_installed", lambda: False)
    device._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="gndpo"):
        assert device.attn_implementation("flash_attention_2") == "sdpa"
        model = load_causal_lm(str(tiny_assets / "student"), ModelConfig(attn_implementation="flash_attention_2"), torch.device("cpu"))
    assert model.config._attn_implementation == "sdpa"
    warnings = [r.getMessage() for r in caplog.records if "flash_attention_2" in r.getMessage()]
    assert warnings == ["model.attn_implementation flash_attention_2: the flash-attn package is not installed (pip install flash-attn); using sdpa"]
    assert device.attn_implementation("sdpa") == "sdpa" and device.attn_implementation("eager") == "eager"


def test_without_a_gpu_flash_attention_is_sdpa_too(monkeypatch):
    monkeypatch.setattr(device, "flash_attn_installed", lambda: True)  # installed, but this process is on the CPU
    monkeypatch.setattr(device, "local_device", lambda: torch.device("cpu"))
    assert device.flash_attention_blocker() == "this machine has no CUDA GPU"
    assert device.attn_implementation("flash_attention_2") == "sdpa"


def test_init_warns_where_flash_attention_cannot_run(tmp_path, tiny_config, caplog, monkeypatch):
    monkeypatch.setattr(device, "flash_attn_installed", lambda: False)
    with caplog.at_level(logging.WARNING, logger="gndpo"):
        invoke_ok("init", tmp_path / "run", "--config", tiny_config, "model.attn_implementation=flash_attention_2")
    assert any("falls back to sdpa" in r.getMessage() for r in caplog.records)


def test_a_gpu_model_is_read_onto_the_gpu_not_built_in_host_memory(tiny_assets, monkeypatch):
    """On a CUDA device the weights go straight there (transformers' device_map): 8 score workers of a
    node each built an 8B teacher in host memory first (about 150 GB). Checked with a stand-in loader:
    this machine has no GPU."""
    from transformers import AutoModelForCausalLM

    from gndpo.stages.models import loading

    calls = []

    class Loaded:
        def to(self, where):
            raise AssertionError("a model read onto the GPU is not moved again")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda path, **kwargs: calls.append(kwargs) or Loaded())
    loading.load_causal_lm(str(tiny_assets / "student"), ModelConfig(), torch.device("cuda", 3), torch.bfloat16)
    assert calls[0]["device_map"] == {"": torch.device("cuda", 3)}
    calls.clear()
    loading.load_causal_lm(str(tiny_assets / "student"), ModelConfig(), torch.device("cuda", 3), torch.bfloat16, place=False)
    assert "device_map" not in calls[0]  # train's model: DeepSpeed places (or ZeRO-3 partitions) it
