"""Model loading and the one forward pass that score and train share.

The student log-probs stored by score ("old log-probs") and the ones train differentiates come from the
same function on the same module, so at the first optimizer step of a round the importance ratio is 1
up to float error, as in verl's recompute of old log-probs.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gndpo.errors import GndpoError


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not Path(path).exists():
        raise GndpoError(f"model path does not exist: {path}")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as exc:
        raise GndpoError(f"cannot load a tokenizer from {path}: {str(exc).splitlines()[0]}") from None


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    if not Path(path).exists():
        raise GndpoError(f"model path does not exist: {path}")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False)
    except Exception as exc:
        raise GndpoError(f"cannot load a model from {path}: {str(exc).splitlines()[0]}") from None
    return model


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


def pad_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """Right-padded prompt+response ids, attention mask, and each response's start and length."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, : len(s)] = 1
    starts = torch.tensor([len(p) for p in prompts])
    lengths = torch.tensor([len(r) for r in responses])
    return ids, attn, starts, lengths


def response_distributions(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int, temperature: float = 1.0):
    """Full-vocabulary log-probs at every response position, as a right-padded [B, Tr, V] tensor.

    log_softmax(logits / temperature); the logits of position j predict token j+1. Callers pass one
    chunk (score) or micro-batch (train) at a time, so only that chunk's [B, T, V] logits exist.
    Returns (logp_all [B, Tr, V], sampled-token log-probs [B, Tr], mask [B, Tr]).
    """
    ids, attn, starts, lengths = pad_batch(prompts, responses, pad_id)
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    width = int(lengths.max()) if len(responses) else 0
    # Position of the logit that predicts response token t: start + t - 1.
    offs = torch.arange(width).unsqueeze(0)
    pos = (starts.unsqueeze(1) + offs - 1).clamp(max=ids.shape[1] - 2)
    mask = (offs < lengths.unsqueeze(1)).float()
    target = torch.gather(ids, 1, (pos + 1).clamp(max=ids.shape[1] - 1))
    picked = torch.gather(logits, 1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    logp_all = torch.log_softmax(picked, dim=-1)
    logp = torch.gather(logp_all, 2, target.unsqueeze(-1)).squeeze(-1) * mask
    return logp_all, logp, mask


def response_logprobs(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int, temperature: float = 1.0):
    """Sampled-token log-probs of each response under ``model`` ([B, Tr]) and the response mask."""
    _, logp, mask = response_distributions(model, prompts, responses, pad_id, temperature)
    return logp, mask


def entropy(logp_all: torch.Tensor) -> torch.Tensor:
    """H(p) in nats over the last axis."""
    return -(logp_all.exp() * logp_all).sum(-1)


def set_cpu_threads() -> None:
    """Use the cores we were given; torch's default may oversubscribe a small machine."""
    n = int(os.environ.get("GNDPO_THREADS", "0")) or (os.cpu_count() or 1)
    torch.set_num_threads(n)
