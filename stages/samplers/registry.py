"""The rollout backends by ``rollout.backend``, and init's check of the run against what its backend can
do (:func:`check_rollout_backend`). Adding a backend is a module of its own and one line in
:data:`ROLLOUT_BACKENDS` (its name is also one of ``rollout.backend``'s choices in the config schema; a
test holds the two equal)."""

from __future__ import annotations

from gndpo.errors import GndpoError
from gndpo.pipeline.settings.schema import Config
from gndpo.stages.samplers.base import RolloutBackend
from gndpo.stages.samplers.hf import HFBackend
from gndpo.stages.samplers.vllm import VLLMBackend

ROLLOUT_BACKENDS: dict[str, type[RolloutBackend]] = {
    "vllm": VLLMBackend,
    "hf": HFBackend,
}


def rollout_backend(cfg: Config) -> type[RolloutBackend]:
    """The backend class ``rollout.backend`` names."""
    return ROLLOUT_BACKENDS[cfg.rollout.backend]


def check_rollout_backend(cfg: Config, with_images: bool) -> None:
    """A GndpoError (one line) where the run asks its rollout backend for what it cannot do
    (``with_images``: the run's prompts show pictures)."""
    backend, can = cfg.rollout.backend, rollout_backend(cfg).capabilities

    def able(what: str) -> str:
        return " or ".join(f"rollout.backend {name}" for name, b in ROLLOUT_BACKENDS.items() if getattr(b.capabilities, what))

    if with_images and not can.images:
        raise GndpoError(f"rollout.backend {backend} samples text prompts only, and this run's prompts show pictures: use {able('images')}")
    if cfg.rollout.tools and not can.tools:
        raise GndpoError(f"rollout.backend {backend} cannot run tool turns (rollout.tools): use {able('tools')}")
    if cfg.model.lora.enabled and not can.lora_adapters:
        raise GndpoError(f"rollout.backend {backend} cannot sample a LoRA student (model.lora): use {able('lora_adapters')}")
