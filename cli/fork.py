from typing import List, Optional

import typer

from gndpo.cli.common import user_errors


@user_errors
def fork(
    run: str = typer.Argument(..., help="The run whose committed rounds the new run starts from."),
    new: str = typer.Argument(..., help="The new run folder (a local path or an fsspec URL)."),
    from_round: int = typer.Option(..., "--from-round", help="Reuse RUN's rollouts of this round (and its earlier rounds)."),
    overrides: Optional[List[str]] = typer.Argument(
        None, metavar="KEY=VALUE", show_default=False, help="Settings to change, e.g. teacher=/models/other method.name=opd."
    ),
):
    """Start a new run that re-scores RUN's committed rollouts of one round with other settings."""
    from gndpo.apps.fork import fork_run  # at call time: torch and transformers load only for this command

    r = fork_run(run, new, from_round, overrides or [])
    typer.echo(f"run ready: {r.fs.uri('')} (forked from {r.lineage['parent']} at round {from_round}; "
               f"its rollouts of round {from_round} are reused, score onwards is new)")
