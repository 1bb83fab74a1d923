"""Vision-language models of two families, built offline with random weights, and the check that
score's and train's forward (:func:`gndpo.stages.models.logprobs.policy_token_logprobs` on a batch with
image tensors) equals the model's own forward, on whatever device and dtype it is given.

* Idefics3 (SmolVLM): :mod:`gndpo.apps.demos.vision`; a picture is ``pixel_values`` and
  ``pixel_attention_mask``, each ``<image>`` expanded to a fixed 18 tokens;
* Qwen2.5-VL: a picture is a flat list of patches (``pixel_values``) and its grid (``image_grid_thw``),
  expanded to grid/4 ``<|image_pad|>`` tokens, with 3-D rotary positions. vLLM's model file for it
  imports torchvision, which this project's CPU install lacks, so here it runs in transformers only;
  ``bench/gpu_vision.py`` runs the same check on a GPU.
"""

from __future__ import annotations

import string

import numpy as np
import torch

from gndpo.apps.demos.arithmetic import character_tokenizer
from gndpo.apps.demos.vision import VisionModelSpec, image_tokens, new_vision_model, vision_processor, vision_tokenizer
from gndpo.stages.models.batches import TokenBatch, make_batch
from gndpo.stages.models.logprobs import policy_token_logprobs
from gndpo.stages.models.vision import freeze_all_but_language_model, image_inputs

QWEN_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>")


def qwen2_5_vl(seed: int = 0):
    """(model, tokenizer, image processor) of a tiny random Qwen2.5-VL (fp32, on the CPU)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    tok = character_tokenizer(string.printable[:95], 512)
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_TOKENS)})
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config), tok, Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)


def idefics3(seed: int = 0):
    """(model, tokenizer, image processor) of the toy Idefics3 with random weights."""
    spec = VisionModelSpec()
    tok = vision_tokenizer(spec.context)
    return new_vision_model(spec, tok, seed), tok, vision_processor(spec, tok).image_processor


FAMILIES = {"idefics3": idefics3, "qwen2_5_vl": qwen2_5_vl}


def expanded_prompt(family: str, tok, grid: torch.Tensor | None) -> list[int]:
    """A prompt with one picture, its placeholder expanded as the family's processor expands it."""
    if family == "idefics3":
        picture = image_tokens(VisionModelSpec())
    else:
        picture = ["<|vision_start|>"] + ["<|image_pad|>"] * (int(grid.prod()) // 4) + ["<|vision_end|>"]
    return [tok.bos_token_id, *tok.convert_tokens_to_ids(picture), *tok("sum?", add_special_tokens=False)["input_ids"]]


def pictures(n: int) -> list:
    from PIL import Image, ImageDraw

    out = []
    for i in range(n):
        im = Image.new("RGB", (64, 64), "white")
        ImageDraw.Draw(im).rectangle([8 + 3 * i, 60 - 5 * i, 28 + 3 * i, 60], fill=(31 * i % 255, 119, 180))
        out.append(im)
    return out


def check_forward(family: str, device: torch.device, dtype: torch.dtype, rows: int = 3, share_prompts: bool = False) -> dict:
    """Per-token log-probs of random responses after an image prompt, through gndpo's batch path
    (``share_prompts``: the prompts' pass, left-padded, then the responses' on its cache) and through the
    model's own forward (row by row, unpadded, given what its processor gives it: for Qwen2.5-VL the
    token types from which it builds its image-aware M-RoPE positions), and a backward with the vision
    tower frozen. Returns the two (``logprobs``, ``reference``), their largest difference, the tolerance
    of two float32 forwards of the model (tests/conftest.py's model_logprob_tol) and what the backward
    reached."""
    from tests.conftest import model_logprob_tol

    model, tok, processor = FAMILIES[family]()
    model = model.to(device=device, dtype=dtype)
    images = [[im] for im in pictures(rows)]
    grids = processor(images=images, return_tensors="pt").get("image_grid_thw")
    prompts = [expanded_prompt(family, tok, grids[i] if grids is not None else None) for i in range(rows)]
    rng = np.random.default_rng(0)
    responses = [rng.integers(3, 90, size=4 + 2 * i).tolist() for i in range(rows)]  # printable characters only
    batch = make_batch(prompts, responses, tok.pad_token_id, device, share_prompts=share_prompts, image_keys=list(range(rows)))
    batch.images = image_inputs(processor, images, device)
    frozen = freeze_all_but_language_model(model)
    logp = policy_token_logprobs(model, batch, 64, 1.0).sampled
    logp.sum().backward()
    want = []
    with torch.no_grad():
        for i in range(rows):
            ids = torch.tensor([prompts[i] + responses[i]], device=device)
            inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in image_inputs(processor, [images[i]], device).items()}
            if family == "qwen2_5_vl":  # what Qwen2.5-VL's processor returns beside the ids
                inputs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
            full = model(input_ids=ids, **inputs).logits[0].float().log_softmax(-1)
            start = len(prompts[i])
            want.append(full[start - 1 : -1].gather(-1, ids[0, start:, None])[:, 0])
    grads = {name: p.grad is not None and bool(p.grad.abs().sum() > 0) for name, p in model.named_parameters()}
    return {
        "logprobs": logp.detach().float().cpu().numpy(),
        "reference": torch.cat(want).cpu().numpy(),
        "tolerance": model_logprob_tol(model),
        "max_diff": float((logp.detach().float() - torch.cat(want)).abs().max()),
        "frozen_parameters": frozen,
        "language_model_grads": any(v for k, v in grads.items() if "language_model" in k or "text_model" in k),
        "vision_grads": any(v for k, v in grads.items() if "visual" in k or "vision_model" in k or "connector" in k),
    }


# SmolVLM-256M's shapes: a SigLIP-base-sized tower at 512x512 (patch 16, 1,024 patches, pixel shuffle 4:
# 64 image tokens) and a SmolLM2-135M-sized language model with its 49,280-token vocabulary.
SMOLVLM_256M = VisionModelSpec(hidden=576, layers=30, heads=9, intermediate=1536, vision_hidden=768, vision_layers=12, vision_heads=12,
                               image_size=512, patch_size=16, scale_factor=4, context=2048)


def smolvlm_sized(rows: int, response: int, device: torch.device) -> tuple[object, TokenBatch]:
    """A random-weight model of SmolVLM-256M's shapes (fp32, on the CPU, in eval mode) and a batch on
    ``device``: ``rows`` seeded responses of ``response`` printable tokens, each after a 512x512 picture."""
    spec = SMOLVLM_256M
    tok = vision_tokenizer(spec.context)
    model = new_vision_model(spec, tok, 0)
    model.resize_token_embeddings(49280)
    model.eval()
    prompt = [tok.bos_token_id, *tok.convert_tokens_to_ids(image_tokens(spec)), *tok("What is the sum of the bars?", add_special_tokens=False)["input_ids"]]
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 90, (response,), generator=g).tolist() for _ in range(rows)]
    batch = make_batch([prompt] * rows, responses, tok.pad_token_id, device)
    batch.images = image_inputs(vision_processor(spec, tok), [[im.resize((512, 512))] for im in pictures(rows)], device)
    return model, batch
