"""``rollout.backend: vllm`` (the default): the student on a vLLM engine, kept between rounds by
:class:`~gndpo.stages.models.live.LiveModels` where it can be (reloading each round's weights), a LoRA
student's adapters served on its base where vLLM serves them."""

from __future__ import annotations

from typing import Callable

from gndpo.pipeline.run.run import Run
from gndpo.pipeline.settings.schema import EngineConfig
from gndpo.stages.models.device import DTYPES
from gndpo.stages.models.live import LiveModels
from gndpo.stages.models.lora import served_as_adapters
from gndpo.stages.models.sampling import Generation, SamplingRequest
from gndpo.stages.models.vllm_engine import cuda_available, engine_dtype, generate, sampling_params
from gndpo.stages.samplers.base import RolloutBackend, SamplerCapabilities


class VLLMBackend(RolloutBackend):
    """The round's policy on a vLLM engine: the kept one, reloaded with the round's weights, where the
    run keeps engines; a LoRA student's adapters on its base where vLLM serves them (CUDA)."""

    capabilities = SamplerCapabilities(tools=True, images=True, lora_adapters=True, engine=True)

    @classmethod
    def open(cls, run: Run, version: int, live: LiveModels, tok) -> "VLLMSampler":
        cfg, policy = run.cfg, run.policy_path(version)
        if served_as_adapters(cfg.model.lora, cuda_available()) and not run.images_per_prompt():  # a VLM's engine loads the merged weights
            llm = live.adapter_engine(policy, cfg.engine, cfg.rollout.seed, run.policy_path(0), cfg.model.lora.rank)
        else:
            exported = run.policy_dir(version)
            llm = live.student_engine(policy, cfg.engine, seed=cfg.rollout.seed, images=run.images_per_prompt(),
                                      exported=exported and run.fs.uri(exported))
        return VLLMSampler(llm, cfg.engine)


class VLLMSampler:
    """A vLLM engine (``llm``, started with ``engine``'s settings) as a sampler: each request becomes its
    ``SamplingParams``."""

    def __init__(self, llm, engine: EngineConfig):
        self.llm, self.dtype_bits = llm, DTYPES[engine_dtype(engine)].itemsize * 8

    def generate(self, prompt_token_ids: list[list[int]], requests: list[SamplingRequest],
                 on_finished: Callable[[int], None] | None = None, images: list[list] | None = None) -> list[Generation]:
        return generate(self.llm, prompt_token_ids, [self.params(r) for r in requests], on_finished, images)

    def params(self, request: SamplingRequest):
        """The ``SamplingParams`` of ``request``."""
        return sampling_params(request)
