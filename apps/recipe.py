"""`gndpo recipe`: runs that feed each other, in order, as one resumable command.

A recipe is a list of stages, each a run of its own under ``OUT/<stage>`` with its config and number of
rounds; a later stage names an earlier one's final policy as its teacher (``run:OUT/<stage>@<rounds>``,
:mod:`gndpo.pipeline.run.teacher_runs`), so it scores with exactly the weights that stage ended on.
Each stage is created with `gndpo init`'s checks and run with `gndpo run`'s loop, so rerunning the
recipe after a kill anywhere skips what is committed and resumes the rest: the same rows and weights
as an uninterrupted recipe. ``OUT/recipe.json`` names the stages (`gndpo report OUT` shows them all).

The one recipe so far is the sparse-to-dense principle of "Beyond GRPO and On-Policy Distillation: An
Empirical Sparse-to-Dense Reward Principle for Language-Model Post-Training": reinforce the strong
model with a sparse outcome reward (GRPO), then distill that model into the small one with a dense
token-level signal (forward-KL on-policy distillation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from gndpo.apps.init import init_run
from gndpo.apps.loop import run_loop
from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import apply_overrides, config_from_dict
from gndpo.pipeline.methods import get_method
from gndpo.pipeline.observe.logs import info
from gndpo.pipeline.settings.schema import RUN_TEACHER, SELF_TEACHER, Config

RECIPE_FILE = "recipe.json"


@dataclass(frozen=True)
class RecipeStage:
    """One stage of a recipe: a run of its own, its config and its number of rounds."""

    name: str  # its run is OUT/<name>
    rounds: int
    config: dict  # the run's config as a dict; "run:<stage>" teachers name an earlier stage
    overrides: list[str] = field(default_factory=list)


def sparse_to_dense(base: Config, rl_rounds: int, distill_rounds: int, rl_method: str = "grpo", distill_method: str = "forward_kl",
                    rl_overrides: list[str] = (), distill_overrides: list[str] = ()) -> list[RecipeStage]:
    """The two stages: ``rl_method`` on ``base``'s teacher as the policy (its own reference teacher; the
    method learns from rewards), then ``distill_method`` on ``base``'s student with stage 1's final
    policy as the teacher. Everything else (data, reward, rollout, train, the method's other settings)
    is ``base``'s."""
    if base.teacher in ("", SELF_TEACHER) or base.teachers:
        raise GndpoError("recipe sparse-to-dense: the config must name one teacher model (teacher: PATH), the model stage 1 reinforces")
    for method in (rl_method, distill_method):
        get_method(method)
    data = base.to_dict()
    rl = {**data, "student": base.teacher, "teacher": base.teacher, "method": {**data["method"], "name": rl_method}}
    distill = {**data, "teacher": f"{RUN_TEACHER}teacher-rl", "method": {**data["method"], "name": distill_method}}
    return [RecipeStage("teacher-rl", rl_rounds, rl, list(rl_overrides)), RecipeStage("distill", distill_rounds, distill, list(distill_overrides))]


def stage_configs(stages: list[RecipeStage], out: str) -> list[Config]:
    """Each stage's config, checked as a config (models and data are checked as each stage starts):
    ``run:<stage>`` teachers become references to that earlier stage's final policy."""
    names, rounds, configs = {s.name for s in stages}, {}, []

    def linked(value: str, stage: RecipeStage) -> str:
        earlier = value[len(RUN_TEACHER):] if isinstance(value, str) and value.startswith(RUN_TEACHER) else None
        if earlier not in names:
            return value
        if earlier not in rounds:
            raise GndpoError(f"recipe stage {stage.name} names stage {earlier} as its teacher, which does not run before it")
        return f"{RUN_TEACHER}{Path(out).resolve() / earlier}@{rounds[earlier]}"

    for stage in stages:
        data = apply_overrides(json.loads(json.dumps(stage.config)), stage.overrides)
        data["teacher"] = linked(data.get("teacher", ""), stage)
        data["teachers"] = {n: linked(v, stage) for n, v in (data.get("teachers") or {}).items()}
        configs.append(config_from_dict(data))
        rounds[stage.name] = stage.rounds
    return configs


def run_recipe(name: str, stages: list[RecipeStage], out: str, log=info) -> list[dict]:
    """Run ``stages`` in order under ``out``; returns, per stage, its name, run folder and rounds.
    Rerunning with the same stages resumes; ``out`` holding another recipe is refused."""
    configs = stage_configs(stages, out)
    root = Path(out)
    record = {"recipe": name, "stages": [{"name": s.name, "rounds": s.rounds, "run": s.name, "fingerprint": c.fingerprint()}
                                         for s, c in zip(stages, configs)]}
    written = root / RECIPE_FILE
    if written.exists() and json.loads(written.read_text()) != record:
        raise GndpoError(f"{out} holds another recipe or other settings ({written}); use a new folder")
    root.mkdir(parents=True, exist_ok=True)
    written.write_text(json.dumps(record, indent=1))
    for stage, cfg in zip(stages, configs):
        url = str(root / stage.name)
        log(f"recipe {name}: stage {stage.name}, {stage.rounds} rounds ({cfg.method.name}: {cfg.student})")
        init_run(url, cfg)
        run_loop(url, stage.rounds, log=log)
    return record["stages"]


def recipe_stages(out: str) -> list[dict]:
    """The stages ``out/recipe.json`` names ({name, rounds, run}), or [] where ``out`` is no recipe."""
    path = Path(out) / RECIPE_FILE
    return json.loads(path.read_text())["stages"] if path.exists() else []
