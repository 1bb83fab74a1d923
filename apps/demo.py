"""`gndpo demo`: the whole pipeline on the embedded default, end to end, with a before/after table."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import yaml

from gndpo.apps.demos.arithmetic import ensure_cross_tokenizer_assets, ensure_toy_assets
from gndpo.apps.demos.privileged import CONTEXT as ANSWER_CONTEXT
from gndpo.apps.demos.privileged import ensure_privileged_assets
from gndpo.apps.demos.self_distill import context_messages, ensure_self_distill_assets
from gndpo.apps.demos.tool_task import ensure_tool_toy_assets
from gndpo.apps.demos.vision import ensure_vision_toy_assets
from gndpo.apps.evaluation import evaluate
from gndpo.apps.fork import fork_refusal, fork_run
from gndpo.apps.init import init_run
from gndpo.apps.loop import run_loop
from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import build_config
from gndpo.pipeline.observe.logs import info
from gndpo.pipeline.observe.metrics import collect_metrics, round_metrics
from gndpo.pipeline.run.run import open_run
from gndpo.pipeline.settings.schema import SELF_TEACHER
from gndpo.stages.models.live import LiveModels

DEFAULT_CONFIG = Path(__file__).with_name("demo.yaml")


def toy_models(assets: Path) -> dict:
    """A toy assets folder's models: its own student and teacher."""
    return {"student": str(assets / "student"), "teacher": str(assets / "teacher")}


def self_distill_models(assets: Path) -> dict:
    """SmolLM2 (converted from its package, named by the task's info.json) as student and, reading
    the demonstrations, as its own frozen teacher."""
    return {"student": json.loads((assets / "info.json").read_text())["student"], "teacher": SELF_TEACHER,
            "teacher_context": {"messages": context_messages()}}


def privileged_models(assets: Path) -> dict:
    """SmolLM2 as student and, reading the reference answer, as its own frozen teacher."""
    return {**self_distill_models(assets), "teacher_context": {"messages": ANSWER_CONTEXT}}


# task -> (its experiment config, the function that builds or finds its assets, config overrides,
# the models and settings the assets give the config)
TASKS = {
    "addition": (DEFAULT_CONFIG, ensure_toy_assets, [], toy_models),
    "tools": (Path(__file__).with_name("demo_tools.yaml"), ensure_tool_toy_assets, [], toy_models),
    # The addition task with a teacher whose tokenizer merges doubled digits.
    "cross-tokenizer": (DEFAULT_CONFIG, ensure_cross_tokenizer_assets, ["score.cross_tokenizer=true"], toy_models),
    # SmolLM2-135M-Instruct distils demonstrations it reads as a teacher into its bare behaviour.
    "self-distill": (Path(__file__).with_name("demo_self_distill.yaml"), ensure_self_distill_assets, [], self_distill_models),
    # SmolLM2-135M-Instruct answers factual questions; its teacher is itself, having read the answer.
    "privileged": (Path(__file__).with_name("demo_privileged.yaml"), ensure_privileged_assets, [], privileged_models),
    # A tiny Idefics3 (SmolVLM family) reads two bars of a chart and adds them.
    "vision": (Path(__file__).with_name("demo_vision.yaml"), ensure_vision_toy_assets, [], toy_models),
}


def demo_config_data(assets: Path, config: Path = DEFAULT_CONFIG, models=toy_models) -> dict:
    """The demo's experiment config on ``assets``: the task's YAML with the assets' models and prompts."""
    data = yaml.safe_load(config.read_text())
    data.update(models(assets))
    data["data"] = {"train": str(assets / "train.jsonl"), "heldout": str(assets / "heldout.jsonl")}
    return data


