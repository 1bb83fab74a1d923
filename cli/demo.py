from typing import List, Optional

import typer

from gndpo.cli.common import echo_table, rounds_of, settings_with, split_settings, stdout_kept_for_data, user_errors
from gndpo.errors import GndpoError


@user_errors(resumable=True)
def demo(
    arguments: Optional[List[str]] = typer.Argument(
        None, metavar="FOLDER|KEY=VALUE", show_default=False,
        help="Where to put the demo's config and run folder (default demo-run), then settings, e.g. method.name=opd rollout.n=2.",
    ),
    rounds: Optional[int] = typer.Option(None, "--rounds", min=1, help="Rounds to run (default 3)."),
    old_rounds: Optional[int] = typer.Option(None, "-n", min=1, hidden=True, help="Old spelling of --rounds."),
    old_settings: Optional[List[str]] = typer.Option(None, "--set", hidden=True, help="Old spelling of KEY=VALUE (repeatable)."),
    assets: Optional[str] = typer.Option(None, "--assets", help="Use this prebuilt toy assets folder instead of building."),
    task: str = typer.Option("addition", "--task", help="addition (the default), tools (multiplication with a calculator, multi-turn) cross-tokenizer "
        "(addition with a teacher whose tokenizer merges doubled digits) or self-distill (SmolLM2-135M-Instruct learns the answer format "
        "it follows when it reads three demonstrations; needs the real-models packages) or privileged (SmolLM2-135M-Instruct answers "
        "factual questions, its teacher is itself reading the answer; real-models packages) or vision (a tiny Idefics3 reads a bar chart and adds its bars)."),
):
    """Build (or reuse) the toy teacher/student and run the pipeline end to end on them."""
    from gndpo.apps.demo import run_demo  # at call time: torch and transformers load only for this command

    folders, settings = split_settings(arguments)
    if len(folders) > 1:
        raise GndpoError(f"demo takes one FOLDER, got {' '.join(folders)}; settings are written key=value")
    settings = settings_with(settings, old_settings)
    rounds = rounds_of(rounds, old_rounds)
    with stdout_kept_for_data():
        table = run_demo(folders[0] if folders else "demo-run", rounds, settings, assets=assets, task=task)
    echo_table(table)
