"""``rollout.backend: hf``: the student's own Hugging Face module samples, in batches, with the keys and
values of every row kept between steps (a dynamic cache), on the model's device and in its dtype.

No engine starts: a round pays a model load (what score pays for the student) instead of vLLM's start
(about 20 s on 2 cores), and it runs wherever torch runs (Apple silicon, ARM servers, a GPU machine
without vLLM). Per token it is slower than vLLM's paged attention and fused sampler on long responses;
the docs' rollout page gives the measured break-even.

Each response is drawn from a generator seeded with its request's seed alone, so a response does not
depend on which worker samples it; the rows of one batch are padded on the left and each step reads the
last position's hidden state through the same output layer and log-softmax train uses
(:func:`~gndpo.stages.models.logprobs.head_logprobs`, float32), so the stored behaviour log-prob is the
number train recomputes at temperature 1, up to the float error of a cached forward against a full one.
"""

from __future__ import annotations

from typing import Callable

import torch

from gndpo.errors import GndpoError
from gndpo.pipeline.run.run import Run
from gndpo.stages.models.device import local_device, set_cpu_threads
from gndpo.stages.models.live import LiveModels
from gndpo.stages.models.logprobs import backbone, head_logprobs
from gndpo.stages.models.sampling import Generation, SamplingRequest
from gndpo.stages.samplers.base import RolloutBackend, SamplerCapabilities


class HFBackend(RolloutBackend):
    """The round's policy as a module on this process's device (a LoRA student: its base plus the
    round's adapters), decoding ``rollout.hf_batch`` responses at a time."""

    capabilities = SamplerCapabilities(tools=True, images=False, lora_adapters=True, engine=False)

    @classmethod
    def open(cls, run: Run, version: int, live: LiveModels, tok) -> "HFSampler":
        # The cores this process was given, as score and train take them: workers sharing a node each
        # compute on their share, and the rows do not depend on a default thread count.
        set_cpu_threads()
        # A LoRA student is its base plus the round's adapters, computed unmerged as train computes it.
        model = live.causal_lm(run.policy_path(version), run.cfg.model, local_device(), fixed=False, base=run.lora_base())
        return HFSampler(model, tok, run.cfg.rollout.hf_batch)


class HFSampler:
    """Batched sampling on a causal LM module: ``batch`` responses decode together (sorted by prompt
    length, so rows of a batch pad little), and a row leaves the batch, with its keys and values, as
    soon as it ends."""

    def __init__(self, model, tok, batch: int):
        self.model, self.tok, self.batch = model, tok, batch
        self.device = next(model.parameters()).device
        self.dtype_bits = next(model.parameters()).dtype.itemsize * 8
        # The model's own end tokens stop every response, as vLLM's generation config makes them.
        eos = getattr(model.generation_config, "eos_token_id", None) if getattr(model, "generation_config", None) else None
        self.eos = {int(e) for e in ([eos] if isinstance(eos, int) else eos or [])} | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    def generate(self, prompt_token_ids: list[list[int]], requests: list[SamplingRequest],
                 on_finished: Callable[[int], None] | None = None, images: list[list] | None = None) -> list[Generation]:
        if images and any(images):
            raise GndpoError("rollout.backend hf samples text prompts only; use rollout.backend vllm for prompts with pictures")
        order = sorted(range(len(prompt_token_ids)), key=lambda i: (len(prompt_token_ids[i]), i))
        out: list[Generation | None] = [None] * len(order)
        for start in range(0, len(order), self.batch):
            rows = order[start : start + self.batch]
            for i, gen in zip(rows, self._decode([prompt_token_ids[i] for i in rows], [requests[i] for i in rows], on_finished)):
                out[i] = gen
        return out

    @torch.inference_mode()
    def _decode(self, prompts: list[list[int]], requests: list[SamplingRequest], on_finished) -> list[Generation]:
        """One batch to its ends: the prompts prefilled, then one token per open row per step."""
        hidden, cache, mask = self._prefill(prompts)
        positions = mask.sum(-1, keepdim=True)  # where each row's next token goes (left padding is not counted)
        generators = [torch.Generator(device=self.device).manual_seed(r.seed) for r in requests]
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        ended: list[tuple[str, int | str | None] | None] = [None] * len(prompts)
        open_rows = list(range(len(prompts)))  # batch position -> request index
        while True:
            raw = head_logprobs(self.model, hidden)  # [rows, V] float32
            picked = draw(raw, [requests[r] for r in open_rows], [generators[r] for r in open_rows])
            chosen = raw.gather(-1, torch.tensor(picked, device=self.device).unsqueeze(-1)).squeeze(-1).tolist()
            for b, r in enumerate(open_rows):
                tokens[r].append(picked[b])
                logprobs[r].append(chosen[b])
                ended[r] = self._ended(tokens[r], requests[r])
            keep = [b for b, r in enumerate(open_rows) if ended[r] is None]
            if on_finished is not None and len(keep) < len(open_rows):
                on_finished(len(open_rows) - len(keep))
            if not keep:
                break
            if len(keep) < len(open_rows):
                index = torch.tensor(keep, device=self.device)
                cache.reorder_cache(index)  # the ended rows' keys and values leave the batch
                mask, positions = mask[index], positions[index]
                picked = [picked[b] for b in keep]
                open_rows = [open_rows[b] for b in keep]
            mask = torch.cat([mask, mask.new_ones(len(open_rows), 1)], dim=-1)
            step = backbone(self.model, torch.tensor(picked, device=self.device).unsqueeze(-1), mask, position_ids=positions,
                            past_key_values=cache, use_cache=True)
            cache, hidden, positions = step.past_key_values, step.last_hidden_state[:, -1], positions + 1
        return [Generation(t, lp, reason, stop, list(p)) for t, lp, (reason, stop), p in zip(tokens, logprobs, ended, prompts)]

    def _prefill(self, prompts: list[list[int]]):
        """Each distinct prompt's keys and values, computed once and copied to every row that reads it (a
        prompt's ``rollout.n`` samples share it): (each row's last hidden state [rows, H], the cache, each
        row's attention mask, left-padded)."""
        distinct: dict[tuple[int, ...], int] = {}
        rows = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        width = max(map(len, distinct))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in distinct], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in distinct], device=self.device)
        out = backbone(self.model, ids, mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True)
        index = torch.tensor(rows, device=self.device)
        cache = out.past_key_values
        cache.reorder_cache(index)
        return out.last_hidden_state[index, -1], cache, mask[index]

    def _ended(self, tokens: list[int], request: SamplingRequest) -> tuple[str, int | str | None] | None:
        """(finish reason, stop reason) once the response so far ends, else None: a stop token (its id as
        the reason where the request named it, None for the model's end token), a stop string the last
        token completed, or the length cap."""
        last = tokens[-1]
        if last in request.stop_token_ids:
            return "stop", last
        if last in self.eos:
            return "stop", None
        if request.stop:
            # Only text the last token can have completed: a tail long enough for the longest string.
            window = tokens[-(max(map(len, request.stop)) + 8):]
            tail = self.tok.decode(window, skip_special_tokens=False)
            previous = self.tok.decode(window[:-1], skip_special_tokens=False)
            for s in request.stop:
                if s in tail and s not in previous:
                    return "stop", s
        if len(tokens) >= request.max_tokens:
            return "length", None
        return None


