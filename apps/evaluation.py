"""Resolving what `gndpo eval` evaluates: a model folder or a run's newest student, on which prompts,
with which reward and rendering, and where the results go."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from gndpo.apps.init import check_prompts_fit
from gndpo.errors import GndpoError
from gndpo.pipeline.run.images import RunImages
from gndpo.pipeline.run.prompts import load_prompts
from gndpo.pipeline.run.run import open_run
from gndpo.pipeline.settings.schema import DataConfig, EngineConfig, RolloutConfig
from gndpo.pipeline.tasks.rewards import get_reward
from gndpo.stages.models.vllm_engine import resolve_max_model_len
from gndpo.stages.text.agent import ToolUse
from gndpo.stages.text.heldout_eval import HeldoutTask, evaluate_model
from gndpo.storage.hub import is_hub_id, resolve_hub_model
from gndpo.storage.runfs import RunFS
from gndpo.storage.tables import write_results


@dataclass(frozen=True)
class EvalOptions:
    """What `gndpo eval` may set over a run's own (or, for a bare model, over the defaults): a prompts
    file (default: the run's held-out prompts), pass@k with n samples per prompt, the reward (default:
    the run's, else exact_match), the response budget (the run's rollout.max_tokens, else 16) and the
    tools responses may call (the run's; none for a bare model)."""

    prompts: str | None = None
    k: int = 1
    n: int = 0
    reward: str | None = None
    max_tokens: int | None = None
    tools: list[str] | None = None


@dataclass(frozen=True)
class EvalTarget:
    """The policy to evaluate and what it brings: its folder, the engine and rendering settings, the
    rollout settings its tools come from, its held-out prompts (None for a bare model) and pictures."""

    model: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: str = "exact_match"
    max_tokens: int = 16
    heldout: list[dict] | None = None
    images: RunImages | None = None
    extra: dict = field(default_factory=dict)  # recorded in the summary (a run's policy version)


def eval_target(target: str, options: EvalOptions) -> EvalTarget:
    """A run's newest policy with its settings, or a bare model (a folder or a hub id ``org/name[@rev]``,
    which needs a prompts file)."""
    if RunFS(target).exists("run.yaml"):
        run = open_run(target)
        version, model = run.latest_policy()
        heldout = None if options.prompts else run.prompts("heldout")
        if heldout == []:
            raise GndpoError(f"run {target} has no held-out prompts (no data.heldout file, and rollout.eval_heldout off or "
                             "data.heldout_share 0 at init): pass --prompts FILE")
        return EvalTarget(model, run.cfg.engine, run.cfg.data, run.cfg.rollout, run.cfg.reward, run.cfg.rollout.max_tokens,
                          heldout, RunImages(run.fs), {"policy_version": version})
    extra = {}
    if is_hub_id(target):
        resolved = resolve_hub_model(target, "model")
        target, extra = resolved.folder, {"hub_model": resolved.record()}
    if not Path(target).exists():
        raise GndpoError(f"model or run folder does not exist: {target}")
    if not (Path(target) / "config.json").exists():
        raise GndpoError(f"{target} is neither a run folder (run.yaml) nor a model folder (config.json)")
    if not options.prompts:
        raise GndpoError("evaluating a bare model needs --prompts FILE (a jsonl/parquet/csv with prompt or messages, and answer)")
    return EvalTarget(target, extra=extra)


def heldout_task(policy: EvalTarget, options: EvalOptions) -> HeldoutTask:
    """The prompts (the target's held-out ones, or ``options.prompts``), reward, budget and tools."""
    rows = policy.heldout
    if rows is None:
        data = policy.data
        table = load_prompts(options.prompts, data)
        if "images" in table.columns:
            raise GndpoError(f"{options.prompts} has images: gndpo eval reads images from a run's own prompts only (evaluate the run folder)")
        rows = table.to_dicts()
    rollout = policy.rollout if options.tools is None else dataclasses.replace(policy.rollout, tools=list(options.tools))
    return HeldoutTask(rows, get_reward(options.reward or policy.reward), options.max_tokens or policy.max_tokens, policy.data,
                       ToolUse.from_config(rollout), policy.images)


def evaluate(target: str, out: str, options: EvalOptions = EvalOptions(), live=None) -> dict:
    """Evaluate ``target`` (a run's newest policy with its own prompts, reward, rendering, engine and
    max_tokens, or a model folder) as ``options`` say, and write ``out``/per_prompt.parquet and
    ``out``/summary.json; returns the summary. ``live``: kept engines to evaluate on
    (:mod:`gndpo.stages.models.live`)."""
    if options.k < 1:
        raise GndpoError("--k must be at least 1")
    if options.n and options.n < options.k:
        raise GndpoError(f"--n ({options.n}) must be at least --k ({options.k}): pass@k needs k of n samples")
    policy = eval_target(target, options)
    task = heldout_task(policy, options)
    budget, name = (task.tool_use.max_response_tokens, "the tool-use budget") if task.tool_use else (task.max_tokens, "max_tokens")
    check_prompts_fit(policy.model, task.rows, task.data, budget, name, resolve_max_model_len(policy.model, policy.engine))
    summary, table = evaluate_model(policy.model, task, policy.engine, options.k, options.n, live)
    summary = {**policy.extra, **summary, "reward": options.reward or policy.reward}
    summary["files"] = write_results(out, table, summary)
    return summary
