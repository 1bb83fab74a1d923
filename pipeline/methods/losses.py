"""Policy losses with token-level advantages, and their aggregation over a whole optimizer step.

All functions work on padded ``[B, T]`` tensors with a 0/1 ``mask``. Aggregation divides by the GLOBAL
number of sequences or tokens of the optimizer step (passed in), never by a micro-batch's own count, so
gradient accumulation and data parallelism do not change the objective (docs/reference/methods.md, Aggregation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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
    is: -A exp(logp - old_logp), an unclipped importance ratio (Tinker, against the sampler). ``kind``
    is one of these (``method.policy_loss``'s choices, checked when the config is read).
    """
    if kind == "reinforce":
        return -adv * logp, torch.zeros_like(logp)
    if kind == "is":
        return -adv * torch.exp(logp - old_logp), torch.zeros_like(logp)
    ratio = gspo_token_ratio(logp, old_logp, mask) if kind == "gspo" else torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def aggregate(losses: torch.Tensor, mask: torch.Tensor, mode: str, n_seqs: int, n_tokens: int, weight_sum: float = 0.0) -> torch.Tensor:
    """This micro-batch's share of the step loss, from ``losses`` already multiplied by each response's
    weight w_i.

    seq-mean-token-mean: sum_i [sum_t L m / sum_t m] / n_seqs  (n_seqs: sequences in the whole step)
    token-mean:          sum_{i,t} L m / n_tokens              (n_tokens: valid tokens in the whole step)
    weighted-seq-mean:   sum_i [sum_t L m / sum_t m] / weight_sum  (weight_sum: sum_i w_i over the whole
                         step), i.e. sum_i w_i L_i / sum_i w_i with L_i response i's token mean
    Summing the shares of all micro-batches (and ranks) gives the loss of the whole step.
    """
    if mode == "token-mean":
        return (losses * mask).sum() / max(n_tokens, 1)
    per_seq = (losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    # A step whose weights are all 0 (e.g. PACED with every pass rate 0 or 1) contributes 0.
    return per_seq.sum() / (max(n_seqs, 1) if mode == "seq-mean-token-mean" else weight_sum or 1.0)


# Smallest "rest" bucket mass: keeps log(rest) finite (and 0 * log 0 out) when the k ids hold all of a
# model's mass, or more than all of it after rounding. A clamped bucket gets no gradient.
REST_MASS_FLOOR = 1e-12
# Log-probs below this are treated as this (exp is exactly 0 either way); keeps -inf inputs from
# turning 0 * (-inf) into NaN in the loss or its gradient.
LOGP_FLOOR = -1e4


# log(1/2): where log(1 - e^L) switches from log1p(-e^L) to log(-expm1(L)) (Maechler's log1mexp).
_LOG_HALF = -math.log(2.0)


def rest_logprob(topk_logp: torch.Tensor) -> torch.Tensor:
    """[..., k] full-softmax log-probs -> [..., 1] log(1 - sum_k p), the log of the mass outside the k
    ids, clamped at log(REST_MASS_FLOOR) (where the clamp bites, no gradient).

    With L = logsumexp(topk_logp): log1p(-exp(L)) while L < log(1/2) (a rest of more than half),
    log(-expm1(L)) above. Each form is accurate, value and gradient, where it is used: the expm1 form
    alone loses the gradient when L is very negative (a student with 1e-8 of its mass on the teacher's
    top-k), because autograd computes expm1's derivative e^L as expm1(L) + 1 = (1e-8 - 1) + 1, all
    rounding in float32; the log1p form alone loses the rest's precision when the rest is small. Both branches see a clamped L,
    so the branch not taken stays finite and contributes an exact zero gradient."""
    lse = torch.logsumexp(topk_logp, dim=-1, keepdim=True)
    large_rest = torch.log1p(-torch.exp(lse.clamp(max=_LOG_HALF)))
    small_rest = torch.log(torch.clamp(-torch.expm1(lse.clamp(min=_LOG_HALF)), min=REST_MASS_FLOOR))
    return torch.where(lse < _LOG_HALF, large_rest, small_rest)


def _with_rest_bucket(topk_logp: torch.Tensor, rest_logp: torch.Tensor | None = None) -> torch.Tensor:
    """[..., k] full-softmax log-probs -> [..., k + 1] log-probs of the k ids plus one "rest" bucket.

    The rest is ``rest_logp`` [...] where given (the teacher's, stored by score from its full softmax:
    exact even where 1 - sum(p) is below float32's rounding of the top-k values), floored at LOGP_FLOOR;
    otherwise :func:`rest_logprob` of the k values, with the rest mass clamped at REST_MASS_FLOOR.
    Recomputed, gradients reach every input through the rest bucket too (d log rest / d lp_i = -p_i / rest)."""
    if rest_logp is None:
        rest = rest_logprob(topk_logp)
    else:
        rest = rest_logp.to(topk_logp.dtype).clamp(min=LOGP_FLOOR).unsqueeze(-1)
    return torch.cat([topk_logp, rest], dim=-1)


def _divergence(kind: str, log_ps: torch.Tensor, log_pt: torch.Tensor, beta: float, clip: float = 0.0) -> torch.Tensor:
    """forward_kl / reverse_kl / jsd between two distributions given as log-probs over the last dim.
    ``clip`` > 0: each entry's contribution is clamped from above at ``clip`` before the sum (OPSD's
    point-wise clipping, ``method.pointwise_clip``); a clamped entry passes no gradient."""
    pt, ps = log_pt.exp(), log_ps.exp()
    if kind == "forward_kl":
        terms = pt * (log_pt - log_ps)
    elif kind == "reverse_kl":
        terms = ps * (log_ps - log_pt)
    elif kind == "jsd":
        log_m = torch.logsumexp(torch.stack([log_pt + math.log(beta), log_ps + math.log(1.0 - beta)]), dim=0)
        terms = beta * pt * (log_pt - log_m) + (1.0 - beta) * ps * (log_ps - log_m)
    else:
        raise ValueError(f"unknown divergence {kind!r}")
    return (terms.clamp(max=clip) if clip > 0 else terms).sum(-1)


def topk_divergence(
    kind: str,
    student_topk_logp: torch.Tensor,
    teacher_topk_logp: torch.Tensor,
    beta: float = 0.5,
    form: str = "bucket",
    teacher_rest_logp: torch.Tensor | None = None,
    clip: float = 0.0,
    covers_vocabulary: bool = False,
) -> torch.Tensor:
    """Per-token divergence on the teacher's top-k ids (section 3, offline form), [..., k] -> [...].
    ``clip`` > 0 clamps each bucket's (each id's) contribution from above before the sum (OPSD's
    point-wise clipping: a few style tokens otherwise dominate a self-distillation loss).

    ``student_topk_logp`` are the student's FULL-softmax log-probs at the teacher's top-k ids,
    ``teacher_topk_logp`` the teacher's full-softmax log-probs at its own top-k ids.

    form "bucket" (default, ``method.topk_form``): each model becomes a (k+1)-bucket distribution, its
    probabilities at the k ids plus one "rest" bucket holding 1 - (its mass on the k ids), and
      forward_kl: KL(b_T || b_S),  reverse_kl: KL(b_S || b_T),
      jsd:        beta KL(b_T || m) + (1 - beta) KL(b_S || m),   m = beta b_T + (1 - beta) b_S
    exactly on those k+1 buckets, with no renormalization. This is the exact divergence between the two
    models' distributions coarsened to {the k ids, everything else}, so it lower-bounds the
    full-vocabulary divergence (data processing) and equals it when the k ids cover the vocabulary. The
    student's mass outside the teacher's top-k is paid for: in reverse KL and JSD it is the rest bucket
    against the teacher's (small) rest, and the gradient through the rest bucket pushes it back onto
    the k ids. That is why it is the default.

    form "renormalized" (the earlier behaviour): p~_T is the teacher renormalized over its top-k,
      forward_kl: sum_k p~_T (log p~_T - slp)                     (slp: the student's unrenormalized log-probs)
      reverse_kl: sum_k p~_S (log p~_S - log p~_T)                (p~_S: student renormalized on top-k)
      jsd:        beta KL(p~_T || m) + (1 - beta) KL(p~_S || m),   m = beta p~_T + (1 - beta) p~_S
    Renormalizing the student keeps reverse_kl / jsd divergences on the top-k support [interp], but the
    student's mass outside the teacher's top-k costs nothing there: a student with most of its mass in
    the tail can score a small reverse KL while the full-vocabulary one is large.

    Numerics (bucket): ``teacher_rest_logp`` [...] is the teacher's log rest mass as score stored it,
    from the full softmax; without it (shards written before score stored it) the teacher's rest is
    recomputed from its top-k like the student's, which is rounding noise once the true rest is below
    ~1e-7 (a confident teacher) and can then push the divergence above the full-vocabulary one. The
    student's rest, log(1 - sum_k p_S), is computed in at least float32 by :func:`rest_logprob` (stable
    value and gradient from a rest of 1e-12 to a top-k mass of 1e-8 and below) and clamped at
    REST_MASS_FLOOR, so an empty rest bucket (k = vocabulary, or rounding past 1) contributes ~0 and
    finite (zero) gradients rather than 0 * log 0 = NaN.

    ``covers_vocabulary``: the k ids are the whole vocabulary, so both rest buckets are empty and are
    left out; the bucket divergence is then the full-vocabulary one exactly. (Kept in, a floored student
    rest of 1e-12 against the teacher's stored empty rest, LOGP_FLOOR, adds 1e-12 x (1e4 - 27.6) = 1e-8
    per token to the reverse KL.)
    """
    if form == "renormalized":
        log_pt = teacher_topk_logp - torch.logsumexp(teacher_topk_logp, dim=-1, keepdim=True)
        if kind == "forward_kl":
            terms = log_pt.exp() * (log_pt - student_topk_logp)
            return (terms.clamp(max=clip) if clip > 0 else terms).sum(-1)
        log_ps = student_topk_logp - torch.logsumexp(student_topk_logp, dim=-1, keepdim=True)
        return _divergence(kind, log_ps, log_pt, beta, clip)
    dtype = torch.promote_types(torch.promote_types(student_topk_logp.dtype, teacher_topk_logp.dtype), torch.float32)
    log_ps = student_topk_logp.to(dtype).clamp(min=LOGP_FLOOR)
    log_pt = teacher_topk_logp.to(dtype).clamp(min=LOGP_FLOOR)
    if not covers_vocabulary:
        log_ps, log_pt = _with_rest_bucket(log_ps), _with_rest_bucket(log_pt, teacher_rest_logp)
    return _divergence(kind, log_ps, log_pt, beta, clip)


# Teacher top-k ids of another vocabulary, as score stores them (score.cross_tokenizer): an entry is
# the student id of the same text (>= 0), a teacher token with no student twin, or no entry at all
# (a position with no teacher distribution after the same text, or padding).
UNMATCHED_ID = -1
NO_ENTRY_ID = -2


@dataclass(frozen=True)
class OtherVocabulary:
    """What the divergence needs when the teacher's top-k comes from another vocabulary: ``ids`` [..., k]
    as score stored them (student ids, UNMATCHED_ID, NO_ENTRY_ID), the student's own largest log-probs
    over its unmatched tokens (those with no teacher twin) [..., k], sorted descending, and the weight
    of the sorted-probability term (``method.uld_weight``)."""

    ids: torch.Tensor
    student_unmatched_logp: torch.Tensor
    uld_weight: float = 1.0


def other_vocabulary_divergence(
    kind: str, student_topk_logp: torch.Tensor, teacher_topk_logp: torch.Tensor, teacher_rest_logp: torch.Tensor,
    other: OtherVocabulary, beta: float = 0.5, clip: float = 0.0,
) -> torch.Tensor:
    """Per-token divergence [..., k] -> [...] with a teacher of another vocabulary (docs/reference/methods.md,
    "Top-k divergences across vocabularies").

    Matched part: the bucket divergence (:func:`topk_divergence`) on the teacher's top-k tokens that
    have a student twin, each model's rest bucket holding everything else, the teacher's unmatched
    top-k mass included: exact for both models coarsened to {each shared token text, all else}.
    ``student_topk_logp`` holds the student's log-probs at the stored ids (any value where an id is
    negative). Unmatched part (ULD, Boizard et al. 2024, as TRL's GOLD uses it for tokens without a
    twin): the L1 distance between the teacher's unmatched top-k probabilities and the student's
    largest unmatched probabilities, both sorted, over as many entries as the teacher has, times
    ``other.uld_weight``. A position whose entries are all NO_ENTRY_ID costs exactly 0, no gradient."""
    matched, unmatched = other.ids >= 0, other.ids == UNMATCHED_ID
    dtype = torch.promote_types(student_topk_logp.dtype, torch.float32)
    floor = torch.full_like(teacher_topk_logp, LOGP_FLOOR, dtype=dtype)
    log_ps = torch.where(matched, student_topk_logp.to(dtype), floor)
    log_pt = torch.where(matched, teacher_topk_logp.to(dtype), floor)
    # The teacher's rest bucket: its mass outside the top-k plus its unmatched top-k entries.
    rest_parts = torch.cat([teacher_rest_logp.to(dtype).unsqueeze(-1), torch.where(unmatched, teacher_topk_logp.to(dtype), floor)], dim=-1)
    teacher_rest = torch.logsumexp(rest_parts, dim=-1)
    matched_part = topk_divergence(kind, log_ps, log_pt, beta, "bucket", teacher_rest, clip)
    teacher_unmatched = torch.where(unmatched, teacher_topk_logp.to(dtype).exp(), torch.zeros_like(floor)).sort(dim=-1, descending=True).values
    student_unmatched = other.student_unmatched_logp.to(dtype).clamp(min=LOGP_FLOOR).exp()
    compared = torch.arange(teacher_unmatched.shape[-1], device=teacher_unmatched.device) < unmatched.sum(-1, keepdim=True)
    uld = ((teacher_unmatched - student_unmatched).abs() * compared).sum(-1)
    # Whatever rest is stored beside a position without entries, it has nothing to compare.
    has_entry = (other.ids != NO_ENTRY_ID).any(-1)
    return torch.where(has_entry, matched_part, torch.zeros_like(matched_part)) + other.uld_weight * uld


@dataclass(frozen=True)
class PolicyGradientTerm:
    """The policy-gradient part of a token loss (:func:`token_losses`): the method's ``policy_loss``,
    the sampling policy's log-probs, the advantages, the 0/1 tokens it applies to and the clip range."""

    loss: str
    old_logp: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    clip_low: float = 0.2
    clip_high: float = 0.2


@dataclass(frozen=True)
class DivergenceTerm:
    """The divergence part of a token loss, weighted per token: :func:`topk_divergence` of the
    student's and the teacher's top-k log-probs (``form``, the stored teacher rest, JSD's ``beta``,
    the point-wise clip, whether k is the vocabulary), or :func:`other_vocabulary_divergence` where the
    teacher's top-k is of another vocabulary."""

    kind: str
    weight: torch.Tensor
    student_topk_logp: torch.Tensor
    teacher_topk_logp: torch.Tensor
    teacher_rest_logp: torch.Tensor | None = None  # None: recomputed from the top-k
    beta: float = 0.5
    form: str = "bucket"
    pointwise_clip: float = 0.0
    covers_vocabulary: bool = False
    other_vocabulary: OtherVocabulary | None = None

    def per_token(self) -> torch.Tensor:
        """The unweighted divergence of every token, [..., k] -> [...]."""
        if self.other_vocabulary is not None:
            return other_vocabulary_divergence(self.kind, self.student_topk_logp, self.teacher_topk_logp, self.teacher_rest_logp,
                                               self.other_vocabulary, self.beta, self.pointwise_clip)
        return topk_divergence(self.kind, self.student_topk_logp, self.teacher_topk_logp, self.beta, form=self.form,
                               teacher_rest_logp=self.teacher_rest_logp, clip=self.pointwise_clip, covers_vocabulary=self.covers_vocabulary)


def combined_token_losses(
    logp: torch.Tensor, policy: PolicyGradientTerm | None = None, divergence: DivergenceTerm | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A method's per-token loss: L_t = pg_mask_t L_pg_t + weight_t D_t (no ``policy``: no PG term, no
    ``divergence``: no D term), and the 0/1 clipped-branch marker of the PG term."""
    losses = torch.zeros_like(logp)
    clipped = torch.zeros_like(logp)
    if policy is not None:
        pg, clipped = token_losses(policy.loss, logp, policy.old_logp, policy.adv, policy.mask, policy.clip_low, policy.clip_high)
        losses = losses + pg * policy.mask
        clipped = clipped * policy.mask
    if divergence is not None:
        losses = losses + divergence.weight * divergence.per_token()
    return losses, clipped
