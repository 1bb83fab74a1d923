from typing import Optional

import typer

from gndpo.cli.common import user_errors


@user_errors
def export(
    run: str = typer.Argument(..., help="The run folder or URL."),
    out: str = typer.Argument(..., help="The folder (or URL) to create; it must not exist, or be empty."),
    policy: Optional[int] = typer.Option(None, "--policy", help="Policy version: k is the student after k trained rounds (default: the newest)."),
    adapters: bool = typer.Option(False, "--adapters", help="Only a model.lora student's adapters (PEFT format), not the merged weights."),
):
    """Copy a trained student out of RUN into OUT as a Hugging Face folder (merged weights for a LoRA
    student), or its PEFT adapters; every file checked against the run's commit record.

    Prints OUT on stdout."""
    from gndpo.apps.export import export_policy  # at call time: its constants' modules import torch

    done = export_policy(run, out, policy, adapters)
    typer.echo(f"policy v{done['version']}: {done['files']} files, {done['bytes'] / 1e6:,.1f} MB", err=True)
    typer.echo(out)
