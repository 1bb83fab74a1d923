from typing import Optional

import typer

from gndpo.cli.app import app
from gndpo.cli.common import user_errors
from gndpo.pipeline.evaluation import evaluate


@app.command(name="eval")
@user_errors
def eval_command(
    target: str = typer.Argument(..., help="A model folder (HF format) or a run folder (its newest student)."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="Held-out prompts file (default: the run's)."),
    k: int = typer.Option(1, "--k", help="Also report pass@k with k samples per prompt."),
    reward: str = typer.Option("exact_match", "--reward", help="Reward function for a model without a run."),
    max_tokens: int = typer.Option(16, "--max-tokens"),
):
    """Verifiable-reward accuracy (pass@1 greedy, optional pass@k) on held-out prompts with vLLM."""
    result = evaluate(target, prompts, k=k, reward=reward, max_tokens=max_tokens)
    typer.echo("  ".join(f"{key}={val:.4f}" if isinstance(val, float) else f"{key}={val}" for key, val in result.items()))
