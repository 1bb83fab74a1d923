from typing import List, Optional

import typer

from gndpo.cli.common import is_setting, notice, settings_with, stdout_kept_for_data, user_errors
from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import load_config

RECIPES = ("sparse-to-dense",)
# The stages of sparse-to-dense, as STAGE+key=value names them (their run folders are OUT/<stage>).
STAGES = ("teacher-rl", "distill")


def stage_settings(arguments: list[str]) -> dict[str, list[str]]:
    """{"": base settings, stage: that stage's own} from ``key=value`` and ``STAGE+key=value`` arguments."""
    found: dict[str, list[str]] = {"": [], **{stage: [] for stage in STAGES}}
    for argument in arguments:
        stage, plus, setting = argument.partition("+")
        if is_setting(argument):
            found[""].append(argument)
        elif plus and stage in STAGES and is_setting(setting):
            found[stage].append(setting)
        else:
            raise GndpoError(f"recipe: {argument!r} is neither key=value nor STAGE+key=value (the stages: {', '.join(STAGES)})")
    return found


@user_errors
def recipe(
    name: str = typer.Argument(..., help="sparse-to-dense: reinforce the teacher (GRPO), then distill it into the student (forward KL)."),
    out: str = typer.Argument(..., help="A local (or shared-filesystem) folder for the stages' runs (OUT/<stage>) and recipe.json; rerun to resume."),
    settings: Optional[List[str]] = typer.Argument(
        None, metavar="[STAGE+]KEY=VALUE", show_default=False,
        help="Settings over the base config, e.g. train.lr=1e-5; STAGE+key=value for one stage only, e.g. "
        "teacher-rl+method.outcome.rewards=[exact_match,answer_length] distill+method.name=reverse_kl.",
    ),
    config: str = typer.Option(..., "--config", help="The base config: the student, the teacher stage 1 reinforces, data, reward and "
                               "the settings both stages share."),
    rl_rounds: int = typer.Option(3, "--rl-rounds", min=1, help="Rounds of stage 1 (teacher-rl)."),
    distill_rounds: int = typer.Option(3, "--distill-rounds", min=1, help="Rounds of stage 2 (distill)."),
    rl_method: str = typer.Option("grpo", "--rl-method", help="Stage 1's method.name (an outcome-reward method: grpo, gdpo)."),
    distill_method: str = typer.Option("forward_kl", "--distill-method", help="Stage 2's method.name."),
    old_settings: Optional[List[str]] = typer.Option(None, "--set", hidden=True, help="Old spelling of KEY=VALUE (repeatable)."),
    old_rl: Optional[List[str]] = typer.Option(None, "--rl-set", hidden=True, help="Old spelling of teacher-rl+KEY=VALUE."),
    old_distill: Optional[List[str]] = typer.Option(None, "--distill-set", hidden=True, help="Old spelling of distill+KEY=VALUE."),
):
    """Run a multi-stage recipe: each stage a run under OUT, a later one taught by an earlier one's final
    policy. Prints each stage's run folder."""
    from gndpo.apps.recipe import run_recipe, sparse_to_dense  # at call time: torch loads only for this command

    if name not in RECIPES:
        raise GndpoError(f"unknown recipe {name!r}; the recipes are: {', '.join(RECIPES)}")
    found = stage_settings(settings or [])
    for option, stage, old in (("--rl-set", "teacher-rl", old_rl), ("--distill-set", "distill", old_distill)):
        if old:
            notice(option, f"write {stage}+key=value after the arguments")
            found[stage] = [*old, *found[stage]]
    stages = sparse_to_dense(load_config(config, settings_with(found[""], old_settings)), rl_rounds, distill_rounds, rl_method, distill_method,
                             found["teacher-rl"], found["distill"])
    with stdout_kept_for_data():
        done = run_recipe(name, stages, out)
    for stage in done:
        typer.echo(f"{stage['name']}: {out.rstrip('/')}/{stage['run']} ({stage['rounds']} rounds)")
