"""The stage commands, one per registered stage (rollout, score, normalize, train): each runs one stage
of one round."""

from typing import Optional

import typer

from gndpo.apps.rounds import Stay, run_stage
from gndpo.cli.common import stdout_kept_for_data, user_errors
from gndpo.errors import GndpoError
from gndpo.stages.registry import STAGE_REGISTRY


def _stage_command(stage: str):
    @user_errors(resumable=True)
    def command(
        run: str = typer.Argument(..., help="Run folder (local path or fsspec URL)."),
        round: Optional[int] = typer.Option(None, "--round", "-r", min=0, help="Round index, from 0."),
        rounds: Optional[int] = typer.Option(
            None, "--rounds", min=1, help="Instead of --round: stay, working this stage in every round up to this many "
            "(each once what it reads is committed), with the models loaded once."),
        ahead: int = typer.Option(0, "--ahead", min=0, help="With --rounds, rollout: how many rounds it may run ahead of train."),
        worker: bool = typer.Option(False, "--worker", help="Join other workers: exit when nothing is left to claim."),
        lease_ttl: float = typer.Option(120.0, "--lease-ttl", help="Seconds without a heartbeat after which others may take a unit."),
        follow: bool = typer.Option(False, "--follow", help="score: start while rollout still runs, scoring each rollout unit once it commits."),
        final: bool = typer.Option(False, "--final", help="With --round: the run's last round (train writes no optimizer state after it "
                                   "unless train.final_state; a later round rebuilds it by replay)."),
    ):
        if (round is None) == (rounds is None):
            raise GndpoError("give one of --round K (one round) and --rounds N (stay for rounds 0 to N-1)")
        if final and rounds is not None:
            raise GndpoError("--final marks one round (--round K) as the run's last; with --rounds N the last is N-1")
        if rounds is not None:
            from gndpo.apps.workers import work_rounds  # at call time: it imports torch, which registering the commands must not

            if lease_ttl <= 0:
                raise GndpoError("--lease-ttl must be positive")
            with stdout_kept_for_data():
                work_rounds(run, stage, Stay(rounds, ahead), follow=follow, lease_ttl=lease_ttl)
            typer.echo(f"{stage}: rounds 0-{rounds - 1} committed")
            return
        with stdout_kept_for_data():
            manifest = run_stage(run, stage, round, worker=worker, lease_ttl=lease_ttl, follow=follow, final=final)
        if manifest is None:
            typer.echo(f"{stage} r{round}: no unit left to claim; other workers are finishing")
        else:
            typer.echo(f"{stage} r{round}: committed, {manifest.rows} rows")

    command.__doc__ = STAGE_REGISTRY[stage].help
    return command


# stage -> its command; cli.app registers them
STAGE_COMMANDS = {stage: _stage_command(stage) for stage in STAGE_REGISTRY}
