"""The engine probe: does a vLLM engine sample from exactly the weights train exported?

``gndpo run`` keeps the rollout engine alive and loads each round's exported student into it; a
reload that silently keeps part of the old model (vLLM's reload with tied embeddings did, see
:mod:`gndpo.stages.models.vllm_worker`) makes every later rollout off-policy while nothing fails. So train
writes, beside each exported model, the log-probs its own forward gives a fixed probe batch
(``gndpo_probe.json``: a few seeded sequences of token ids), and rollout asks its engine for the same
log-probs (vLLM prompt log-probs) before it samples. The gap between the two is the round's
``engine_probe_gap_max``/``_mean`` metric; a kept engine whose gap exceeds the tolerance of the
engine's precision is replaced by a fresh one, with a warning; where the fresh engine's gap is itself
beyond that tolerance, it becomes the measure for later reloads. Costs one short forward on each side.

A vision-language student's probe adds one sequence that shows a picture (seeded noise, rebuilt from
its seed on both sides), so a reload that kept the old vision tower or connector shows in the gap too:
text-only sequences never run them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from gndpo.stages.models.batches import make_batch
from gndpo.stages.models.loading import placeholder_ids
from gndpo.stages.models.logprobs import policy_token_logprobs
from gndpo.stages.models.vision import expanded_prompt_ids, image_inputs
from gndpo.stages.models.vllm_engine import AdapterEngine, forced_logprobs, response_logprobs

PROBE_FILE = "gndpo_probe.json"
PROBE_SEQUENCES, PROBE_LENGTH = 4, 24
PROBE_PICTURE_PIXELS = 64  # a side of the image probe's picture; every processor resizes it its own way
# Largest mean |engine - exported| log-prob gap accepted, by the engine's precision. A fresh fp32
# engine is within 1e-5 of transformers on SmolLM2; the stale output layer this guards against was
# 1.9e-3 off on average. 16-bit engines round each logit to ~3 significant digits.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}
# Where a fresh engine's own gap is above its dtype's tolerance (a large model in 16 bits), a reload is
# held to this multiple of that gap: the rounding of consecutive rounds' models differs little, while
# weights left stale differ by a whole round's update.
CALIBRATED = 3.0


def probe_token_ids(vocabulary: int, seed: int = 0, avoid: frozenset = frozenset()) -> list[list[int]]:
    """The probe batch: PROBE_SEQUENCES seeded sequences of ids below ``vocabulary`` and not in
    ``avoid`` (a VLM's image placeholder, which a forward without its image refuses), the same for
    every model with that vocabulary, so no data is needed to check an engine."""
    rng = random.Random(f"gndpo-probe:{seed}")
    allowed = [i for i in range(vocabulary) if i not in avoid] if avoid else range(vocabulary)
    return [[rng.choice(allowed) for _ in range(PROBE_LENGTH)] for _ in range(PROBE_SEQUENCES)]



def probe_picture(seed: int = 0):
    """The image probe's picture: seeded RGB noise, the same pixels on every machine."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (PROBE_PICTURE_PIXELS, PROBE_PICTURE_PIXELS, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


@torch.no_grad()
def probe_logprobs(model, vocabulary: int, pad_id: int, processor=None) -> dict:
    """The probe batch and ``model``'s log-probs of each of its tokens after the first (temperature 1);
    with ``processor`` (a vision-language model's), also ``image``: the log-probs of the first
    sequence's tokens after the probe picture. Under ZeRO-3 every rank must call it (the forward
    gathers partitioned weights)."""
    ids = probe_token_ids(vocabulary, avoid=placeholder_ids(model.config.to_dict()))
    device = next(model.parameters()).device
    batch = make_batch([s[:1] for s in ids], [s[1:] for s in ids], pad_id, device)
    logprobs = policy_token_logprobs(model, batch, batch.n_tokens, 1.0).sampled
    probe = {"token_ids": ids, "logprobs": logprobs.float().cpu().view(len(ids), -1).tolist()}
    if processor is not None:
        probe["image"] = image_probe(model, processor, ids[0][1:], pad_id, device)
    return probe


def image_probe(model, processor, response: list[int], pad_id: int, device) -> dict:
    """``response``'s log-probs after the probe picture alone: the engine is given the picture's one
    placeholder (``prompt_ids``) and expands it; the forward here reads the processor's expansion."""
    picture = probe_picture()
    placeholder = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    batch = make_batch([expanded_prompt_ids(processor, processor.image_token, [picture])], [response], pad_id, device)
    batch.images = image_inputs(processor, [[picture]], device)
    logprobs = policy_token_logprobs(model, batch, batch.n_tokens, 1.0).sampled
    return {"prompt_ids": [placeholder], "response": response, "logprobs": logprobs.float().cpu().tolist()}


def write_probe(folder: str | Path, probe: dict) -> None:
    (Path(folder) / PROBE_FILE).write_text(json.dumps(probe))


def probe_gap(llm, folder: str | Path) -> dict | None:
    """{"max", "mean"}: |engine log-prob - the exported model's| over the probe batch recorded in
    ``folder`` (None when the folder has no probe: a run's initial student)."""
    path = Path(folder) / PROBE_FILE
    if not path.is_file():
        return None
    probe = json.loads(path.read_text())
    ids = probe["token_ids"]
    prompts, responses = [s[:1] for s in ids], [s[1:] for s in ids]
    if isinstance(llm, AdapterEngine):
        engine = forced_logprobs(llm, prompts, responses)
    else:
        engine = response_logprobs(llm, prompts, responses, 0)["logprobs"]
    exported = np.asarray(probe["logprobs"], np.float64).reshape(-1)
    if "image" in probe:
        image = probe["image"]
        shown = response_logprobs(llm, [image["prompt_ids"]], [image["response"]], 0, images=[[probe_picture()]])["logprobs"]
        engine, exported = np.concatenate([engine, shown]), np.concatenate([exported, image["logprobs"]])
    gap = np.abs(engine.astype(np.float64) - exported)
    return {"max": float(gap.max()), "mean": float(gap.mean())}
