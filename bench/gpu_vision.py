"""The image path of score and train on a GPU, for two vision-language families.

For a tiny random Idefics3 (SmolVLM) and a tiny random Qwen2.5-VL (:mod:`tests.vision_models`),
:func:`tests.vision_models.check_forward` runs gndpo's batched forward with image tensors (the VLM's base
model, the chunked output layer) and compares it with the model's own forward row by row, then a
backward with the vision tower frozen; here on the GPU in fp32 and in bf16. On a GPU it also runs
SmolVLM-256M's shapes (random weights, 512x512 pictures, 49,280 logits): peak GPU memory of score's
forward and of a train step above the loaded model. No vLLM is needed, so it runs on the GPU machines
this project is lent (which have none). Writes ``--results``.

    python3 bench/gpu_vision.py --results $OUT/gpu_vision.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.vision_models
from gndpo.pipeline.settings.schema import ModelConfig  # noqa: E402
from gndpo.stages.models.logprobs import logits_chunk, pair_token_stats, policy_token_logprobs  # noqa: E402
from gndpo.stages.models.vision import freeze_all_but_language_model  # noqa: E402
from tests.vision_models import FAMILIES, check_forward, smolvlm_sized  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_vision.json"


def smolvlm_sized_check(device: torch.device, dtype: torch.dtype, rows: int = 4, response: int = 512) -> dict:
    """SmolVLM-256M's shapes with random weights (tests/test_vision.py's memory test, here on the GPU):
    score's forward (no grad) and a train step (frozen tower) over ``rows`` responses after a 512x512
    picture; peak GPU memory above the loaded model for each, and the train step's log-probs against
    the model's own forward."""
    model, batch = smolvlm_sized(rows, response, device)
    model = model.to(device=device, dtype=dtype)
    prompt_length = len(batch.ids[0]) - response  # every row has the same prompt and response length
    chunk = logits_chunk(model, ModelConfig())
    out = {"family": "smolvlm_256m_shapes", "dtype": str(dtype).removeprefix("torch."), "rows": rows, "response_tokens": response,
           "parameters": sum(p.numel() for p in model.parameters())}

    def peak(fn) -> tuple[float | None, float]:
        if device.type != "cuda":  # a dry run of the code path: time only
            t0 = time.time()
            fn()
            return None, time.time() - t0
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.time()
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**30, time.time() - t0

    with torch.no_grad():
        out["score_extra_gib"], out["score_seconds"] = peak(
            lambda: pair_token_stats(model, model, batch, chunk, 1.0, topk=0, entropies=(True, True), kl=False))
    freeze_all_but_language_model(model)
    model.train()
    kept = {}

    def step():
        kept["logp"] = policy_token_logprobs(model, batch, chunk, 1.0).sampled
        kept["logp"].sum().backward()

    out["train_extra_gib"], out["train_seconds"] = peak(step)
    model.eval()
    with torch.no_grad():
        ids = batch.ids[:1]
        one = {k: (v[:1].to(dtype) if v.is_floating_point() else v[:1]) for k, v in batch.images.items()}
        full = model(input_ids=ids, **one).logits[0].float().log_softmax(-1)
        want = full[prompt_length - 1 : -1].gather(-1, ids[0, prompt_length:, None])[:, 0]
    out["max_diff_row0"] = float((kept["logp"][:response].detach().float() - want).abs().max())
    out["vision_grads"] = any(p.grad is not None for p in model.model.vision_model.parameters())
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__, "checks": []}
    for family in FAMILIES:
        for dtype in (torch.float32, torch.bfloat16):
            t0 = time.time()
            check = check_forward(family, device, dtype)
            check.update(family=family, dtype=str(dtype).removeprefix("torch."), seconds=round(time.time() - t0, 2))
            print(json.dumps(check), flush=True)
            result["checks"].append(check)
    if device.type == "cuda":  # realistic shapes: too slow for this check on 2 CPU cores (tests/test_vision.py measures RSS there)
        for dtype in (torch.float32, torch.bfloat16):
            check = smolvlm_sized_check(device, dtype)
            print(json.dumps(check), flush=True)
            result["checks"].append(check)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
