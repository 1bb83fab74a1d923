from typing import List, Optional

import typer

from gndpo.cli.common import echo_table, rounds_of, settings_with, split_settings, stdout_kept_for_data, user_errors
from gndpo.errors import GndpoError


@user_errors
def compare(
    arguments: List[str] = typer.Argument(
        ..., metavar="METHOD[+KEY=VALUE]|KEY=VALUE",
        help="Methods to run, e.g. opd gndpo gdpo reverse_kl; METHOD+key=value runs METHOD with its own settings (a row of its own, "
        "e.g. gdpo+method.outcome.rewards=[exact_match,answer_length]); key=value alone sets it for every method.",
    ),
    out: str = typer.Option("compare-run", "--out", help="Folder for the runs, compare.json and compare.md."),
    rounds: Optional[int] = typer.Option(None, "--rounds", min=1, help="Rounds to run (default 3)."),
    old_rounds: Optional[int] = typer.Option(None, "-n", min=1, hidden=True, help="Old spelling of --rounds."),
    old_settings: Optional[List[str]] = typer.Option(None, "--set", hidden=True, help="Old spelling of KEY=VALUE (repeatable)."),
    assets: Optional[str] = typer.Option(None, "--assets", help="Use this prebuilt toy assets folder instead of building."),
    seeds: int = typer.Option(1, "--seeds", min=1, help="Rollout seeds per method (rollout.seed 0..N-1); cells give mean and standard deviation."),
    task: str = typer.Option("addition", "--task", help="The demo task every method runs (see gndpo demo --task): addition (the default), "
        "tools, cross-tokenizer, self-distill, privileged or vision."),
    keep_rounds: Optional[int] = typer.Option(None, "--keep-rounds", help="As each run finishes, remove its older rounds' policies and "
        "optimizer state, keeping the newest N (as gndpo gc --keep-rounds; a real model keeps about 2 GB a round)."),
):
    """Run several methods on a demo task for the same rounds; print held-out scores and stability."""
    from gndpo.apps.compare import run_compare  # at call time: torch and transformers load only for this command

    methods, settings = split_settings(arguments)
    if not methods:
        raise GndpoError("compare needs at least one METHOD before the key=value settings, e.g. gndpo compare opd gndpo rollout.n=2")
    settings = settings_with(settings, old_settings)
    rounds = rounds_of(rounds, old_rounds)
    with stdout_kept_for_data():
        table = run_compare(methods, out, rounds, settings, assets=assets, seeds=seeds, task=task, keep_rounds=keep_rounds)
    echo_table(table)
