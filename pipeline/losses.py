"""Policy losses with token-level advantages, and their aggregation over a whole optimizer step.

All functions work on padded ``[B, T]`` tensors with a 0/1 ``mask``. Aggregation divides by the GLOBAL
number of sequences or tokens of the optimizer step (passed in), never by a micro-batch's own count, so
gradient accumulation and data parallelism do not change the objective (shared/ALGORITHMS.md, last part).
"""

from __future__ import annotations

import math

import torch

POLICY_LOSSES = ("gspo", "ppo", "reinforce", "is")
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
    """Per-token loss L_t and a 0/1 tensor marking tokens where the clipped branch was taken.

    gspo / ppo: clipped surrogate with the GSPO-token or the per-token ratio; reinforce: -A log pi;
    is: -A exp(logp - old_logp), an unclipped importance ratio (Tinker, against the sampler).
    """
    if kind == "reinforce":
        return -adv * logp, torch.zeros_like(logp)
    if kind == "is":
        return -adv * torch.exp(logp - old_logp), torch.zeros_like(logp)
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


def topk_divergence(kind: str, student_topk_logp: torch.Tensor, teacher_topk_logp: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Per-token divergence on the teacher's top-k ids (section 3, offline form), [..., k] -> [...].

    ``student_topk_logp`` are the student's FULL-softmax log-probs at the teacher's top-k ids,
    ``teacher_topk_logp`` the teacher's. p~_T is the teacher renormalized over its top-k.

    forward_kl: sum_k p~_T (log p~_T - slp)                       (as specified)
    reverse_kl: sum_k p~_S (log p~_S - log p~_T)                  (p~_S: student renormalized on top-k)
    jsd:        beta KL(p~_T || m) + (1 - beta) KL(p~_S || m),   m = beta p~_T + (1 - beta) p~_S
    The renormalized student in reverse_kl / jsd keeps them divergences on the top-k support [interp].
    """
    log_pt = teacher_topk_logp - torch.logsumexp(teacher_topk_logp, dim=-1, keepdim=True)
    pt = log_pt.exp()
    if kind == "forward_kl":
        return (pt * (log_pt - student_topk_logp)).sum(-1)
    log_ps = student_topk_logp - torch.logsumexp(student_topk_logp, dim=-1, keepdim=True)
    ps = log_ps.exp()
    if kind == "reverse_kl":
        return (ps * (log_ps - log_pt)).sum(-1)
    if kind == "jsd":
        log_m = torch.logsumexp(torch.stack([log_pt + math.log(beta), log_ps + math.log(1.0 - beta)]), dim=0)
        return beta * (pt * (log_pt - log_m)).sum(-1) + (1.0 - beta) * (ps * (log_ps - log_m)).sum(-1)
    raise ValueError(f"unknown divergence {kind!r}")


def combined_token_losses(
    policy_loss: str,
    divergence: str | None,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    pg_mask: torch.Tensor,
    div_weight: torch.Tensor,
    student_topk_logp: torch.Tensor | None = None,
    teacher_topk_logp: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    jsd_beta: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A method's per-token loss: L_t = pg_mask_t L_pg_t + div_t D_t (policy_loss "none": no PG term,
    divergence None: no D term), and the 0/1 clipped-branch marker of the PG term."""
    losses = torch.zeros_like(logp)
    clipped = torch.zeros_like(logp)
    if policy_loss != "none":
        pg, clipped = token_losses(policy_loss, logp, old_logp, adv, pg_mask, clip_low, clip_high)
        losses = losses + pg * pg_mask
    if divergence is not None:
        losses = losses + div_weight * topk_divergence(divergence, student_topk_logp, teacher_topk_logp, jsd_beta)
    return losses, clipped * pg_mask
