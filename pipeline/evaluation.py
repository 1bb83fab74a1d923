"""Resolving what `gndpo eval` evaluates: a model folder or a run's newest student, on which prompts."""

from __future__ import annotations

from pathlib import Path

from gndpo.errors import GndpoError
from gndpo.pipeline.config import EngineConfig
from gndpo.pipeline.prompts import load_prompts
from gndpo.pipeline.rewards import get_reward
from gndpo.storage.runfs import RunFS


def evaluate(target: str, prompts: str | None, k: int = 1, reward: str = "exact_match", max_tokens: int = 16) -> dict:
    from gndpo.pipeline.runs import open_run
    from gndpo.stages.eval import evaluate_model

    if k < 1:
        raise GndpoError("--k must be at least 1")
    engine = EngineConfig()
    if RunFS(target).exists("run.yaml"):
        run = open_run(target)
        version, model = run.latest_policy()
        rows = load_prompts(prompts).to_dicts() if prompts else run.prompts("heldout")
        engine, reward, max_tokens = run.cfg.engine, run.cfg.reward, run.cfg.rollout.max_tokens
        extra = {"policy_version": version}
    else:
        if not Path(target).exists():
            raise GndpoError(f"model or run folder does not exist: {target}")
        if not (Path(target) / "config.json").exists():
            raise GndpoError(f"{target} is neither a run folder (run.yaml) nor a model folder (config.json)")
        if not prompts:
            raise GndpoError("evaluating a bare model needs --prompts FILE (a jsonl/parquet/csv with prompt and answer)")
        rows, model, extra = load_prompts(prompts).to_dicts(), target, {}
    return {**extra, **evaluate_model(model, rows, get_reward(reward), engine, max_tokens, k)}