def draw(raw: torch.Tensor, requests: list[SamplingRequest], generators: list[torch.Generator]) -> list[int]:
    """The next token of each row from its raw log-probs ([rows, V]): the largest at temperature 0, else
    drawn by the processed distribution (:func:`processed_logits`) with one uniform number from the row's
    generator, by inverting the distribution's cumulative sum in float64 (a token of probability 0 is
    never drawn; 20 times faster than ``torch.multinomial`` at a 262k vocabulary). Rows of the same
    settings (the usual case: one call's requests differ in their seeds and lengths) are processed together."""
    settings = {(r.temperature, r.top_k, r.top_p, tuple(sorted((r.banned or {}).items()))) for r in requests}
    logits = processed_logits(raw, requests[0]) if len(settings) == 1 else torch.stack([processed_logits(x, r) for x, r in zip(raw, requests)])
    greedy = torch.tensor([r.temperature == 0 for r in requests], device=raw.device)
    if bool(greedy.all()):  # the held-out evaluation: no distribution to invert, no draw to make
        return logits.argmax(-1).tolist()
    cdf = logits.softmax(-1).double().cumsum(-1)
    u = torch.stack([torch.rand((), generator=g, device=raw.device, dtype=torch.float64) for g in generators]) * cdf[:, -1]
    drawn = torch.searchsorted(cdf, u.unsqueeze(-1), right=True).squeeze(-1).clamp(max=raw.shape[-1] - 1)
    return torch.where(greedy, logits.argmax(-1), drawn).tolist()


def processed_logits(raw: torch.Tensor, request: SamplingRequest) -> torch.Tensor:
    """What a token is drawn from, given raw log-probs ([..., V]: one position's, or a row's each),
    processed in vLLM's order: the request's bias added, then divided by its temperature (0: left as
    they are, the largest is taken), then every token below the k-th largest removed (top-k), then
    every token outside the smallest set of the largest whose probability reaches p (top-p); removed
    tokens get -inf."""
    logits = raw
    if request.banned:
        bias = torch.zeros(raw.shape[-1], device=raw.device, dtype=raw.dtype)
        bias[torch.tensor(list(request.banned), device=raw.device)] = torch.tensor(list(request.banned.values()), device=raw.device, dtype=raw.dtype)
        logits = logits + bias
    if request.temperature == 0:
        return logits
    logits = logits / request.temperature
    if 0 < request.top_k < logits.shape[-1]:
        kth = logits.topk(request.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if request.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        outside = probs.cumsum(-1) - probs >= request.top_p  # the mass ranked above a token already reaches p
        logits = logits.masked_fill(outside.scatter(-1, order, outside), -torch.inf)
    return logits
