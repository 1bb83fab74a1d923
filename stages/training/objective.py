"""A micro-batch's train loss (:class:`Objective`): the method's policy-gradient term and its divergence
on the teacher's top-k, per token, weighted and aggregated as the method says, with the student's
log-probs from the fused output layer (:mod:`gndpo.stages.models.fused_output`) or the checkpointed
path (:func:`gndpo.stages.models.logprobs.policy_token_logprobs`). Train's steps
(:mod:`gndpo.stages.train`) add each micro-batch's share of the step loss."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gndpo.pipeline.methods import divergence_of, policy_settings, score_needs
from gndpo.pipeline.methods.base import TOPK
from gndpo.pipeline.methods.losses import (
    LOGP_FLOOR,
    NO_ENTRY_ID,
    DivergenceTerm,
    OtherVocabulary,
    PolicyGradientTerm,
    aggregate,
    combined_token_losses,
)
from gndpo.pipeline.settings.schema import Config
from gndpo.stages.models.batches import TokenBatch, make_batch
from gndpo.stages.models.fused_output import fused_loss
from gndpo.stages.models.logprobs import PolicyLogprobs, logits_chunk, policy_token_logprobs, response_hidden
from gndpo.stages.models.vision import BatchImages
from gndpo.stages.training.batch import TrainRow


def padded(rows: list[TrainRow], key: str, width: int, device, dtype=torch.float32) -> torch.Tensor:
    """Per-token fields of ``rows`` as a right-padded [B, width(, k)] tensor on ``device``."""
    first = getattr(rows[0], key)
    out = np.zeros((len(rows), width, *first.shape[1:]), dtype=np.float64 if dtype.is_floating_point else np.int64)
    for i, r in enumerate(rows):
        values = getattr(r, key)
        out[i, : len(values)] = values
    return torch.from_numpy(out).to(device=device, dtype=dtype)


@dataclass(frozen=True)
class Objective:
    """What a micro-batch's loss is made of: the method's policy loss and how token losses aggregate,
    the divergence on the teacher's top-k (None where the method stores no top-k for one), the config's
    clip, divergence and model settings, and where batches are built (pad id, device)."""

    cfg: object
    policy_loss: str
    loss_agg: str
    divergence: str | None
    pad_id: int
    device: torch.device
    images: BatchImages | None = None  # a run whose prompts show pictures: the forward's image tensors
    # Teachers of another vocabulary (score.cross_tokenizer) with a top-k divergence: their names (as
    # score records them per row) and, row for row, [V] True at the student's tokens without a twin in
    # that teacher's vocabulary (stages/text/vocabulary.py), on the device.
    teacher_names: tuple[str, ...] = ()
    student_unmatched: torch.Tensor | None = None  # [teachers, V]
    # Whether a micro-batch reads each distinct prompt once (model.shared_prompts). Not under gradient
    # checkpointing: a checkpointed layer drops the prompt's keys and values.
    share_prompts: bool = True
    # Whether the output layer's gradient is computed in the forward (train.fused_output, where the
    # layer allows it and the loss reads only log-probs at given ids: not with teachers of another
    # vocabulary, whose divergence also reads the student's largest log-probs over a set of ids).
    fused: bool = False

    @classmethod
    def of(cls, cfg: Config, round_idx: int, pad_id: int, device: torch.device, images: BatchImages | None = None,
           student_unmatched: dict[str, np.ndarray] | None = None, checkpointing: bool = False, fusable: bool = False) -> Objective:
        """The round's objective; ``checkpointing``: whether the model recomputes its layers in backward;
        ``fusable``: whether its output layer can be fused (:meth:`OutputLayer.fits`)."""
        policy_loss, loss_agg = policy_settings(cfg.method)
        # A div term is computed only where the method stored the teacher top-k for one.
        divergence = divergence_of(cfg.method, round_idx) if TOPK in score_needs(cfg.method) else None
        masks = names = None
        if divergence and student_unmatched:
            names, masks = tuple(student_unmatched), torch.from_numpy(np.stack(list(student_unmatched.values()))).to(device)
        return cls(cfg, policy_loss, loss_agg, divergence, pad_id, device, images, names or (), masks,
                   share_prompts=cfg.model.shared_prompts and not checkpointing, fused=cfg.train.fused_output and fusable and masks is None)

    def micro_batch_loss(self, model, micro: list[TrainRow], min_chunks: int, n_seqs: int, n_tokens: int, weight_sum: float):
        """(this micro-batch's share of the step loss, [loss, clipped tokens, sum of ratios]).

        A rank with fewer micro-batches than another runs an empty one: a forward on one pad token times
        zero, so every rank calls every module (and ZeRO-3 gathers) the same number of times."""
        if not micro:
            return self.empty_micro_batch_loss(model, min_chunks), (0.0, 0.0, 0.0)
        totals = (n_seqs, n_tokens, weight_sum)
        batch = self.token_batch(micro)
        topk_ids = torch.from_numpy(np.concatenate([r.topk_ids for r in micro]).astype(np.int64)).to(self.device) if self.divergence is not None else None
        if self.fused:
            loss, stats = self.fused_loss(model, batch, micro, topk_ids, totals)
        else:
            out = self.student_logprobs(model, batch, micro, topk_ids, min_chunks)
            loss, stats = self.responses_loss(model, batch, micro, out, topk_ids, totals)
            loss = loss + out.pad_term
        return loss, tuple(stats.tolist())

    def fused_loss(self, model, batch: TokenBatch, micro: list[TrainRow], topk_ids, totals: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's loss, its [loss, clipped tokens, sum of ratios]) with the output layer's
        gradients computed in the forward (:mod:`gndpo.stages.models.fused_output`), group of whole
        responses by group."""
        ids = batch.targets.unsqueeze(-1)
        if topk_ids is not None:  # a negative id reads id 0, as the checkpointed path reads it; the loss masks it
            ids = torch.cat([ids, topk_ids.clamp(min=0)], dim=-1)
        stats = []

        def group_loss(rows: slice, tokens: slice, logp: torch.Tensor) -> torch.Tensor:
            out = PolicyLogprobs(logp[:, 0], logp[:, 1:] if topk_ids is not None else None, logp.new_zeros(()))
            loss, group_stats = self.responses_loss(model, batch.responses(rows, tokens), micro[rows], out,
                                                    topk_ids[tokens] if topk_ids is not None else None, totals)
            stats.append(group_stats)
            return loss

        loss = fused_loss(model, response_hidden(model, batch), ids, batch.lengths.tolist(), logits_chunk(model, self.cfg.model),
                          self.cfg.rollout.temperature, group_loss)
        return loss, torch.stack(stats).sum(0)

    def responses_loss(self, model, batch: TokenBatch, micro: list[TrainRow], out: PolicyLogprobs, topk_ids,
                       totals: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(the share of the step loss of ``batch``'s responses (``micro``'s rows) from the student's
        log-probs ``out``, [its value, clipped tokens, sum of ratios] detached). A sum over responses, so
        the shares of any grouping of a micro-batch's responses add up to the micro-batch's."""
        device = self.device
        logp = batch.padded(out.sampled)
        width = logp.shape[1]
        response_mask = batch.mask()
        mask = response_mask * padded(micro, "mask", width, device)
        old = padded(micro, "old_logp", width, device)
        policy = None
        if self.policy_loss != "none":
            method = self.cfg.method
            policy = PolicyGradientTerm(self.policy_loss, old, padded(micro, "adv", width, device), response_mask * padded(micro, "pg_mask", width, device),
                                        method.clip_low, method.clip_high)
        divergence = None if self.divergence is None else self.divergence_term(model, batch, micro, out, topk_ids, response_mask)
        losses, was_clipped = combined_token_losses(logp, policy, divergence)
        weights = torch.tensor([r.weight for r in micro], dtype=torch.float32, device=device).unsqueeze(-1)
        loss = aggregate(losses * weights, mask, self.loss_agg, *totals)
        ratio = (torch.exp(logp.detach() - old) * mask).sum()
        return loss, torch.stack([loss.detach().float(), was_clipped.sum().float(), ratio.float()])

    def empty_micro_batch_loss(self, model, min_chunks: int) -> torch.Tensor:
        """A zero loss that still runs the model (and ``min_chunks`` output-layer chunks) once."""
        batch = make_batch([[self.pad_id]], [[self.pad_id]], self.pad_id, self.device, self.share_prompts)
        out = policy_token_logprobs(model, batch, logits_chunk(model, self.cfg.model), self.cfg.rollout.temperature, None, min_chunks)
        return out.sampled.sum() * 0.0 + out.pad_term

    def token_batch(self, micro: list[TrainRow]) -> TokenBatch:
        """The micro-batch's prompts and responses as one token batch on the device, with its pictures."""
        prompt_ids = [r.prompt_id for r in micro]
        batch = make_batch([r.prompt for r in micro], [r.response for r in micro], self.pad_id, self.device, self.share_prompts,
                           image_keys=prompt_ids if self.images is not None else None)
        if self.images is not None:
            batch.images = self.images.inputs([prompt_ids[i] for i in batch.prefix_rows], self.device)
        return batch

    def student_logprobs(self, model, batch: TokenBatch, micro: list[TrainRow], topk_ids, min_chunks: int) -> PolicyLogprobs:
        """The student's differentiable log-probs: of each sampled token, at the teacher's top-k ids,
        and (a teacher of another vocabulary) its largest over its tokens that teacher lacks."""
        teacher_of_token = None
        if self.student_unmatched is not None:
            teacher_of_token = torch.tensor(np.repeat([self.teacher_names.index(r.teacher) for r in micro], [len(r.response) for r in micro]),
                                            device=self.device)
        return policy_token_logprobs(model, batch, logits_chunk(model, self.cfg.model), self.cfg.rollout.temperature, topk_ids, min_chunks,
                                     self.student_unmatched, teacher_of_token)

    def divergence_term(self, model, batch: TokenBatch, micro: list[TrainRow], out: PolicyLogprobs, topk_ids,
                        response_mask: torch.Tensor) -> DivergenceTerm:
        """The method's divergence on the stored teacher top-k, padded like the batch (``response_mask``:
        its [B, W] response positions)."""
        method, device = self.cfg.method, self.device
        width = response_mask.shape[1]
        # Padding positions get a uniform (k+1)-bucket distribution for both models, so every
        # divergence form is finite there (then masked out): a NaN times 0 would still be NaN.
        fill = -float(np.log(out.at_ids.shape[-1] + 1))
        teacher_topk = padded(micro, "topk_logp", width, device)
        teacher_topk[response_mask == 0] = fill
        teacher_rest = None
        if all(r.topk_rest is not None for r in micro):  # else (older shards) the loss recomputes it
            teacher_rest = padded(micro, "topk_rest", width, device)
            teacher_rest[response_mask == 0] = fill
        other = None
        if self.student_unmatched is not None:  # padding positions: no entry, no divergence
            other = OtherVocabulary(batch.padded(topk_ids, NO_ENTRY_ID), batch.padded(out.largest, LOGP_FLOOR), method.uld_weight)
        return DivergenceTerm(
            self.divergence, padded(micro, "div", width, device), batch.padded(out.at_ids, fill), teacher_topk, teacher_rest,
            beta=method.jsd_beta, form=method.topk_form, pointwise_clip=method.pointwise_clip,
            covers_vocabulary=topk_ids.shape[-1] >= model.get_output_embeddings().out_features, other_vocabulary=other,
        )
