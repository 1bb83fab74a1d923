"""Loading tokenizers and models onto this process's device, and the same-tokenizer check.

Models are loaded in ``model.dtype`` on the device :mod:`gndpo.stages.models.device` picks; the per-token
log-prob computation that score and train share lives in :mod:`gndpo.stages.models.logprobs`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gndpo.errors import GndpoError
from gndpo.stages.models.device import attn_implementation, local_device, resolve_dtype
from gndpo.pipeline.config.schema import ModelConfig


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not Path(path).exists():
        raise GndpoError(f"model path does not exist: {path}")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as exc:
        raise GndpoError(f"cannot load a tokenizer from {path}: {str(exc).splitlines()[0]}") from None


def load_causal_lm(path: str, model_cfg=None, device: torch.device | None = None, dtype: torch.dtype | None = None,
                   place: bool = True):
    """A causal LM from ``path`` in ``model.dtype`` with ``model.attn_implementation``, moved to
    ``device`` (default: this process's). ``place=False`` leaves it where it was built: train hands the
    model to DeepSpeed, which places it, or under ZeRO-3 has already partitioned it onto the devices."""
    from transformers import AutoModelForCausalLM

    model_cfg = model_cfg or ModelConfig()
    device = device or local_device()
    dtype = dtype or resolve_dtype(model_cfg.dtype, device)
    if not Path(path).exists():
        raise GndpoError(f"model path does not exist: {path}")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation(model_cfg.attn_implementation), trust_remote_code=False
        )
    except Exception as exc:
        raise GndpoError(f"cannot load a model from {path}: {str(exc).splitlines()[0]}") from None
    return model.to(device) if place else model


def model_vocab_size(path: str) -> int | None:
    import json

    cfg = Path(path) / "config.json"
    if not cfg.exists():
        return None
    data = json.loads(cfg.read_text())
    return data.get("vocab_size") or data.get("text_config", {}).get("vocab_size")


def check_same_tokenizer(student: str, teacher: str) -> None:
    """Refuse a teacher whose token-to-id map, size or model vocabulary differs from the student's."""
    s_tok, t_tok = load_tokenizer(student), load_tokenizer(teacher)
    if s_tok.get_vocab() != t_tok.get_vocab() or len(s_tok) != len(t_tok):
        raise GndpoError(
            f"teacher tokenizer differs from the student's ({len(t_tok)} vs {len(s_tok)} tokens, "
            f"different token-to-id map): {teacher} vs {student}"
        )
    s_vocab, t_vocab = model_vocab_size(student), model_vocab_size(teacher)
    if s_vocab != t_vocab:
        raise GndpoError(f"teacher vocab_size {t_vocab} differs from the student's {s_vocab}")
