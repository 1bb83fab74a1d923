"""Rows of (prompt, response) token ids laid out as batches for the backbone, and which rows go together.

:func:`token_budget_batches` groups responses by length, each batch holding at most ``max_tokens``
padded tokens, so a batch of short answers is large and one long answer is alone. :func:`make_batch`
puts a batch's rows on the device as a :class:`TokenBatch`; with ``share_prompts`` a prompt sampled n
times is one prompt row, read once by the backbone (:func:`gndpo.stages.models.logprobs.response_hidden`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class TokenBatch:
    """A batch of (prompt, response) rows on the model's device, laid out for the backbone, and where
    its response tokens are.

    Two layouts. Whole sequences (``prefix_ids`` is None): each row's prompt + response, right-padded,
    in ``ids``; ``cols`` is the position whose hidden state predicts each response token. Shared
    prompts: every distinct prompt once in ``prefix_ids`` (left-padded, so each ends in the last column),
    and each row's response, right-padded, in ``ids``, read against its prompt's keys and values
    (``prefix_of``); see :func:`response_hidden`.

    ``rows``/``offsets`` give, for each response token in order (response 0's tokens, then response
    1's, ...), its row and its index within the response; ``targets`` are those tokens."""

    ids: torch.Tensor  # [B, W] long
    attention_mask: torch.Tensor  # [B, W]
    lengths: torch.Tensor  # [B] response lengths (on the CPU)
    rows: torch.Tensor  # [N]
    cols: torch.Tensor | None  # [N] (whole sequences only)
    offsets: torch.Tensor  # [N] index of each token within its response
    targets: torch.Tensor  # [N]
    prefix_ids: torch.Tensor | None = None  # [P, Wp] long, the distinct prompts (shared prompts only)
    prefix_mask: torch.Tensor | None = None  # [P, Wp]
    prefix_of: torch.Tensor | None = None  # [B] which prompt row each response reads
    # The batch row whose prompt (and pictures) each prefix row holds: the rows a caller takes image
    # tensors from; every row for whole sequences.
    prefix_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # A vision-language model's image tensors for the prompt rows (the prefix rows when prompts are
    # shared; gndpo.stages.models.vision.image_inputs); empty for text.
    images: dict = field(default_factory=dict)

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

    def responses(self, rows: slice, tokens: slice) -> TokenBatch:
        """The responses ``rows`` alone, whose tokens are ``tokens`` of the flat order, for laying their
        per-token values out (:meth:`padded`, :meth:`mask`); not for the backbone (no prompts)."""
        return TokenBatch(
            ids=self.ids[rows], attention_mask=self.attention_mask[rows], lengths=self.lengths[rows], rows=self.rows[tokens] - rows.start,
            cols=None if self.cols is None else self.cols[tokens], offsets=self.offsets[tokens], targets=self.targets[tokens],
        )


def padded_ids(seqs: list[np.ndarray], pad_id: int, left: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(ids [n, longest], attention mask [n, longest]) of ``seqs`` padded on the right (or left)."""
    width = max((len(s) for s in seqs), default=0)
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    attn = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        where = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, where] = s
        attn[i, where] = 1
    return ids, attn


def make_batch(prompts: list, responses: list, pad_id: int, device: torch.device, share_prompts: bool = False,
               image_keys: list | None = None) -> TokenBatch:
    """Lay out (prompt ids, response ids) rows on ``device``; sequences may be lists or numpy arrays.

    ``share_prompts``: rows whose prompt ids are equal (and, with ``image_keys``, whose pictures are:
    one key per row) share one prompt row, which the backbone reads once for all of them."""
    prompts = [np.asarray(p, dtype=np.int64) for p in prompts]
    responses = [np.asarray(r, dtype=np.int64) for r in responses]
    lengths = np.array([len(r) for r in responses], dtype=np.int64)
    rows = np.repeat(np.arange(len(responses)), lengths)
    # Offsets of each token within its response: 0..len-1 for every response, concatenated.
    offsets = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    rows_t, offsets_t = torch.from_numpy(rows).to(device), torch.from_numpy(offsets).to(device)
    if not share_prompts:
        ids, attn = padded_ids([np.concatenate([p, r]) for p, r in zip(prompts, responses)], pad_id)
        cols = np.repeat([len(p) for p in prompts], lengths) + offsets - 1
        ids_t, cols_t = torch.from_numpy(ids).to(device), torch.from_numpy(cols).to(device)
        return TokenBatch(
            ids=ids_t, attention_mask=torch.from_numpy(attn).to(device), lengths=torch.from_numpy(lengths),
            rows=rows_t, cols=cols_t, offsets=offsets_t, targets=ids_t[rows_t, cols_t + 1],
            prefix_rows=np.arange(len(prompts)),
        )
    keys = [p.tobytes() for p in prompts] if image_keys is None else [(p.tobytes(), k) for p, k in zip(prompts, image_keys)]
    first_row: dict = {}
    for i, key in enumerate(keys):
        first_row.setdefault(key, i)
    index = {key: j for j, key in enumerate(first_row)}
    prefix_of = np.array([index[key] for key in keys], dtype=np.int64)
    prefix_rows = np.array(list(first_row.values()), dtype=np.int64)
    prefix_ids, prefix_attn = padded_ids([prompts[i] for i in prefix_rows], pad_id, left=True)
    ids, attn = padded_ids(responses, pad_id)
    ids_t = torch.from_numpy(ids).to(device)
    return TokenBatch(
        ids=ids_t, attention_mask=torch.from_numpy(attn).to(device), lengths=torch.from_numpy(lengths),
        rows=rows_t, cols=None, offsets=offsets_t, targets=ids_t[rows_t, offsets_t],
        prefix_ids=torch.from_numpy(prefix_ids).to(device), prefix_mask=torch.from_numpy(prefix_attn).to(device),
        prefix_of=torch.from_numpy(prefix_of).to(device), prefix_rows=prefix_rows,
    )


def token_budget_batches(lengths: np.ndarray, max_tokens: int, max_rows: int, prompt_keys: list | None = None) -> list[np.ndarray]:
    """Group sequence indices by length into batches of at most ``max_tokens`` padded tokens (rows x the
    longest sequence) and ``max_rows`` rows. A sequence longer than the budget gets a batch of its own.

    ``prompt_keys`` (one per sequence; equal keys, one prompt): the sequences of a prompt stay next to
    each other, its longest first, prompts ordered by their longest sequence, so a batch that reads
    shared prompts once holds as many of a prompt's responses as fit. The grouping depends only on the
    lengths and keys, so every worker forms the same batches."""
    lengths = np.asarray(lengths)
    order = np.argsort(-lengths, kind="stable")
    if prompt_keys is not None:
        group_of: dict = {}
        groups = np.array([group_of.setdefault(prompt_keys[i], len(group_of)) for i in order])
        # Groups are numbered in order of their longest sequence: a stable sort by group keeps each
        # group's own order (longest first) and the groups' order by their longest.
        order = order[np.argsort(groups, kind="stable")]
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
