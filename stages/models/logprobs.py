"""Memory-bounded per-token log-probs of sampled responses, for score (no grad) and train (with grad).

At a real vocabulary the output layer dominates memory: one position's fp32 logits at V = 151,936 take
0.6 MB, so logits for a 16k-token response are ~10 GB per copy. Nothing here ever builds them for the
whole sequence. The backbone runs once over prompt + response; the hidden states of the RESPONSE
positions (the ones whose logits predict a response token) are gathered into one flat [N, H] tensor;
then lm_head, log-softmax and whatever the caller keeps (the sampled token's log-prob, top-k, entropy,
KL) run over a chunk of positions at a time. In train each chunk is wrapped in activation
checkpointing, so backward recomputes the chunk's logits instead of keeping every chunk's [chunk, V]
log-softmax alive (the idea of torchtune's chunked output loss and Liger's fused linear cross-entropy).

The chunk is sized in bytes, not positions (:func:`logits_chunk`): ``model.logits_budget_mib`` is what
one fp32 [chunk, V] buffer may take, so a 262,144-token vocabulary gets a quarter of the positions a
65,536-token one does; ``model.token_chunk`` caps the count. Score keeps at most two such buffers per
model alive (:func:`pair_token_stats`).

A batch's rows are laid out by :mod:`gndpo.stages.models.batches`; with shared prompts the backbone runs
over the batch's distinct prompts, then over the responses against their prompt's keys and values
(:func:`response_hidden`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from gndpo.pipeline.methods.losses import LOGP_FLOOR
from gndpo.stages.models.batches import TokenBatch
from gndpo.stages.models.device import device_memory, vocabulary_logits
from gndpo.stages.models.fused_output import OutputLayer
from gndpo.stages.models.vision import mrope_positions


def backbone(model, ids: torch.Tensor, attention_mask: torch.Tensor, images: dict | None = None, **kwargs):
    """The model's backbone (no output layer) over ``ids``: its output, whose ``last_hidden_state`` is
    [B, W, H] (and ``past_key_values`` the keys and values, with ``use_cache=True``). With images the
    backbone is the VLM's base model, which puts the vision tower's features at the image tokens; the
    image tensors enter in the model's dtype."""
    if images:
        images = {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in images.items()}
        return model.base_model(input_ids=ids, attention_mask=attention_mask, **images, **kwargs)
    return model.get_decoder()(input_ids=ids, attention_mask=attention_mask, **kwargs)


def response_hidden(model, batch: TokenBatch) -> torch.Tensor:
    """The backbone's last hidden state at every response-predicting position, as [N, H].

    With shared prompts the backbone runs twice: over the distinct prompts (left-padded, positions
    counted from each prompt's first token), keeping their keys and values; then over the responses,
    each attending to its own prompt's keys and values (a row index into the cache, so under autograd
    the gradient through a prompt's positions sums over every response that read it, as separate
    forward passes would give it) with positions that continue its prompt's. A response's first token
    is predicted by its prompt's last position, its t-th by the response pass at t - 1. Both passes run
    for every batch, so ranks of one ZeRO-3 group call each module equally often."""
    if batch.prefix_ids is None:
        mrope = mrope_positions(model, batch.ids, batch.attention_mask, batch.images)
        out = backbone(model, batch.ids, batch.attention_mask, batch.images, use_cache=False, **({"position_ids": mrope[0]} if mrope else {}))
        return out.last_hidden_state[batch.rows, batch.cols]
    prefix_mask = batch.prefix_mask
    mrope = mrope_positions(model, batch.prefix_ids, prefix_mask, batch.images)
    prefix_positions = mrope[0] if mrope else (prefix_mask.cumsum(-1) - 1).clamp(min=0)
    prefix = backbone(model, batch.prefix_ids, prefix_mask, batch.images, position_ids=prefix_positions, use_cache=True)
    cache = prefix.past_key_values
    cache.reorder_cache(batch.prefix_of)
    prompt_lengths = prefix_mask.sum(-1)[batch.prefix_of]
    if mrope:  # text after the images continues from the prompt's largest position, in all three sections
        prompt_lengths = prompt_lengths + mrope[1][batch.prefix_of, 0]
    width = batch.ids.shape[1]
    positions = prompt_lengths.unsqueeze(-1) + torch.arange(width, device=batch.ids.device)
    if mrope:
        positions = positions.unsqueeze(0).expand(3, -1, -1)
    mask = torch.cat([prefix_mask[batch.prefix_of], batch.attention_mask], dim=-1)
    out = backbone(model, batch.ids, mask, position_ids=positions, past_key_values=cache, use_cache=True)
    first = prefix.last_hidden_state[batch.prefix_of, -1]
    hidden = torch.cat([first.unsqueeze(1), out.last_hidden_state[:, :-1]], dim=1)
    return hidden[batch.rows, batch.offsets]


