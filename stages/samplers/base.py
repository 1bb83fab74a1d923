"""The sampler interface: what a rollout backend can do (:class:`SamplerCapabilities`), what rollout and
the held-out evaluation ask of the sampler it opens (:class:`Sampler`), and the backend itself
(:class:`RolloutBackend`): how it opens the round's policy on a rollout worker."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol

from gndpo.pipeline.run.run import Run
from gndpo.stages.models.live import LiveModels
from gndpo.stages.models.sampling import Generation, SamplingRequest


@dataclass(frozen=True)
class SamplerCapabilities:
    """What a backend can do, as init's checks ask it (never its name)."""

    tools: bool  # multi-turn tool use (rollout.tools): turns that stop at a string and continue
    images: bool  # prompts with pictures (a VLM student)
    lora_adapters: bool  # a LoRA student's adapters applied on its base (model.lora)
    engine: bool  # a vLLM engine: kept between rounds where the run keeps engines; takes engine.gpu_memory_utilization of a GPU


class Sampler(Protocol):
    """What rollout asks of a sampler: one response per (prompt, request), in input order."""

    dtype_bits: int  # the precision the sampler computes in (score trusts fp32 samplers' log-probs only)

    def generate(self, prompt_token_ids: list[list[int]], requests: list[SamplingRequest],
                 on_finished: Callable[[int], None] | None = None, images: list[list] | None = None) -> list[Generation]:
        """The response to each prompt, sampled as its request says (its seed alone decides its randomness);
        ``on_finished(count)`` as responses end; ``images[i]``: the pictures of prompt ``i``."""


class RolloutBackend(ABC):
    """One value of ``rollout.backend``: opens the round's sampling policy on a rollout worker."""

    capabilities: ClassVar[SamplerCapabilities]

    @classmethod
    @abstractmethod
    def open(cls, run: Run, version: int, live: LiveModels, tok) -> Sampler:
        """A sampler of policy ``version`` of ``run`` (from ``live``'s kept models where they serve);
        ``tok``: the policy's tokenizer, loaded once by the caller (Gemma's takes seconds)."""
