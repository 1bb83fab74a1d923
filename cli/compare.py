from typing import List, Optional

import typer

from gndpo.cli.common import echo_table, stdout_kept_for_data, user_errors


@user_errors
def compare(
    methods: List[str] = typer.Argument(..., help="Methods to run, e.g. opd gndpo gdpo reverse_kl; per-method overrides with +key=value."),
    out: str = typer.Option("compare-run", "--out", help="Folder for the runs, compare.json and compare.md."),
    rounds: int = typer.Option(3, "--rounds", "-n", min=1, help="Rounds to run."),
    overrides: Optional[List[str]] = typer.Option(None, "--set", help="Config override for every method (repeatable)."),
    assets: Optional[str] = typer.Option(None, "--assets", help="Use this prebuilt toy assets folder instead of building."),
    seeds: int = typer.Option(1, "--seeds", min=1, help="Rollout seeds per method (rollout.seed 0..N-1); cells give mean and standard deviation."),
    task: str = typer.Option("addition", "--task", help="The demo task every method runs (see gndpo demo --task): addition (the default), "
        "tools, cross-tokenizer or self-distill."),
    keep_rounds: Optional[int] = typer.Option(None, "--keep-rounds", help="As each run finishes, remove its older rounds' policies and "
        "optimizer state, keeping the newest N (as gndpo gc --keep-rounds; a real model keeps about 2 GB a round)."),
):
    """Run several methods on a demo task for the same rounds; print held-out scores and stability."""
    from gndpo.apps.compare import run_compare  # at call time: torch and transformers load only for this command

    with stdout_kept_for_data():
        table = run_compare(methods, out, rounds, overrides or [], assets=assets, seeds=seeds, task=task, keep_rounds=keep_rounds)
    echo_table(table)
