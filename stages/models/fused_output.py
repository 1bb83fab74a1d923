"""Train's output layer with its gradient computed in the forward pass (Liger Kernel's fused linear loss,
in plain PyTorch).

Every train loss reads the student's log-probs at a few ids per response position: the sampled token,
and for a divergence the teacher's top-k (the rest bucket is computed from those). With ``z`` a
position's logits over the vocabulary, ``lse = logsumexp(z)`` and ``G_j = z[id_j] - lse`` (j = 0..K),
the loss's gradient with respect to the logits is, exactly,

    dL/dz_v = sum_j dL/dG_j [v == id_j]  -  c p_v,       c = sum_j dL/dG_j,   p = softmax(z),

a per-position multiple of the softmax plus K + 1 sparse entries. (Softcapped logits z = cap tanh(x / cap)
and a temperature z = y / T multiply it by (1 - tanh^2) / T.) So each chunk of positions needs its logits
once: they give G, the loss's gradient with respect to G (autograd over [n, K + 1], small), then dL/dz
in the logits' own buffer, which goes straight into the input's gradient (dz @ W) and the weight's
(dz^T @ h). Three output-layer matmuls per position and no logits kept for the backward, where the
checkpointed path (:func:`gndpo.stages.models.logprobs.policy_token_logprobs`) does four and runs
log-softmax's forward twice and its backward once over every [chunk, V].

The loss must be known for a chunk's positions while their logits exist. The losses here sum over
responses (a response's share of the step loss depends on its own tokens only: the GSPO ratio is its
response's mean), so chunks hold whole responses (:func:`response_groups`). A response longer than a
chunk takes two passes over its positions: the first gives its G, the second its gradient (four
matmuls, as before, for those positions only).

Memory: the weight's gradient [V, H] exists from the forward on. Where the output layer's weight is the
input embedding's (tied, as in Gemma, Qwen3's small models, SmolLM2), the backward adds it into the
weight's ``.grad`` itself, and the embedding lookup's gradient is sparse (:func:`sparse_tied_lookup`):
autograd then adds the looked-up rows into that ``.grad`` in place. Handed to autograd instead, the dense
gradient would wait for the lookup's and be summed with it out of place: a second [V, H] at the
backward's peak (0.67 GB at Gemma 3's vocabulary in float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gndpo.stages.models.device import vocabulary_logits

# The loss of a group of whole responses: (their rows in the batch, their tokens in the flat order, G
# [n, 1 + K] the log-probs at each token's ids, requiring grad) -> the group's share of the loss, a
# scalar; the share's other outputs (statistics) are the callee's to keep.
GroupLoss = Callable[[slice, slice, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ResponseGroup:
    """Consecutive responses of a batch whose positions go through the output layer together: their
    rows, their tokens in the batch's flat order, and the chunk size the positions are cut into
    (more than one chunk only for a response longer than the chunk)."""

    rows: slice
    tokens: slice
    chunk: int

    @property
    def split(self) -> bool:
        return self.tokens.stop - self.tokens.start > self.chunk


def response_groups(lengths: list[int], chunk: int) -> list[ResponseGroup]:
    """Responses (of these token ``lengths``, in batch order) grouped in order: as many whole responses
    as hold at most ``chunk`` positions together; a longer response alone."""
    groups, first_row, first_token, count = [], 0, 0, 0
    for row, length in enumerate(lengths):
        if count and count + length > chunk:
            groups.append(ResponseGroup(slice(first_row, row), slice(first_token, first_token + count), chunk))
            first_row, first_token, count = row, first_token + count, 0
        count += length
    if first_row < len(lengths):
        groups.append(ResponseGroup(slice(first_row, len(lengths)), slice(first_token, first_token + count), chunk))
    return groups


@dataclass(frozen=True)
class OutputLayer:
    """A model's output layer as the fused loss computes with it: the weight [V, H], whether it is the
    input embedding's (``tied``), Gemma-style final logit soft-capping (0: none) and the sampling
    temperature."""

    weight: torch.Tensor
    softcap: float = 0.0
    temperature: float = 1.0
    tied: bool = False

    @classmethod
    def of(cls, model, temperature: float = 1.0) -> OutputLayer:
        return cls(model.get_output_embeddings().weight, float(getattr(model.config, "final_logit_softcapping", None) or 0.0), temperature,
                   tied=tied_embedding(model) is not None)

    @staticmethod
    def fits(model) -> bool:
        """Whether the fused loss can stand in for the model's output layer: a bias-free linear layer
        whose weight is whole on this rank (ZeRO-3 partitions it, and gathers it only for a module call)."""
        head = model.get_output_embeddings()
        return isinstance(head, torch.nn.Linear) and head.bias is None and not hasattr(head.weight, "ds_id")

    def logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(z [n, V] in float32 at least, the chain factor dz/dx for softcapped logits or None) of
        ``hidden`` [n, H]."""
        z = vocabulary_logits(hidden, self.weight)
        factor = None
        if self.softcap:
            z = torch.tanh(z.div_(self.softcap))
            factor = 1.0 - z * z  # d tanh(u) / du, kept: z is about to be overwritten
            z.mul_(self.softcap)
        if self.temperature != 1.0:
            z.div_(self.temperature)
        return z, factor


