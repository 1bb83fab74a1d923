"""What a vision-language model needs beside token ids: its processor, the expanded prompt, and the
image tensors of a batch.

A rendered prompt holds one placeholder token per image (``<image>`` for Idefics3/SmolVLM); the
model's processor expands each into the tokens the vision tower's features replace (18 for the toy
VLM, hundreds for real ones), and vLLM does the same expansion when it is given the unexpanded ids with
the images. So rollout sends unexpanded ids and stores the expanded ones vLLM reports, and score and
train need only the image tensors: :func:`image_inputs` runs the image processor alone over a batch's
pictures and returns whatever the family's forward takes (``pixel_values`` and ``pixel_attention_mask``
for Idefics3, ``pixel_values`` and ``image_grid_thw`` for Qwen2-VL) on the model's device.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

import torch

from gndpo.errors import GndpoError
from gndpo.pipeline.run.images import RunImages, image_ids


@lru_cache(maxsize=None)
def load_processor(path: str):
    """The model's processor (tokenizer + image processor); a one-line GndpoError where it has none."""
    from transformers import AutoProcessor

    if not (Path(path) / "preprocessor_config.json").is_file() and not (Path(path) / "processor_config.json").is_file():
        raise GndpoError(f"{path} has no image processor (preprocessor_config.json or processor_config.json): "
                         "save the model's processor with it")
    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=False)
    except Exception as exc:
        raise GndpoError(f"cannot load the processor of {path}: {' '.join(str(exc).split())[:200]}") from exc


def expanded_prompt_ids(processor, text: str, images: list, add_special_tokens: bool = False) -> list[int]:
    """The ids the model reads for a rendered prompt with its images: each placeholder expanded.
    ``add_special_tokens``: as the unexpanded ids were tokenized (a chat template writes its own)."""
    out = processor(text=text, images=images or None, add_special_tokens=add_special_tokens)
    return list(out["input_ids"][0])


def placeholder_count(processor, ids) -> int:
    """How many of ``ids`` are the processor's image placeholder (its ``image_token``)."""
    token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return sum(1 for i in ids if int(i) == token)


def same_image_processing(processor, other) -> bool:
    """Whether two processors turn a picture into the same tensors and the same number of tokens (the
    same settings apart from the chat template)."""
    settings = lambda p: {k: v for k, v in p.to_dict().items() if k != "chat_template"}  # noqa: E731
    return settings(processor) == settings(other)


def image_inputs(processor, images: list[list], device: torch.device) -> dict[str, torch.Tensor]:
    """The forward's image tensors, on ``device``, for a batch whose row ``i`` shows ``images[i]`` (a
    batch without any image gives ``{}``); the forward casts them to the model's dtype
    (:func:`gndpo.stages.models.logprobs.response_hidden`)."""
    if not any(images):
        return {}
    out = getattr(processor, "image_processor", processor)(images=images, return_tensors="pt")  # a processor or its image part
    return {k: v.to(device) for k, v in out.items()}


def mrope_positions(model, ids: torch.Tensor, attention_mask: torch.Tensor, images: dict | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a model that places an image's tokens by their patch grid (M-RoPE: Qwen2-VL, Qwen2.5-VL, ...)
    and a batch with images: (position ids [3, B, L], each row's offset of the text positions after its
    images, [B, 1]), as the model's own ``get_rope_index`` computes them; None otherwise. The model builds
    these itself only from the processor's ``mm_token_type_ids``, which gndpo's rows do not carry, and
    never where positions are given (the shared-prompt passes give them): without them every token would
    get plain 1-D positions, silently."""
    base = model.base_model
    if not images or "image_grid_thw" not in images or not hasattr(base, "get_rope_index"):
        return None
    token_types = (ids == model.config.image_token_id).int()  # 1: an image's token (the rows have no video)
    return base.get_rope_index(ids, token_types, image_grid_thw=images["image_grid_thw"], attention_mask=attention_mask)


class BatchImages:
    """The pictures of a run's prompts by prompt id, and the processor that turns a batch's pictures
    into the forward's tensors (score and train: the rows of a batch name their prompts)."""

    def __init__(self, processor, images: RunImages, prompts: list[dict]):
        self.processor, self.images = processor, images
        self.ids = {p["prompt_id"]: image_ids(p) for p in prompts}

    @classmethod
    def of_run(cls, run, model_path: str) -> BatchImages | None:
        """The image inputs of ``run``'s training prompts, with ``model_path``'s processor; None where
        no training prompt shows a picture."""
        prompts = run.prompts("train")
        if not any(image_ids(p) for p in prompts):
            return None
        return cls(load_processor(model_path), RunImages(run.fs), prompts)

    def read_by(self, processor) -> BatchImages:
        """The same pictures through another model's processor (a teacher's)."""
        other = copy.copy(self)
        other.processor = processor
        return other

    def inputs(self, prompt_ids: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        return image_inputs(self.processor, [[self.images.get(i) for i in self.ids[pid]] for pid in prompt_ids], device)


def freeze_all_but_language_model(model) -> int:
    """``model.freeze_vision``: only the language model (its decoder with the input embeddings, and the
    output layer) keeps ``requires_grad``; the vision tower and connector are frozen. Returns the number
    of frozen parameters."""
    trainable = {id(p) for part in (model.get_decoder(), model.get_output_embeddings()) for p in part.parameters()}
    frozen = [p for p in model.parameters() if id(p) not in trainable]
    for p in frozen:
        p.requires_grad_(False)
    return sum(p.numel() for p in frozen)
