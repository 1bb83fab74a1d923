from typing import Optional

import typer

from gndpo.cli.common import user_errors
from gndpo.pipeline.exec.gc import check_keep_rounds, collect_garbage, prune_rounds
from gndpo.pipeline.run.run import open_run


@user_errors
def gc(
    run: str = typer.Argument(..., help="Run folder (local path or fsspec URL)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list what would be removed."),
    keep_rounds: Optional[int] = typer.Option(
        None, "--keep-rounds", help="Also remove the exported policy, EMA and optimizer state of every trained round but the newest N "
        "(at least 1). Rollouts, scores and metrics stay; fork, eval and resume then work from the kept rounds."),
):
    """Remove attempt folders that no commit record references (crashed or losing attempts, committed
    rounds' in-round checkpoints), and with --keep-rounds old rounds' policies and optimizer state."""
    if keep_rounds is not None:
        check_keep_rounds(keep_rounds)  # before anything is removed
    doing = "would remove" if dry_run else "removed"
    opened = open_run(run)
    removed = collect_garbage(opened, dry_run=dry_run)
    for path in removed:
        typer.echo(f"{doing} {path}")
    typer.echo(f"{len(removed)} unreferenced folder(s) {'to remove' if dry_run else 'removed'}")
    if keep_rounds is None:
        return
    pruned = prune_rounds(opened, keep_rounds, dry_run=dry_run)
    for p in pruned:
        typer.echo(f"{doing} round {p['round']}: {', '.join(p['folders'])} ({p['bytes'] / 1e9:.2f} GB)")
    typer.echo(f"{len(pruned)} round(s) pruned, {sum(p['bytes'] for p in pruned) / 1e9:.2f} GB {'to free' if dry_run else 'freed'}")