def gathered_logprobs(z: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(G [n, K + 1] the log-softmax of ``z`` [n, V] at ``ids``, the softmax's denominator [n, 1]); ``z``
    is overwritten with exp(z - max), the softmax's numerator, so no second [n, V] buffer exists."""
    top = z.amax(-1, keepdim=True)
    picked = z.gather(-1, ids)
    z.sub_(top).exp_()  # in place: the one [n, V] buffer becomes the softmax's numerator
    total = z.sum(-1, keepdim=True)
    lse = top + total.log()
    return picked - lse, total


def logit_gradient_(numerator: torch.Tensor, total: torch.Tensor, ids: torch.Tensor, grad_g: torch.Tensor,
                    layer: OutputLayer, factor: torch.Tensor | None) -> torch.Tensor:
    """dL/dx [n, V] written over ``numerator`` (exp(z - max), whose row sums are ``total``) from the
    loss's gradient with respect to G at ``ids``: (sparse(dG) - c softmax) / T, times the soft-cap's
    dz/dx."""
    c = grad_g.sum(-1, keepdim=True)
    grad = numerator.mul_(-c / total).scatter_add_(-1, ids, grad_g)
    if layer.temperature != 1.0:
        grad.div_(layer.temperature)
    if factor is not None:
        grad.mul_(factor)
    return grad


class FusedLoss:
    """One micro-batch's loss through the output layer, computed with its gradients at once
    (:func:`fused_loss`); ``grad_hidden`` [N, H] and ``grad_weight`` [V, H] (None: a frozen layer) wait
    for the backward."""

    def __init__(self, layer: OutputLayer, hidden: torch.Tensor, ids: torch.Tensor, groups: list[ResponseGroup], group_loss: GroupLoss):
        self.layer, self.hidden, self.ids, self.groups, self.group_loss = layer, hidden, ids, groups, group_loss
        self.grad_hidden = torch.zeros_like(hidden)
        self.grad_weight = torch.zeros_like(layer.weight) if layer.weight.requires_grad else None

    def compute(self) -> torch.Tensor:
        """The loss (a scalar in float32 at least), every group's gradients added into ``grad_hidden`` /
        ``grad_weight``."""
        loss = self.hidden.new_zeros((), dtype=torch.promote_types(self.hidden.dtype, torch.float32))
        for group in self.groups:
            if group.split:
                loss += self.split_group(group)
                continue
            z, factor = self.layer.logits(self.hidden[group.tokens])
            g, total = gathered_logprobs(z, self.ids[group.tokens])
            value, grad_g = self.loss_and_grad(group, g)
            self.backprop(group.tokens, logit_gradient_(z, total, self.ids[group.tokens], grad_g, self.layer, factor))
            loss += value
            del z, factor  # the next group's logits reuse the memory
        return loss

    def split_group(self, group: ResponseGroup) -> torch.Tensor:
        """A response longer than a chunk: its G chunk by chunk, its loss, then each chunk's logits again
        for the gradient."""
        start = group.tokens.start
        parts = [gathered_logprobs(self.layer.logits(self.hidden[sl])[0], self.ids[sl])[0] for sl in self.chunks(group)]
        value, grad_g = self.loss_and_grad(group, torch.cat(parts))
        for sl in self.chunks(group):
            z, factor = self.layer.logits(self.hidden[sl])
            _, total = gathered_logprobs(z, self.ids[sl])
            local = slice(sl.start - start, sl.stop - start)
            self.backprop(sl, logit_gradient_(z, total, self.ids[sl], grad_g[local], self.layer, factor))
            del z, factor
        return value

    def chunks(self, group: ResponseGroup):
        for start in range(group.tokens.start, group.tokens.stop, group.chunk):
            yield slice(start, min(start + group.chunk, group.tokens.stop))

    def loss_and_grad(self, group: ResponseGroup, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the group's loss, its gradient with respect to ``g``): autograd over the small [n, 1 + K]."""
        with torch.enable_grad():
            g = g.detach().requires_grad_(True)
            value = self.group_loss(group.rows, group.tokens, g)
            if not value.requires_grad:  # nothing of the group enters the loss (every token masked)
                return value.detach(), torch.zeros_like(g)
            (grad_g,) = torch.autograd.grad(value, g)
        return value.detach(), grad_g

    def backprop(self, tokens: slice, grad_logits: torch.Tensor) -> None:
        """The input's and the weight's gradients of one chunk, from its gradient with respect to the logits."""
        grad_logits = grad_logits.to(self.layer.weight.dtype)
        self.grad_hidden[tokens] = torch.mm(grad_logits, self.layer.weight)
        if self.grad_weight is not None:
            self.grad_weight.addmm_(grad_logits.t(), self.hidden[tokens])


class _FusedLossFunction(torch.autograd.Function):
    """Hands autograd the gradients :class:`FusedLoss` computed in the forward; the backward only scales
    them by the gradient of whatever the loss enters (DeepSpeed's rank count, a loss scale)."""

    @staticmethod
    def forward(ctx, hidden, weight, fused: FusedLoss):
        loss = fused.compute()
        ctx.fused = fused
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        fused: FusedLoss = ctx.fused
        ctx.fused = None
        scale = None if bool(grad_loss == 1.0) else grad_loss
        grad_hidden, grad_weight = fused.grad_hidden, fused.grad_weight
        if scale is not None:
            grad_hidden = grad_hidden.mul_(scale.to(grad_hidden.dtype))
            grad_weight = grad_weight.mul_(scale.to(grad_weight.dtype)) if grad_weight is not None else None
        if grad_weight is not None and fused.layer.tied:
            # Into .grad here: the embedding lookup's gradient still reaches the weight through autograd
            # afterwards, so its accumulation (and any hook on it: DeepSpeed's) sees the whole gradient.
            weight = fused.layer.weight
            if weight.grad is None:
                weight.grad = grad_weight
            else:
                weight.grad.add_(grad_weight)
            grad_weight = None
        return grad_hidden, grad_weight, None


def tied_embedding(model) -> torch.nn.Embedding | None:
    """The model's input embedding where its weight is the output layer's (tied), else None."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    return embedding if isinstance(embedding, torch.nn.Embedding) and head is not None and embedding.weight is head.weight else None


def sparse_tied_lookup(model) -> None:
    """Where the input embedding is the output layer's weight (tied) and trains, make its lookup's
    gradient sparse (the batch's rows, not a dense [V, H] of zeros around them), so the fused loss's
    dense gradient in ``.grad`` takes them in place. An untied embedding keeps the dense gradient
    (AdamW takes no sparse one)."""
    embedding = tied_embedding(model)
    if embedding is not None and embedding.weight.requires_grad:
        embedding.sparse = True


def fused_loss(model, hidden: torch.Tensor, ids: torch.Tensor, lengths: list[int], chunk: int, temperature: float,
               group_loss: GroupLoss) -> torch.Tensor:
    """The loss of a batch whose response positions have hidden states ``hidden`` [N, H] (flat, response
    by response, of ``lengths``), summed over groups of whole responses of at most ``chunk`` positions:
    ``group_loss`` of each group's log-probs (at temperature ``temperature``) at ``ids`` [N, 1 + K] (the
    sampled token first). Differentiable with respect to ``hidden`` and the output layer's weight; the
    gradients are computed here, in the forward (:class:`FusedLoss`), and only scaled in the backward.
    The model's output layer must :meth:`OutputLayer.fits`."""
    layer = OutputLayer.of(model, temperature)
    fused = FusedLoss(layer, hidden.detach(), ids, response_groups(lengths, chunk), group_loss)
    return _FusedLossFunction.apply(hidden, layer.weight, fused)
