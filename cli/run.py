import typing
from typing import Optional

import typer

from gndpo.cli.common import rounds_of, stdout_kept_for_data, user_errors
from gndpo.errors import GndpoError
from gndpo.pipeline.observe.metrics import round_summary
from gndpo.pipeline.settings.schema import RoundsConfig


@user_errors(resumable=True)
def run(
    run: str = typer.Argument(..., help="Run folder (local path or fsspec URL)."),
    rounds: Optional[int] = typer.Option(None, "--rounds", min=1, help="Total number of rounds the run should have (default 3)."),
    old_rounds: Optional[int] = typer.Option(None, "-n", min=1, hidden=True, help="Old spelling of --rounds."),
    gpus: Optional[int] = typer.Option(
        None,
        "--gpus",
        help="GPUs of this node to use (default: every visible one). Rollout and score start one worker per "
        "GPU, each logging to RUN/logs/r<round>-<stage>-gpu<i>.log (a local cache folder for s3:// runs); train "
        "runs train.num_processes ranks (0 = one per GPU). 0: one process per stage, output to the terminal.",
    ),
    learner_gpus: int = typer.Option(
        0,
        "--learner-gpus",
        min=0,
        help="Of the GPUs used, how many run score and train (the learner); rollout runs on the others, so "
        "score streams behind rollout and, with run.max_staleness, rollout of the next round runs beside train. "
        "0: every stage uses every GPU, one after another (see run.overlap).",
    ),
    overlap: Optional[str] = typer.Option(
        None,
        "--overlap",
        help="auto, on or off, in place of the run's run.overlap for this command: when stages run side by side "
        "(it never changes what they compute). Default: the run's setting.",
    ),
    keep_alive: bool = typer.Option(
        True,
        "--keep-alive/--no-keep-alive",
        help="With at most one GPU, one train rank and tensor_parallel_size 1: run every stage in this process "
        "and keep the vLLM engine (new weights are loaded into it), the teacher and the DeepSpeed engine alive "
        "across stages and rounds. --no-keep-alive starts a fresh process per stage.",
    ),
):
    """Run the round loop; stages already committed are skipped, so rerunning resumes."""
    from gndpo.apps.loop import run_loop  # at call time: torch and transformers load only for this command

    rounds = rounds_of(rounds, old_rounds)
    choices = typing.get_args(typing.get_type_hints(RoundsConfig)["overlap"])  # the setting's own choices
    if overlap is not None and overlap not in choices:
        raise GndpoError(f"--overlap must be {', '.join(choices[:-1])} or {choices[-1]}, got {overlap!r}")
    with stdout_kept_for_data():
        opened = run_loop(run, rounds, gpus=gpus, keep_alive=keep_alive, learner_gpus=learner_gpus, overlap=overlap)
    typer.echo(round_summary(opened))