def output_width(model) -> int:
    """V, the width of the model's logits (the output layer's, which may exceed the tokenizer's)."""
    head = model.get_output_embeddings()
    width = getattr(head, "out_features", None)  # set on nn.Linear even when ZeRO-3 partitions the weight
    if width:
        return int(width)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.vocab_size)


# model.logits_budget_mib auto: this share of the device's memory, within these bounds.
AUTO_BUDGET_SHARE, AUTO_BUDGET_MIN, AUTO_BUDGET_MAX = 1 / 32, 256 * 2**20, 2**30


def logits_budget(model_cfg, memory: int | None = None) -> int:
    """The bytes one fp32 [chunk, V] logits buffer may take: ``model_cfg.logits_budget_mib``, or for
    auto AUTO_BUDGET_SHARE of ``memory`` (default: this process's device, :func:`device_memory`) within
    [AUTO_BUDGET_MIN, AUTO_BUDGET_MAX]."""
    if model_cfg.logits_budget_mib != "auto":
        return int(model_cfg.logits_budget_mib) * 2**20
    memory = device_memory() if memory is None else memory
    return int(min(max(AUTO_BUDGET_SHARE * memory, AUTO_BUDGET_MIN), AUTO_BUDGET_MAX)) // 2**20 * 2**20


def logits_chunk(model, model_cfg, memory: int | None = None) -> int:
    """How many response positions get full-vocabulary logits at once: as many as fit one fp32 [n, V]
    buffer in the logits budget (:func:`logits_budget`, ``memory`` its device's bytes), at least 1 and
    at most ``model_cfg.token_chunk``. ``model`` may be a list of models (teachers, student): the widest
    vocabulary decides, since every model runs over the same chunk."""
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    vocab = max(output_width(m) for m in models)
    return max(1, min(int(model_cfg.token_chunk), logits_budget(model_cfg, memory) // (vocab * 4)))


def head_logprobs(model, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(lm_head(hidden) / temperature) in fp32, [n, V]. The lm_head MODULE is called (not its
    weight), so ZeRO-3's gather hooks run; Gemma-style final logit soft-capping is applied.

    Without autograd (score) the logits buffer is turned into the log-probs in place, so one [n, V]
    fp32 buffer exists (plus the model-dtype logits while they are cast); the values are the same as
    the out-of-place ops give, bit for bit. There a plain linear layer's logits come from
    :func:`vocabulary_logits`, as the fused train loss computes them."""
    head = model.get_output_embeddings()
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    logits = head(hidden).float() if needs_grad or not OutputLayer.fits(model) else vocabulary_logits(hidden, head.weight)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if not logits.requires_grad:
        if cap:
            logits.div_(cap).tanh_().mul_(cap)
        if temperature != 1.0:
            logits.div_(temperature)
        return torch.log_softmax(logits, dim=-1, out=logits)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def mixture(logps: list[torch.Tensor]) -> torch.Tensor:
    """log((1/n) sum_i exp(logp_i)): the log-probs of the equal-weight mixture of n distributions."""
    if len(logps) == 1:
        return logps[0]
    return torch.logsumexp(torch.stack(logps), dim=0) - math.log(len(logps))


def chunks(n: int, size: int):
    for start in range(0, n, max(size, 1)):
        yield slice(start, min(start + size, n))


def entropy(logp_all: torch.Tensor) -> torch.Tensor:
    """H(p) in nats over the last axis."""
    return -(logp_all.exp() * logp_all).sum(-1)


# The per-position reductions over the vocabulary (entropies, KL, the teacher's rest) run over row
# blocks of a chunk, writing into two scratch buffers of at most this many bytes each that every block
# reuses, so they never add another [chunk, V] buffer. (Fresh temporaries per block were not reused by
# the allocator when another thread was running: resident memory grew by ~30 MiB per block.) At a toy
# vocabulary a block is the whole chunk, and the ops are the earlier ones, so the numbers are bit for bit
# the same.
REDUCE_BLOCK_BYTES = 16 * 2**20


def mean_teacher_logprobs(teachers: list, hiddens: list[torch.Tensor], sl: slice) -> torch.Tensor:
    """The teachers' mean distribution over ``sl``'s positions as log-probs [n, V] (the only teacher's
    own for one), accumulated in place: at most two [n, V] buffers exist, the sum so far and the next
    teacher's. Equals :func:`mixture` up to float rounding."""
    acc = head_logprobs(teachers[0], hiddens[0][sl])
    for t, h in zip(teachers[1:], hiddens[1:]):
        nxt = head_logprobs(t, h[sl])
        torch.logaddexp(acc, nxt, out=acc)
        del nxt
    if len(teachers) > 1:
        acc.sub_(math.log(len(teachers)))
    return acc


@torch.no_grad()
def pair_token_stats(teacher, student, batch: TokenBatch, token_chunk: int, student_temperature: float,
                     topk: int = 0, entropies: tuple[bool, bool] = (False, False), kl: bool = False,
                     teacher_batch: TokenBatch | None = None) -> dict:
    """Score's per-token numbers for one batch, flat over response tokens ([N] or [N, k], on the CPU).

    ``student_logprobs`` (the sampling temperature) unless ``student`` is None (they come from the
    rollout engine), and ``teacher_logprobs`` (temperature 1) unless ``teacher`` is None (its numbers
    come from elsewhere). On request: the teacher's top-``topk``
    ids and log-probs with ``teacher_rest_logprob``, the log of the teacher's mass outside those ids (a
    logsumexp over the other ids' log-probs, floored at LOGP_FLOOR when k is the vocabulary; never
    1 - sum(p), which is rounding noise below ~1e-7), the teacher's / student's entropy and the
    full-vocabulary KL(p_S || p_T). ``teacher`` may be a list of models: the teacher is then their
    mean, p_T = (1/n) sum_i p_i over the whole vocabulary, so every column above is the mixture's.

    ``teacher_batch``: the teachers read it instead of ``batch`` (a prompt of their own followed by the
    same response tokens in the same order, e.g. a privileged context for self-distillation); the
    outputs stay aligned with ``batch``'s response tokens.

    Memory: ``token_chunk`` positions at a time (:func:`logits_chunk`), with at most two [chunk, V] fp32
    buffers alive per model (the student's log-probs; the teacher mean so far and the next teacher's);
    the entropies, KL and rest run over row blocks into two scratch buffers of REDUCE_BLOCK_BYTES."""
    teachers = [] if teacher is None else list(teacher) if isinstance(teacher, (list, tuple)) else [teacher]
    t_batch = batch if teacher_batch is None else teacher_batch
    if t_batch is not batch and (t_batch.n_tokens != batch.n_tokens or not torch.equal(t_batch.targets, batch.targets)):
        raise ValueError("teacher_batch must hold the student batch's response tokens, in the same order")
    h_teachers = [response_hidden(t, t_batch) for t in teachers]
    h_student = response_hidden(student, batch) if student is not None else None
    parts: dict[str, list] = {}
    scratch = None
    for sl in chunks(batch.n_tokens, token_chunk):
        targets = batch.targets[sl].unsqueeze(-1)
        s_all = head_logprobs(student, h_student[sl], student_temperature) if student is not None else None
        t_all = mean_teacher_logprobs(teachers, h_teachers, sl) if teachers else None
        out, ids = sampled_and_topk(s_all, t_all, targets, topk)
        if scratch is None:
            scratch = reduction_scratch(s_all if s_all is not None else t_all)
        out.update(vocabulary_reductions(s_all, t_all, ids, scratch, entropies, kl))
        for name, value in out.items():
            parts.setdefault(name, []).append(value)  # [chunk] or [chunk, k]: small beside the chunk's logits
        del t_all, s_all  # the next chunk allocates its own [chunk, V] buffers
    # One copy to the CPU per column and batch: a copy per chunk waits for the GPU each time.
    return {name: torch.cat(values).cpu() for name, values in parts.items()}


def sampled_and_topk(s_all: torch.Tensor | None, t_all: torch.Tensor | None, targets: torch.Tensor, topk: int):
    """One chunk's log-probs of the sampled tokens (``targets`` [n, 1]) under the student and the
    teacher where each is given ([n, V] log-probs), and the teacher's top-``topk`` (log-probs and ids);
    returns (columns, the top-k ids or None)."""
    out, ids = {}, None
    if s_all is not None:
        out["student_logprobs"] = s_all.gather(-1, targets).squeeze(-1)
    if t_all is not None:
        out["teacher_logprobs"] = t_all.gather(-1, targets).squeeze(-1)
        if topk:
            values, ids = t_all.topk(min(topk, t_all.shape[-1]), dim=-1)
            out["teacher_topk_logprobs"], out["teacher_topk_ids"] = values, ids.int()
    return out, ids


def reduction_scratch(like: torch.Tensor) -> torch.Tensor:
    """Two [block, V] buffers (REDUCE_BLOCK_BYTES each at most) that the per-position reductions over
    the vocabulary write into, reused for every block of every chunk shaped like ``like``."""
    block = max(1, REDUCE_BLOCK_BYTES // (like.shape[-1] * 4))
    return like.new_empty((2, min(block, like.shape[0]), like.shape[-1]))


def vocabulary_reductions(s_all: torch.Tensor | None, t_all: torch.Tensor | None, ids: torch.Tensor | None, scratch: torch.Tensor,
                          entropies: tuple[bool, bool], kl: bool) -> dict[str, torch.Tensor]:
    """One chunk's per-position reductions over the vocabulary ([n] each), block by block into
    ``scratch`` (:func:`reduction_scratch`): the teacher's / student's entropy as ``entropies`` asks,
    the KL(p_S || p_T) with ``kl``, and with the teacher's top-k ``ids`` its rest log-prob, for which
    the teacher's rows ``t_all`` are overwritten (their last use)."""
    want_teacher_entropy, want_student_entropy = entropies
    rows: dict[str, list] = {}
    n = (s_all if s_all is not None else t_all).shape[0]
    for bl in chunks(n, scratch.shape[1]):
        s, t = (s_all[bl] if s_all is not None else None), (t_all[bl] if t_all is not None else None)
        a, b = scratch[0, : bl.stop - bl.start], scratch[1, : bl.stop - bl.start]
        if want_teacher_entropy and t is not None:  # -(exp(t) * t).sum(-1), as entropy() computes it
            rows.setdefault("teacher_entropy", []).append(-torch.mul(torch.exp(t, out=a), t, out=a).sum(-1))
        if s is not None and (want_student_entropy or (kl and t is not None)):
            s_prob = torch.exp(s, out=a)  # one exp shared by the entropy and the KL
            if want_student_entropy:
                rows.setdefault("student_entropy", []).append(-torch.mul(s_prob, s, out=b).sum(-1))
            if kl and t is not None:  # sum p_S (s - t), the product in the other order (exact either way)
                rows.setdefault("token_kl", []).append(torch.sub(s, t, out=b).mul_(s_prob).sum(-1))
        if ids is not None:  # last use of these teacher rows: mask the top-k ids in place
            t.scatter_(-1, ids[bl], -math.inf)
            top = t.amax(-1, keepdim=True)
            top = torch.where(torch.isfinite(top), top, 0.0)  # k = vocabulary: nothing left (log 0)
            rest = torch.sub(t, top, out=a).exp_().sum(-1).log_() + top.squeeze(-1)
            rows.setdefault("teacher_rest_logprob", []).append(rest.clamp(min=LOGP_FLOOR))
        del s, t, a, b  # views: they would keep buffers alive into the next block
    return {name: torch.cat(values) for name, values in rows.items()}


class PolicyLogprobs(NamedTuple):
    """Train's differentiable log-probs of a batch, flat over its response tokens."""

    sampled: torch.Tensor  # [N]: each sampled token's
    at_ids: torch.Tensor | None  # [N, k]: at the teacher's top-k ids (None: no ids asked for)
    pad_term: torch.Tensor  # a zero scalar to add to the loss (see policy_token_logprobs)
    # [N, k]: the largest log-probs over the ids ``largest_among`` allows, sorted descending (None: not asked)
    largest: torch.Tensor | None = None


def chunk_recompute_check(model) -> str:
    """torch checkpoint's ``determinism_check`` for the output layer's recomputed chunks. Its check that
    the recompute saved tensors of the forward's shapes fails on a frozen output layer under ZeRO-3 (a
    LoRA student): the recompute runs before the layer's backward hook gathers its weight again, so the
    weight it saves is still the empty partition (DeepSpeed fills it in before the weight is used, as
    for a trained layer, whose check passes because its hook ran earlier). Elsewhere the check stays."""
    weight = model.get_output_embeddings().weight
    return "none" if hasattr(weight, "ds_id") and not weight.requires_grad else "default"


def policy_token_logprobs(model, batch: TokenBatch, token_chunk: int, temperature: float,
                          topk_ids: torch.Tensor | None = None, min_chunks: int = 0,
                          largest_among: torch.Tensor | None = None, among_row: torch.Tensor | None = None) -> PolicyLogprobs:
    """Train's differentiable log-probs, flat over response tokens (:class:`PolicyLogprobs`): the
    sampled token's; with ``topk_ids`` [N, k], the student's full-softmax log-probs at those ids (a
    negative id, a teacher token of another vocabulary with no student twin, reads id 0: the caller
    masks it); with ``largest_among`` too ([M, V] bool, and ``among_row`` [N]: which of its M rows
    each token uses, row 0 for all where None), the k largest log-probs over the ids that row marks
    (a teacher of another vocabulary: the student's tokens without a twin in it), -inf where fewer exist.

    Each chunk's lm_head + log-softmax is checkpointed: its [chunk, V] activations are freed after the
    forward and recomputed during backward, so peak memory holds one chunk's logits, not N positions'.
    With ``min_chunks`` more than the batch needs, the output layer also runs on that many one-position
    zero chunks, whose outputs enter the loss times zero (``pad_term``): ranks of one ZeRO-3 group must
    call every module equally often, since each call gathers its partitioned weights."""
    hidden = response_hidden(model, batch)
    k = topk_ids.shape[-1] if topk_ids is not None else 0
    recompute_check = chunk_recompute_check(model)

    masks = largest_among.view(-1, largest_among.shape[-1]) if largest_among is not None else None
    rows = among_row if among_row is not None else batch.targets.new_zeros(batch.n_tokens)

    def chunk_fn(h, targets, ids, row):
        logp_all = head_logprobs(model, h, temperature)
        sampled = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        at_ids = logp_all.gather(-1, ids.clamp(min=0)) if ids is not None else sampled.new_zeros(0)
        if masks is None or ids is None:
            return sampled, at_ids, sampled.new_zeros(0)
        present = row.unique().tolist()
        if len(present) == 1:  # one teacher vocabulary in the chunk: one more [chunk, V] buffer, not two
            return sampled, at_ids, largest_over(logp_all, masks[present[0]])
        largest = logp_all.new_full((len(h), k), -math.inf)
        for m in present:
            largest[row == m] = largest_over(logp_all[row == m], masks[m])
        return sampled, at_ids, largest

    def largest_over(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        top = logp.masked_fill(~mask[: logp.shape[-1]], -math.inf).topk(min(k, logp.shape[-1]), dim=-1).values
        return torch.nn.functional.pad(top, (0, k - top.shape[-1]), value=-math.inf)

    def run(h, targets, ids, row):
        if torch.is_grad_enabled():
            return checkpoint(chunk_fn, h, targets, ids, row, use_reentrant=False, determinism_check=recompute_check)
        return chunk_fn(h, targets, ids, row)

    parts: list[tuple[torch.Tensor, ...]] = []
    for sl in chunks(batch.n_tokens, token_chunk):
        parts.append(run(hidden[sl], batch.targets[sl], topk_ids[sl] if topk_ids is not None else None, rows[sl]))
    pad_term = hidden.new_zeros((), dtype=torch.float32)
    for _ in range(max(0, min_chunks - len(parts))):
        zeros = hidden.new_zeros((1, hidden.shape[-1]))
        s, _, _ = run(zeros, batch.targets.new_zeros(1), None, rows[:0])
        pad_term = pad_term + s.sum() * 0.0
    sampled, at_ids, largest = (list(column) for column in zip(*parts)) if parts else ([], [], [])
    return PolicyLogprobs(
        torch.cat(sampled) if sampled else hidden.new_zeros(0, dtype=torch.float32),
        torch.cat(at_ids) if topk_ids is not None else None,
        pad_term,
        torch.cat(largest) if topk_ids is not None and largest_among is not None else None,
    )
