"""Policy losses with token-level advantages, and their aggregation over a whole optimizer step.

All functions work on padded ``[B, T]`` tensors with a 0/1 ``mask``. Aggregation divides by the GLOBAL
number of sequences or tokens of the optimizer step (passed in), never by a micro-batch's own count, so
gradient accumulation and data parallelism do not change the objective (shared/ALGORITHMS.md, last part).
"""

from __future__ import annotations

import torch

POLICY_LOSSES = ("gspo", "ppo", "reinforce")
AGGREGATIONS = ("seq-mean-token-mean", "token-mean")


def gspo_token_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token importance ratio s_it (section 2).

    Its value is the sequence-level ratio exp(mean_t (logp - old_logp)) (clamped at e^10), while its
    gradient flows through each token's own log-prob: log s = logp - sg(logp) + sg(lsr_i).
    """
    lsr = ((logp - old_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_s = logp - logp.detach() + lsr.detach().unsqueeze(-1)
    return torch.exp(torch.clamp(log_s, max=10.0))


def token_losses(
    kind: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss L_t and a 0/1 tensor marking tokens where the clipped branch was taken."""
    if kind == "reinforce":
        return -adv * logp, torch.zeros_like(logp)
    if kind == "gspo":
        ratio = gspo_token_ratio(logp, old_logp, mask)
    elif kind == "ppo":
        ratio = torch.exp(logp - old_logp)
    else:
        raise ValueError(f"unknown policy loss {kind!r}; choose one of {POLICY_LOSSES}")
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def aggregate(losses: torch.Tensor, mask: torch.Tensor, mode: str, n_seqs: int, n_tokens: int) -> torch.Tensor:
    """This micro-batch's share of the step loss.

    seq-mean-token-mean: sum_i [sum_t L m / sum_t m] / n_seqs  (n_seqs: sequences in the whole step)
    token-mean:          sum_{i,t} L m / n_tokens              (n_tokens: valid tokens in the whole step)
    Summing the shares of all micro-batches (and ranks) gives the loss of the whole step.
    """
    if mode == "seq-mean-token-mean":
        per_seq = (losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / max(n_seqs, 1)
    if mode == "token-mean":
        return (losses * mask).sum() / max(n_tokens, 1)
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {AGGREGATIONS}")
