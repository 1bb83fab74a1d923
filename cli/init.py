from typing import List, Optional

import typer

from gndpo.cli.common import user_errors
from gndpo.pipeline.config.load import load_config


@user_errors
def init(
    run: str = typer.Argument(..., help="Run folder: a local path or an fsspec URL (s3://bucket/run)."),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="Experiment YAML."),
    overrides: Optional[List[str]] = typer.Argument(
        None, metavar="KEY=VALUE", show_default=False, help="Settings over the config, e.g. train.lr=1e-5 (gndpo config keys lists them)."
    ),
    gpu_memory: Optional[str] = typer.Option(
        None, "--gpu-memory", help="The GPU to size each stage's memory for, e.g. 80GiB, where init runs without it (default: this machine's GPU, if any)."
    ),
    gpus: Optional[int] = typer.Option(
        None, "--gpus", min=0, help="The GPUs `gndpo run` will use on its node: train's ranks where train.num_processes is 0, "
        "for the memory estimate, and the devices the round order is chosen for (default: this machine's visible GPUs)."
    ),
):
    """Create a run: validate models and prompts, import prompts, freeze the config."""
    from gndpo.apps.init import init_run  # at call time: torch and transformers load only for this command
    from gndpo.stages.models.gpu_memory import parse_memory  # at call time, as init_run: it imports torch and transformers

    gpu_bytes = parse_memory(gpu_memory) if gpu_memory else None
    cfg = load_config(config, overrides or [])
    r = init_run(run, cfg, gpu_bytes, gpus)
    typer.echo(f"run ready: {r.fs.uri('')} (config {cfg.fingerprint()})")
