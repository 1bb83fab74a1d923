"""Rollout's sampler: one interface (:mod:`.base`), its backends by ``rollout.backend`` (:mod:`.registry`).

* :mod:`.vllm` (``vllm``, the default): the student on a vLLM engine, kept between rounds where it can be.
* :mod:`.hf` (``hf``): the student's own Hugging Face module, decoding in batches with its keys and values
  kept between steps; no engine to start, on any device torch runs on.
"""
