"""The image path of score and train on a GPU, for two vision-language families.

For a tiny random Idefics3 (SmolVLM) and a tiny random Qwen2.5-VL (:mod:`tests.vision_models`),
:func:`tests.vision_models.check_forward` runs gndpo's batched forward with image tensors (the VLM's base
model, the chunked output layer) and compares it with the model's own forward row by row, then a
backward with the vision tower frozen; here on the GPU in fp32 and in bf16. No vLLM is needed, so it
runs on the GPU machines this project is lent (which have none). Writes ``--results``.

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
from tests.vision_models import FAMILIES, check_forward  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_vision.json"


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
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
