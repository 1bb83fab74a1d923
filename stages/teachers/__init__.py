"""The teacher: one interface (:mod:`.base`), its backends by ``score.backend`` (:mod:`.registry`).

* :mod:`.hf` (``hf``): Hugging Face modules beside the student's forward; every column a method needs.
* :mod:`.vllm` (``vllm``): the teacher's vLLM engine; sampled-token and top-k log-probs.
* :mod:`.served` (``server``): pools of OpenAI-compatible servers, held to the teacher the run expects.
* :mod:`.other_tokenizer` (``score.cross_tokenizer``): a teacher of another tokenizer over any backend.
"""
