"""Eval: verifiable-reward accuracy of a model on held-out prompts with vLLM.

Prompts are rendered and stopped exactly as rollout does (:mod:`gndpo.stages.text.chat`). pass@1 is the
greedy response's reward. pass@k draws n >= k samples per prompt (temperature 1, seeded per prompt and
sample) and uses the unbiased estimator of Chen et al. (2021), averaged over prompts:

    pass@k = 1 - C(n - c, k) / C(n, k),   c = samples with reward > 0.
"""

from __future__ import annotations

from math import comb

import pyarrow as pa

from gndpo.errors import GndpoError
from gndpo.pipeline.config.schema import DataConfig, EngineConfig
from gndpo.pipeline.observe import progress
from gndpo.pipeline.run.images import RunImages, image_ids
from gndpo.pipeline.run.seeds import derived_seed
from gndpo.stages.models.live import LiveModels
from gndpo.stages.models.loading import load_tokenizer, unsampleable
from gndpo.stages.models.vllm_engine import resolve_max_model_len, shutdown_llm
from gndpo.stages.text.agent import Conversation, ToolUse, run_conversations
from gndpo.stages.text.chat import render_prompt, stop_token_ids

EVAL_SCHEMA = pa.schema(
    [("prompt_id", pa.string()), ("prompt", pa.string()), ("answer", pa.string()), ("response", pa.string()), ("reward", pa.float64())]
)


def _responses(llm, tok, rows: list[dict], rendered: list, samples: int, max_tokens: int, data: DataConfig,
               tool_use: ToolUse | None, temperature: float, images: RunImages | None = None) -> list[Conversation]:
    """``samples`` finished conversations per row (``rendered``: its :func:`render_prompt`), row by row:
    stopped as rollout does, with the run's tools when it has them; greedy (temperature 0) or seeded
    per prompt and sample. ``images``: where the rows' pictures are (a run's)."""
    from vllm import SamplingParams

    stops = stop_token_ids(tok, data)
    banned = unsampleable(tok.name_or_path) if images else None  # the model folder's image placeholders
    conversations = [
        Conversation(r, p.token_ids, derived_seed("eval", r.get("prompt_id") or r["prompt"], s), images.of(r) if images else [])
        for r, p in zip(rows, rendered) for s in range(samples)
    ]

    def sampling(seed: int, turn_max: int, extra_stops: list[str]):
        return SamplingParams(temperature=temperature, max_tokens=turn_max, seed=seed, stop_token_ids=stops, logit_bias=banned,
                              stop=extra_stops or None, include_stop_str_in_output=bool(extra_stops))

    label = "eval greedy" if temperature == 0 else f"eval {samples} samples per prompt"
    with progress.task(label, total=len(conversations), unit="responses") as bar:
        run_conversations(llm, tok, conversations, data, tool_use, max_tokens, sampling,
                          on_turn=lambda ended: bar.advance(len(ended), tokens=sum(len(c.response_ids) for c in ended)))
    return conversations


def greedy_eval(llm, tok, rows: list[dict], reward, max_tokens: int, data: DataConfig, tool_use: ToolUse | None = None,
                images: RunImages | None = None) -> dict:
    """Greedy pass@1 over ``rows`` (prompt-table rows): {"accuracy", "n", "table"}; ``table`` holds
    one row per prompt (the rendered prompt, the response and its reward). With ``tool_use`` each
    response is a conversation with the tools and the reward reads the student's turns; ``images``:
    the run's pictures, for rows that show some."""
    out = []
    rendered = [render_prompt(tok, r, data) for r in rows]
    for r, p, c in zip(rows, rendered, _responses(llm, tok, rows, rendered, 1, max_tokens, data, tool_use, 0.0, images)):
        text = c.student_text(tok)
        shown = text if tool_use is None else tok.decode(c.response_ids)
        out.append({
            "prompt_id": r.get("prompt_id", ""), "prompt": p.text, "answer": str(r["answer"]),
            "response": shown, "reward": float(reward(text, r)),
        })
    acc = sum(o["reward"] for o in out) / max(len(out), 1)
    return {"accuracy": acc, "n": len(out), "table": pa.Table.from_pylist(out, schema=EVAL_SCHEMA)}


def unbiased_pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c of them
    correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def sample_correct(llm, tok, rows: list[dict], reward, max_tokens: int, data: DataConfig, n: int, tool_use: ToolUse | None = None,
                   images: RunImages | None = None) -> list[int]:
    """Per prompt, how many of ``n`` temperature-1 samples get a reward > 0."""
    rendered = [render_prompt(tok, r, data) for r in rows]
    conversations = _responses(llm, tok, rows, rendered, n, max_tokens, data, tool_use, 1.0, images)
    return [sum(reward(c.student_text(tok), r) > 0 for c in conversations[i * n : (i + 1) * n]) for i, r in enumerate(rows)]


def evaluate_model(
    model_path: str, rows: list[dict], reward, engine: EngineConfig, max_tokens: int, data: DataConfig, k: int = 1, n: int = 0,
    live: LiveModels | None = None, tool_use: ToolUse | None = None, images: RunImages | None = None,
) -> tuple[dict, pa.Table]:
    """Evaluate ``model_path`` on an engine from ``live`` (default: one started for this call); return
    the summary (pass@1 greedy and, for k > 1, pass@k from n >= k samples per prompt) and the per-prompt
    table. ``images``: the run's pictures, where ``rows`` show some."""
    n = n or k
    tok = load_tokenizer(model_path)
    context = resolve_max_model_len(model_path, engine)
    budget, name = (tool_use.max_response_tokens, "the tool-use budget") if tool_use else (max_tokens, "max_tokens")
    for r in rows:  # vLLM would refuse the request mid-run; say which prompt, before starting it
        length = len(render_prompt(tok, r, data).token_ids)
        if length + budget > context:
            raise GndpoError(
                f"prompt {r.get('prompt_id') or r['prompt'][:40]!r} has {length} tokens; plus {name} {budget} "
                f"that is more than the engine's max_model_len {context}"
            )
    live = live or LiveModels()
    per_prompt_images = max((len(image_ids(r)) for r in rows), default=0) if images else 0
    llm = live.student_engine(model_path, engine, seed=0, images=per_prompt_images)
    greedy = greedy_eval(llm, tok, rows, reward, max_tokens, data, tool_use, images)
    table = greedy["table"].rename_columns(["prompt_id", "prompt", "answer", "greedy_response", "greedy_reward"])
    summary = {"model": model_path, "prompts": greedy["n"], "pass@1": greedy["accuracy"]}
    if k > 1:
        correct = sample_correct(llm, tok, rows, reward, max_tokens, data, n, tool_use, images)
        per_prompt = [unbiased_pass_at_k(n, c, k) for c in correct]
        summary.update({"samples_per_prompt": n, f"pass@{k}": sum(per_prompt) / max(len(per_prompt), 1)})
        table = table.append_column("samples", pa.array([n] * len(rows), pa.int32()))
        table = table.append_column("correct", pa.array(correct, pa.int32()))
        table = table.append_column(f"pass@{k}", pa.array(per_prompt, pa.float64()))
    if not live.keep:
        shutdown_llm(llm)
    return summary, table
