"""Memory-bounded per-token log-probs of sampled responses, for score (no grad) and train (with grad).

At a real vocabulary the output layer dominates memory: one position's fp32 logits at V = 151,936 take
0.6 MB, so logits for a 16k-token response are ~10 GB per copy. Nothing here ever builds them for the
whole sequence. The backbone runs once over prompt + response; the hidden states of the RESPONSE
positions (the ones whose logits predict a response token) are gathered into one flat [N, H] tensor;
then lm_head, log-softmax and whatever the caller keeps (the sampled token's log-prob, top-k, entropy,
KL) run over ``token_chunk`` positions at a time. In train each chunk is wrapped in activation
checkpointing, so backward recomputes the chunk's logits instead of keeping every chunk's [chunk, V]
log-softmax alive (the idea of torchtune's chunked output loss and Liger's fused linear cross-entropy).

Batches are formed by :func:`token_budget_batches`: responses grouped by length, each batch holding at
most ``max_tokens`` padded tokens, so a batch of short answers is large and one long answer is alone.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint


@dataclass
class TokenBatch:
    """Right-padded prompt + response ids on the model's device, and where the responses are.

    ``rows``/``cols`` index, for each response token in order (response 0's tokens, then response 1's,
    ...), the position whose logits predict it (start + t - 1); ``targets`` are those tokens."""

    ids: torch.Tensor  # [B, W] long
    attention_mask: torch.Tensor  # [B, W]
    lengths: torch.Tensor  # [B] response lengths (on the CPU)
    rows: torch.Tensor  # [N]
    cols: torch.Tensor  # [N]
    offsets: torch.Tensor  # [N] index of each token within its response
    targets: torch.Tensor  # [N]

    @property
    def n_tokens(self) -> int:
        return int(self.targets.shape[0])

    def padded(self, flat: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """A flat per-response-token tensor [N, ...] laid out as [B, max response length, ...]."""
        width = int(self.lengths.max()) if len(self.lengths) else 0
        out = flat.new_full((len(self.lengths), width, *flat.shape[1:]), fill)
        out[self.rows, self.offsets] = flat
        return out

    def mask(self) -> torch.Tensor:
        """[B, max response length] float mask of real response tokens."""
        return self.padded(torch.ones(self.n_tokens, device=self.ids.device))


def make_batch(prompts: list, responses: list, pad_id: int, device: torch.device) -> TokenBatch:
    """Pad a group of (prompt ids, response ids) on ``device``; sequences may be lists or numpy arrays."""
    seqs = [np.concatenate([np.asarray(p, dtype=np.int64), np.asarray(r, dtype=np.int64)]) for p, r in zip(prompts, responses)]
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    attn = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        attn[i, : len(s)] = 1
    starts = np.array([len(p) for p in prompts], dtype=np.int64)
    lengths = np.array([len(r) for r in responses], dtype=np.int64)
    rows = np.repeat(np.arange(len(seqs)), lengths)
    # Offsets of each token within its response: 0..len-1 for every response, concatenated.
    offsets = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    cols = np.repeat(starts, lengths) + offsets - 1
    ids_t = torch.from_numpy(ids).to(device)
    rows_t, cols_t = torch.from_numpy(rows).to(device), torch.from_numpy(cols).to(device)
    return TokenBatch(
        ids=ids_t, attention_mask=torch.from_numpy(attn).to(device), lengths=torch.from_numpy(lengths),
        rows=rows_t, cols=cols_t, offsets=torch.from_numpy(offsets).to(device), targets=ids_t[rows_t, cols_t + 1],
    )


def token_budget_batches(lengths: np.ndarray, max_tokens: int, max_rows: int) -> list[np.ndarray]:
    """Group sequence indices by length into batches of at most ``max_tokens`` padded tokens (rows x the
    longest sequence) and ``max_rows`` rows. A sequence longer than the budget gets a batch of its own.
    The grouping depends only on the lengths, so every worker forms the same batches."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    batches, current, width = [], [], 0
    for i in order:
        w = max(width, int(lengths[i]))
        if current and (w * (len(current) + 1) > max_tokens or len(current) >= max_rows):
            batches.append(np.array(current))
            current, w = [], int(lengths[i])
        current.append(int(i))
        width = w
    if current:
        batches.append(np.array(current))
    return batches


