"""The stage commands, one per registered stage (rollout, score, normalize, train): each runs one stage
of one round."""

import typer

from gndpo.apps.rounds import run_stage
from gndpo.cli.common import stdout_kept_for_data, user_errors
from gndpo.stages.registry import STAGE_REGISTRY


def _stage_command(stage: str):
    @user_errors(resumable=True)
    def command(
        run: str = typer.Argument(..., help="Run folder (local path or fsspec URL)."),
        round: int = typer.Option(..., "--round", "-r", help="Round index, from 0."),
        worker: bool = typer.Option(False, "--worker", help="Join other workers: exit when nothing is left to claim."),
        lease_ttl: float = typer.Option(120.0, "--lease-ttl", help="Seconds without a heartbeat after which others may take a unit."),
        follow: bool = typer.Option(False, "--follow", help="score: start while rollout still runs, scoring each rollout unit once it commits."),
    ):
        with stdout_kept_for_data():
            manifest = run_stage(run, stage, round, worker=worker, lease_ttl=lease_ttl, follow=follow)
        if manifest is None:
            typer.echo(f"{stage} r{round}: no unit left to claim; other workers are finishing")
        else:
            typer.echo(f"{stage} r{round}: committed, {manifest.rows} rows")

    command.__doc__ = STAGE_REGISTRY[stage].help
    return command


# stage -> its command; cli.app registers them
STAGE_COMMANDS = {stage: _stage_command(stage) for stage in STAGE_REGISTRY}
