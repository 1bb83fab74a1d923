"""Resolving what `gndpo eval` evaluates: a model folder or a run's newest student, on which prompts,
with which reward and rendering, and where the results go."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gndpo.errors import GndpoError
from gndpo.pipeline.config.schema import DataConfig, EngineConfig, RolloutConfig
from gndpo.pipeline.run.images import RunImages
from gndpo.pipeline.run.prompts import load_prompts
from gndpo.pipeline.run.run import open_run
from gndpo.pipeline.tasks.rewards import get_reward
from gndpo.stages.text.agent import ToolUse
from gndpo.stages.text.heldout_eval import evaluate_model
from gndpo.storage.runfs import RunFS
from gndpo.storage.tables import write_results


def evaluate(
    target: str, prompts: str | None, out: str, k: int = 1, n: int = 0, reward: str | None = None, max_tokens: int | None = None,
    live=None, tools: list[str] | None = None,
) -> dict:
    """Evaluate ``target`` and write ``out``/per_prompt.parquet and ``out``/summary.json; returns the
    summary. A run brings its own prompts (held-out), reward, rendering, engine and max_tokens; options
    given here override them (``tools``: the tools responses may call, default the run's; none for a
    bare model). ``live``: kept engines to evaluate on (:mod:`gndpo.stages.models.live`)."""
    if k < 1:
        raise GndpoError("--k must be at least 1")
    if n and n < k:
        raise GndpoError(f"--n ({n}) must be at least --k ({k}): pass@k needs k of n samples")
    engine, data, extra, rollout, images = EngineConfig(), DataConfig(), {}, RolloutConfig(), None
    if RunFS(target).exists("run.yaml"):
        run = open_run(target)
        images = RunImages(run.fs)
        rollout = run.cfg.rollout
        version, model = run.latest_policy()
        engine, data, extra = run.cfg.engine, run.cfg.data, {"policy_version": version}
        reward, max_tokens = reward or run.cfg.reward, max_tokens or run.cfg.rollout.max_tokens
        rows = None if prompts else run.prompts("heldout")
    else:
        if not Path(target).exists():
            raise GndpoError(f"model or run folder does not exist: {target}")
        if not (Path(target) / "config.json").exists():
            raise GndpoError(f"{target} is neither a run folder (run.yaml) nor a model folder (config.json)")
        if not prompts:
            raise GndpoError("evaluating a bare model needs --prompts FILE (a jsonl/parquet/csv with prompt or messages, and answer)")
        model, rows = target, None
        reward, max_tokens = reward or "exact_match", max_tokens or 16
    if rows is None:
        table = load_prompts(prompts, data.prompt_key, data.answer_key, data.messages_key)
        if "images" in table.columns:
            raise GndpoError(f"{prompts} has images: gndpo eval reads images from a run's own prompts only (evaluate the run folder)")
        rows = table.to_dicts()
    reward_fn = get_reward(reward)
    if tools is not None:
        rollout = dataclasses.replace(rollout, tools=list(tools))
    tool_use = ToolUse.from_config(rollout)
    summary, table = evaluate_model(model, rows, reward_fn, engine, max_tokens, data, k=k, n=n, live=live, tool_use=tool_use, images=images)
    summary = {**extra, **summary, "reward": reward}
    summary["files"] = write_results(out, table, summary)
    return summary
