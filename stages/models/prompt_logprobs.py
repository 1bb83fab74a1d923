"""A teacher's prompt log-probs over stored token ids, flattened the way score stores them: the same
for a vLLM engine in this process (:func:`gndpo.stages.models.vllm_engine.response_logprobs`) and a
teacher server's JSON answer (:mod:`gndpo.stages.models.teacher_server`)."""

from __future__ import annotations

import numpy as np

# One position's answer: {token id: (rank, log-prob)}, the sampled token's and the top-k's. vLLM gives
# the sampled token its own rank (beyond k where it is not among the top-k).
Position = dict[int, tuple[int, float]]


def flat_response_logprobs(positions: list[list[Position]], responses: list[list[int]], topk: int) -> dict:
    """Flat over the responses' tokens in order: {"logprobs": [N]} (each response token's log-prob) and,
    for ``topk`` > 0, {"topk_ids": [N, k], "topk_logprobs": [N, k]}, the k largest of a position's
    log-probs, largest first (as ``torch.topk`` orders them; equal ones by id). ``positions[i]``:
    sequence ``i``'s answer at every position, its response being the last ``len(responses[i])`` of them."""
    sampled, ids, values = [], [], []
    for answer, response in zip(positions, responses):
        for entry, token in zip(answer[len(answer) - len(response):], response):
            sampled.append(entry[int(token)][1])
            if topk:
                # By value, not by the rank vLLM reports: it counts the rank apart from the values (a
                # compiled helper), and a server whose count is off puts its sampled token in the top-k
                # (vLLM's CPU server under ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine ranked a toy
                # teacher's prompt token 6th with eight larger log-probs beside it).
                ranked = sorted((-lp, tid) for tid, (rank, lp) in entry.items() if rank is not None)[:topk]
                ids.append([tid for _, tid in ranked])
                values.append([-negative for negative, _ in ranked])
    result = {"logprobs": np.asarray(sampled, np.float32)}
    if topk:
        result["topk_ids"] = np.asarray(ids, np.int32).reshape(-1, topk)
        result["topk_logprobs"] = np.asarray(values, np.float32).reshape(-1, topk)
    return result
