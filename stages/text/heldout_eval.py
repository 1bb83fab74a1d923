"""Eval: verifiable-reward accuracy of a model on held-out prompts with vLLM.

Prompts are rendered and stopped exactly as rollout does (:mod:`gndpo.stages.text.chat`). pass@1 is the
greedy response's reward. pass@k draws n >= k samples per prompt (temperature 1, seeded per prompt and
sample) and uses the unbiased estimator of Chen et al. (2021), averaged over prompts:

    pass@k = 1 - C(n - c, k) / C(n, k),   c = samples with reward > 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import comb

import pyarrow as pa

from gndpo.pipeline.observe import progress
from gndpo.pipeline.run.images import RunImages, image_ids
from gndpo.pipeline.run.seeds import derived_seed
from gndpo.pipeline.settings.schema import DataConfig, EngineConfig
from gndpo.stages.models.live import LiveModels
from gndpo.stages.models.loading import load_tokenizer, unsampleable
from gndpo.stages.models.sampling import SamplingRequest
from gndpo.stages.models.vllm_engine import shutdown_llm
from gndpo.stages.samplers.base import Sampler
from gndpo.stages.samplers.vllm import VLLMSampler
from gndpo.stages.text.agent import Conversation, ToolUse, run_conversations
from gndpo.stages.text.chat import render_prompt, stop_token_ids

EVAL_SCHEMA = pa.schema(
    [("prompt_id", pa.string()), ("prompt", pa.string()), ("answer", pa.string()), ("response", pa.string()), ("reward", pa.float64())]
)


@dataclass(frozen=True)
class HeldoutTask:
    """What a policy is evaluated on: prompt-table rows with answers, the reward that grades a response
    (the student's turns where there are tools), how prompts render and stop, the response budget, the
    tools responses may call, and where the rows' pictures are (a run's)."""

    rows: list[dict]
    reward: Callable[[str, dict], float]
    max_tokens: int
    data: DataConfig
    tool_use: ToolUse | None = None
    images: RunImages | None = None


def _responses(sampler: Sampler, tok, task: HeldoutTask, rendered: list, samples: int, temperature: float) -> list[Conversation]:
    """``samples`` finished conversations per row of ``task`` (``rendered``: its :func:`render_prompt`),
    row by row: stopped as rollout does, with the task's tools when it has them; greedy (temperature 0)
    or seeded per prompt and sample."""
    images = task.images
    stops = stop_token_ids(tok, task.data)
    banned = unsampleable(tok.name_or_path) if images else None  # the model folder's image placeholders
    conversations = [
        Conversation(r, p.token_ids, derived_seed("eval", r.get("prompt_id") or r["prompt"], s), images.of(r) if images else [])
        for r, p in zip(task.rows, rendered) for s in range(samples)
    ]

    def sampling(seed: int, turn_max: int, extra_stops: list[str]):
        return SamplingRequest(seed, turn_max, temperature, stop=tuple(extra_stops), keep_stop_text=bool(extra_stops),
                               stop_token_ids=tuple(stops), banned=banned)

    label = "eval greedy" if temperature == 0 else f"eval {samples} samples per prompt"
    with progress.task(label, total=len(conversations), unit="responses") as bar:
        run_conversations(sampler, tok, conversations, task.data, task.tool_use, task.max_tokens, sampling,
                          on_turn=lambda ended: bar.advance(len(ended), tokens=sum(len(c.response_ids) for c in ended)))
    return conversations


def greedy_eval(sampler: Sampler, tok, task: HeldoutTask) -> dict:
    """Greedy pass@1 over ``task``'s rows: {"accuracy", "n", "table"}; ``table`` holds one row per
    prompt (the rendered prompt, the response and its reward). With tools each response is a
    conversation with them and the reward reads the student's turns."""
    out = []
    rendered = [render_prompt(tok, r, task.data) for r in task.rows]
    for r, p, c in zip(task.rows, rendered, _responses(sampler, tok, task, rendered, 1, 0.0)):
        text = c.student_text(tok)
        shown = text if task.tool_use is None else tok.decode(c.response_ids)
        out.append({
            "prompt_id": r.get("prompt_id", ""), "prompt": p.text, "answer": str(r["answer"]),
            "response": shown, "reward": float(task.reward(text, r)),
        })
    acc = sum(o["reward"] for o in out) / max(len(out), 1)
    return {"accuracy": acc, "n": len(out), "table": pa.Table.from_pylist(out, schema=EVAL_SCHEMA)}


def unbiased_pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c of them
    correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def sample_correct(sampler: Sampler, tok, task: HeldoutTask, n: int) -> list[int]:
    """Per prompt of ``task``, how many of ``n`` temperature-1 samples get a reward > 0."""
    rendered = [render_prompt(tok, r, task.data) for r in task.rows]
    conversations = _responses(sampler, tok, task, rendered, n, 1.0)
    return [sum(task.reward(c.student_text(tok), r) > 0 for c in conversations[i * n : (i + 1) * n]) for i, r in enumerate(task.rows)]


def evaluate_model(model_path: str, task: HeldoutTask, engine: EngineConfig, k: int = 1, n: int = 0,
                   live: LiveModels | None = None) -> tuple[dict, pa.Table]:
    """Evaluate ``model_path`` on ``task`` on an engine from ``live`` (default: one started for this
    call); return the summary (pass@1 greedy and, for k > 1, pass@k from n >= k samples per prompt)
    and the per-prompt table. The caller has checked that the prompts fit the engine's context
    (:func:`gndpo.apps.init.check_prompts_fit`)."""
    n = n or k
    tok = load_tokenizer(model_path)
    live = live or LiveModels()
    per_prompt_images = max((len(image_ids(r)) for r in task.rows), default=0) if task.images else 0
    llm = live.student_engine(model_path, engine, seed=0, images=per_prompt_images)
    sampler = VLLMSampler(llm, engine)
    greedy = greedy_eval(sampler, tok, task)
    table = greedy["table"].rename_columns(["prompt_id", "prompt", "answer", "greedy_response", "greedy_reward"])
    summary = {"model": model_path, "prompts": greedy["n"], "pass@1": greedy["accuracy"]}
    if k > 1:
        correct = sample_correct(sampler, tok, task, n)
        per_prompt = [unbiased_pass_at_k(n, c, k) for c in correct]
        summary.update({"samples_per_prompt": n, f"pass@{k}": sum(per_prompt) / max(len(per_prompt), 1)})
        table = table.append_column("samples", pa.array([n] * len(task.rows), pa.int32()))
        table = table.append_column("correct", pa.array(correct, pa.int32()))
        table = table.append_column(f"pass@{k}", pa.array(per_prompt, pa.float64()))
    if not live.keep:
        shutdown_llm(llm)
    return summary, table
