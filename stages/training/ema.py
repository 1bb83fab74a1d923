"""The exponential moving average of the student: the ``self_teacher.weights: ema`` teacher.

OPSD's EMA teacher follows the student slowly: after every optimizer step

    theta_ema <- d * theta_ema + (1 - d) * theta,        d = self_teacher.ema_decay (0.999)

starting from the initial student. Train keeps the average in fp32 beside the model (ZeRO 0-2 hold
every parameter on every rank, so each rank updates its own copy identically), saves it with in-round
checkpoints so a resumed update continues the same average, and exports it each round as a Hugging
Face folder (``ema/`` beside ``model/``), which the next round's score loads as the teacher.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load, load_file, save


class EmaWeights:
    """fp32 averages of a module's parameters, by parameter name."""

    def __init__(self, tensors: dict[str, torch.Tensor], decay: float):
        self.tensors, self.decay = tensors, decay

    @classmethod
    def start(cls, module, folder: str, decay: float) -> "EmaWeights":
        """The average as exported in ``folder`` (a Hugging Face model folder: the previous round's
        ``ema/``, or the initial student), on ``module``'s device, named like its parameters."""
        stored = {}
        for file in sorted(Path(folder).glob("*.safetensors")):
            stored.update(load_file(str(file)))
        tensors = {}
        for name, param in module.named_parameters():
            if name not in stored:
                raise KeyError(f"{folder} has no weight {name} for the EMA teacher")
            tensors[name] = stored[name].to(device=param.device, dtype=torch.float32)
        return cls(tensors, decay)

    @torch.no_grad()
    def update(self, module) -> None:
        """One step: theta_ema <- d theta_ema + (1 - d) theta."""
        for name, param in module.named_parameters():
            self.tensors[name].mul_(self.decay).add_(param.detach().float(), alpha=1.0 - self.decay)

    def to_bytes(self) -> bytes:
        return save({k: v.detach().cpu().contiguous() for k, v in self.tensors.items()})

    def load_bytes(self, data: bytes) -> None:
        """Continue from an average saved by :meth:`to_bytes` (a checkpoint of this round)."""
        for name, value in load(data).items():
            self.tensors[name].copy_(value)

    def export(self, module, folder: str) -> None:
        """``module``'s Hugging Face folder with the averages in place of its weights (in the module's
        dtypes); tied weights follow the parameter they share storage with."""
        by_storage = {param.data_ptr(): name for name, param in module.named_parameters()}
        state = {}
        for key, value in module.state_dict().items():
            name = by_storage.get(value.data_ptr())
            state[key] = (self.tensors[name].to(value.dtype) if name else value).detach().cpu().contiguous()
        module.save_pretrained(folder, state_dict=state, safe_serialization=True)