def response_hidden(model, batch: TokenBatch) -> torch.Tensor:
    """The backbone's last hidden state at every response-predicting position, as [N, H]."""
    decoder = model.get_decoder()
    out = decoder(input_ids=batch.ids, attention_mask=batch.attention_mask, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[batch.rows, batch.cols]


def head_logprobs(model, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(lm_head(hidden) / temperature) in fp32, [n, V]. The lm_head MODULE is called (not its
    weight), so ZeRO-3's gather hooks run; Gemma-style final logit soft-capping is applied."""
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
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


@torch.no_grad()
def pair_token_stats(teacher, student, batch: TokenBatch, token_chunk: int, student_temperature: float,
                     topk: int = 0, entropies: tuple[bool, bool] = (False, False), kl: bool = False) -> dict:
    """Score's per-token numbers for one batch, flat over response tokens ([N] or [N, k], on the CPU).

    Always: ``student_logprobs`` (the sampling temperature) and, unless ``teacher`` is None (its numbers
    come from elsewhere), ``teacher_logprobs`` (temperature 1). On request: the teacher's top-``topk``
    ids and log-probs, the teacher's / student's entropy and the full-vocabulary KL(p_S || p_T). At most
    one chunk of each model's [chunk, V] log-probs exists. ``teacher`` may be a list of models: the
    teacher is then their mean, p_T = (1/n) sum_i p_i over the whole vocabulary, so every column above
    is the mixture's."""
    teachers = [] if teacher is None else list(teacher) if isinstance(teacher, (list, tuple)) else [teacher]
    h_teachers = [response_hidden(t, batch) for t in teachers]
    h_student = response_hidden(student, batch)
    want_teacher_entropy, want_student_entropy = entropies
    parts: dict[str, list] = {}
    for sl in chunks(batch.n_tokens, token_chunk):
        s_all = head_logprobs(student, h_student[sl], student_temperature)
        targets = batch.targets[sl].unsqueeze(-1)
        out = {"student_logprobs": s_all.gather(-1, targets).squeeze(-1)}
        t_all = None
        if teachers:
            t_all = mixture([head_logprobs(t, h[sl]) for t, h in zip(teachers, h_teachers)])
            out["teacher_logprobs"] = t_all.gather(-1, targets).squeeze(-1)
            if topk:
                values, ids = t_all.topk(min(topk, t_all.shape[-1]), dim=-1)
                out["teacher_topk_logprobs"], out["teacher_topk_ids"] = values, ids.int()
            if want_teacher_entropy:
                out["teacher_entropy"] = entropy(t_all)
        if want_student_entropy or kl:
            s_prob = s_all.exp()  # one full-vocabulary exp shared by the entropy and the KL
            if want_student_entropy:
                out["student_entropy"] = -(s_prob * s_all).sum(-1)
            if kl:
                out["token_kl"] = (s_prob * (s_all - t_all)).sum(-1)
        for name, value in out.items():
            parts.setdefault(name, []).append(value.cpu())
        del t_all, s_all
    return {name: torch.cat(values) for name, values in parts.items()}


def policy_token_logprobs(model, batch: TokenBatch, token_chunk: int, temperature: float,
                          topk_ids: torch.Tensor | None = None, min_chunks: int = 0):
    """Train's differentiable log-probs, flat over response tokens: (the sampled token's [N]; with
    ``topk_ids`` [N, k], the student's full-softmax log-probs at those ids [N, k], else None; a zero
    scalar to add to the loss).

    Each chunk's lm_head + log-softmax is checkpointed: its [chunk, V] activations are freed after the
    forward and recomputed during backward, so peak memory holds one chunk's logits, not N positions'.
    With ``min_chunks`` more than the batch needs, the output layer also runs on that many one-position
    zero chunks, whose outputs enter the loss times zero (the returned scalar): ranks of one ZeRO-3
    group must call every module equally often, since each call gathers its partitioned weights."""
    hidden = response_hidden(model, batch)

    def chunk_fn(h, targets, ids):
        logp_all = head_logprobs(model, h, temperature)
        sampled = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return sampled, (logp_all.gather(-1, ids) if ids is not None else sampled.new_zeros(0))

    def run(h, targets, ids):
        if torch.is_grad_enabled():
            return checkpoint(chunk_fn, h, targets, ids, use_reentrant=False)
        return chunk_fn(h, targets, ids)

    sampled, at_ids = [], []
    for sl in chunks(batch.n_tokens, token_chunk):
        s, k = run(hidden[sl], batch.targets[sl], topk_ids[sl] if topk_ids is not None else None)
        sampled.append(s)
        at_ids.append(k)
    pad_term = hidden.new_zeros((), dtype=torch.float32)
    for _ in range(max(0, min_chunks - len(sampled))):
        zeros = hidden.new_zeros((1, hidden.shape[-1]))
        s, _ = run(zeros, batch.targets.new_zeros(1), None)
        pad_term = pad_term + s.sum() * 0.0
    return torch.cat(sampled), (torch.cat(at_ids) if topk_ids is not None else None), pad_term
