"""What a sampler is asked and what it answers, whatever samples: one student turn's request
(:class:`SamplingRequest`) and the response it gets (:class:`Generation`).

Rollout and the held-out evaluation build requests; a rollout backend (:mod:`gndpo.stages.samplers`)
turns them into its engine's own terms (vLLM's ``SamplingParams``, or the settings of gndpo's batched
decoding loop over the student's module).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingRequest:
    """One student turn: its seed (the whole randomness of the response: a backend draws every token of
    it from a generator seeded with it), its length cap and the sampling settings, processed in vLLM's
    order: ``banned`` added to the logits, then the temperature (0: greedy), then top-k and top-p."""

    seed: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    stop: tuple[str, ...] = ()  # stop strings: the turn ends with the token that completes one
    keep_stop_text: bool = False  # the stop string stays in the turn's text (a tool call's closing tag)
    stop_token_ids: tuple[int, ...] = ()  # the turn ends after one of these (EOS, the end-of-turn token)
    banned: dict[int, float] | None = field(default=None, hash=False)  # logit bias: a VLM's image placeholders


@dataclass
class Generation:
    """One sampled response: its token ids, the sampler's log-probs, why it ended, and the prompt ids
    the model read."""

    token_ids: list[int]
    # The log-prob of each generated token under the model's raw distribution (temperature 1, before
    # any bias, top-k or top-p), the number train recomputes at temperature 1.
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token or string) or "length" (max_tokens)
    stop_reason: int | str | None = None  # the stop string or stop token that ended it, if one did
    prompt_ids: list[int] | None = None  # the prompt as the model read it: with images, each one's tokens expanded