def write_demo_config(folder: Path, assets: Path, config: Path = DEFAULT_CONFIG, models=toy_models, data: dict | None = None) -> Path:
    """``folder/config.yaml``: ``data``, or :func:`demo_config_data`'s."""
    data = demo_config_data(assets, config, models) if data is None else data
    path = folder / "config.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def demo_table(metrics: list[dict], final_accuracy: float, teacher_accuracy: float) -> list[dict]:
    """One row per policy version: held-out accuracy, and what the round that produced it measured."""
    rounds = round_metrics(metrics)
    rows = [{"model": "teacher", "heldout_acc": teacher_accuracy}]
    for m in rounds:
        rows.append({"model": "student (start)" if m.round == 0 else f"student after round {m.round}", "heldout_acc": m.rollouts.get("heldout_accuracy")})
    if rounds and rounds[-1].trained:
        rows.append({"model": f"student after round {len(rounds)}", "heldout_acc": final_accuracy})
    for row, m in zip(rows[1:], rounds):
        if m.statistics:
            row["reward_mean"] = m.statistics["reward_mean"]
            row["kl_est"] = m.statistics["reverse_kl_estimate"]
        if m.trained:
            row["grad_norm_max"] = m.policy["grad_norm_max"]
        if m.rollouts.get("tool_calls/per_response"):  # the tool task: how the student used the tool
            row["tool_calls"] = m.rollouts["tool_calls/per_response"]
            row["turns"] = m.rollouts["num_turns/mean"]
            row["tool_token_share"] = m.rollouts["tool_mask/tool_ratio"]
    return rows


def check_task(task: str) -> None:
    """Refuse, in one line, a demo task that does not exist."""
    if task not in TASKS:
        raise GndpoError(f"unknown demo task {task!r} (tasks: {', '.join(TASKS)})")


def run_demo(
    folder: str, rounds: int = 3, overrides: list[str] = (), assets: str | None = None, log=info, task: str = "addition",
    fork_from: str | None = None, live: LiveModels | None = None,
) -> list[dict]:
    """Build or reuse the ``task``'s toy assets (or use ``assets``: a folder laid out like them), run
    ``rounds`` rounds, evaluate the final student, and return the before/after table. ``fork_from``: a
    run whose round-0 rollouts this one reuses (`gndpo fork`) where its settings allow. ``live``: kept
    engines and models to use (and leave open), for a caller that runs several demos; by default the
    demo keeps its own for its rounds and closes them."""
    check_task(task)
    config, ensure_assets, task_overrides, models = TASKS[task]
    t0 = time.time()
    out = Path(folder).resolve()
    assets = Path(assets).resolve() if assets else ensure_assets(log=log)
    if not (assets / "info.json").exists():
        raise GndpoError(f"{assets} is not a toy assets folder (no info.json)")
    data = demo_config_data(assets, config, models)
    # Checked before anything is written: a bad --set leaves no folder behind.
    cfg = build_config(copy.deepcopy(data), [*task_overrides, *overrides], Path.cwd())
    info = json.loads((assets / "info.json").read_text())
    log(f"toy assets: {assets} (teacher {info['teacher_heldout_accuracy']:.3f}, student {info['student_heldout_accuracy']:.3f} held-out exact match)")
    write_demo_config(out, assets, data=data)
    run_url = str(out / "run")
    if not fork_from:
        init_run(run_url, cfg)
    elif (refusal := fork_refusal(fork_from, 0, cfg)) is not None:
        log(f"round 0 rollouts: sampled anew ({refusal})")
        init_run(run_url, cfg)
    else:
        fork_run(fork_from, run_url, 0, cfg=cfg)
        log(f"round 0 rollouts: reused from {fork_from}")
    # One vLLM engine, teacher and DeepSpeed engine serve every round and the final evaluation.
    own = live is None
    live = LiveModels(keep=True, log=log) if own else live
    try:
        run_loop(run_url, rounds, log=log, live=live)
        final = evaluate(run_url, str(out / "eval"), live=live)
    finally:
        if own:
            live.close()
    rows = demo_table(collect_metrics(open_run(run_url)), final["pass@1"], info["teacher_heldout_accuracy"])
    log(f"demo finished in {time.time() - t0:.0f}s; run folder {run_url}")
    return rows
