from typing import List, Optional

import typer

from gndpo.cli.common import echo_table, stdout_kept_for_data, user_errors


@user_errors(resumable=True)
def demo(
    folder: str = typer.Argument("demo-run", help="Where to put the demo's config and run folder."),
    rounds: int = typer.Option(3, "--rounds", "-n", min=1, help="Rounds to run."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help="Config override key=value (repeatable)."),
    assets: Optional[str] = typer.Option(None, "--assets", help="Use this prebuilt toy assets folder instead of building."),
    task: str = typer.Option("addition", "--task", help="addition (the default), tools (multiplication with a calculator, multi-turn) cross-tokenizer "
        "(addition with a teacher whose tokenizer merges doubled digits) or self-distill (SmolLM2-135M-Instruct learns the answer format "
        "it follows when it reads three demonstrations; needs the real-models packages) or vision (a tiny Idefics3 reads a bar chart and adds its bars)."),
):
    """Build (or reuse) the toy teacher/student and run the pipeline end to end on them."""
    from gndpo.apps.demo import run_demo  # at call time: torch and transformers load only for this command

    with stdout_kept_for_data():
        table = run_demo(folder, rounds, overrides or [], assets=assets, task=task)
    echo_table(table)
