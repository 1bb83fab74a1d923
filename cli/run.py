from typing import Optional

import typer

from gndpo.cli.app import app
from gndpo.cli.common import user_errors
from gndpo.pipeline.rounds import run_rounds


@app.command()
@user_errors
def run(
    run: str = typer.Argument(..., help="Run folder (local path or fsspec URL)."),
    rounds: int = typer.Option(3, "--rounds", "-n", help="Total number of rounds the run should have."),
    gpus: Optional[int] = typer.Option(
        None,
        "--gpus",
        help="GPUs of this node to use (default: every visible one). Rollout and score start one worker per "
        "GPU, each logging to RUN/logs/r<round>-<stage>-gpu<i>.log (a local cache folder for s3:// runs); train "
        "runs train.num_processes ranks (0 = one per GPU). 0: one process per stage, output to the terminal.",
    ),
):
    """Run the round loop; stages already committed are skipped, so rerunning resumes."""
    run_rounds(run, rounds, log=typer.echo, gpus=gpus)
