from typing import List, Optional

import typer

from gndpo.cli.common import stdout_kept_for_data, user_errors
from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import load_config

RECIPES = ("sparse-to-dense",)


@user_errors
def recipe(
    name: str = typer.Argument(..., help="sparse-to-dense: reinforce the teacher (GRPO), then distill it into the student (forward KL)."),
    out: str = typer.Argument(..., help="A local (or shared-filesystem) folder for the stages' runs (OUT/<stage>) and recipe.json; rerun to resume."),
    config: str = typer.Option(..., "--config", help="The base config: the student, the teacher stage 1 reinforces, data, reward and "
                               "the settings both stages share."),
    rl_rounds: int = typer.Option(3, "--rl-rounds", min=1, help="Rounds of stage 1 (teacher-rl)."),
    distill_rounds: int = typer.Option(3, "--distill-rounds", min=1, help="Rounds of stage 2 (distill)."),
    rl_method: str = typer.Option("grpo", "--rl-method", help="Stage 1's method.name (an outcome-reward method: grpo, gdpo)."),
    distill_method: str = typer.Option("forward_kl", "--distill-method", help="Stage 2's method.name."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help="Override in the base config (repeatable)."),
    rl_set: Optional[List[str]] = typer.Option(None, "--rl-set", help="Override for stage 1 only (repeatable), e.g. train.lr=1e-5."),
    distill_set: Optional[List[str]] = typer.Option(None, "--distill-set", help="Override for stage 2 only (repeatable)."),
):
    """Run a multi-stage recipe: each stage a run under OUT, a later one taught by an earlier one's final
    policy. Prints each stage's run folder."""
    from gndpo.apps.recipe import run_recipe, sparse_to_dense  # at call time: torch loads only for this command

    if name not in RECIPES:
        raise GndpoError(f"unknown recipe {name!r}; the recipes are: {', '.join(RECIPES)}")
    stages = sparse_to_dense(load_config(config, overrides or []), rl_rounds, distill_rounds, rl_method, distill_method,
                             rl_set or [], distill_set or [])
    with stdout_kept_for_data():
        done = run_recipe(name, stages, out)
    for stage in done:
        typer.echo(f"{stage['name']}: {out.rstrip('/')}/{stage['run']} ({stage['rounds']} rounds)")
