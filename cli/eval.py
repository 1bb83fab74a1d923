from typing import Optional

import typer

from gndpo.cli.common import notice, stdout_kept_for_data, user_errors
from gndpo.errors import GndpoError


@user_errors
def eval_command(
    target: str = typer.Argument(..., help="A model folder (HF format) or a run folder (its newest student)."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="Prompts file, as init accepts (default: the run's held-out)."),
    k: int = typer.Option(1, "--k", help="Also report the unbiased pass@k."),
    samples: int = typer.Option(0, "--samples", help="Samples per prompt for pass@k (default k; must be >= k)."),
    old_samples: Optional[int] = typer.Option(None, "--n", hidden=True, help="Old spelling of --samples."),
    reward: Optional[str] = typer.Option(None, "--reward", help="Reward name or module:function (default: the run's, else exact_match)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Default: the run's rollout.max_tokens, else 16."),
    tools: Optional[str] = typer.Option(
        None, "--tools", help="Comma-separated tools the model may call (built-in or module:function; default: the run's, none for a model)."
    ),
    out: str = typer.Option("eval-results", "--out", help="Folder (any fsspec URL) for per_prompt.parquet and summary.json."),
):
    """Verifiable-reward accuracy (pass@1 greedy, optional unbiased pass@k) on held-out prompts with vLLM."""
    from gndpo.apps.evaluation import EvalOptions, evaluate  # at call time: torch and transformers load only for this command

    if old_samples is not None:
        if samples and samples != old_samples:
            raise GndpoError(f"--samples {samples} and --n {old_samples} disagree; give --samples once")
        notice("--n", f"write --samples {old_samples} (--n reads like a round count)")
        samples = old_samples
    if samples and samples < k:
        raise GndpoError(f"--samples ({samples}) must be at least --k ({k}): pass@k needs k of the samples")
    tool_names = [t.strip() for t in tools.split(",") if t.strip()] if tools is not None else None
    with stdout_kept_for_data():
        result = evaluate(target, out, EvalOptions(prompts, k, samples, reward, max_tokens, tool_names))
    files = result.pop("files")
    typer.echo("  ".join(f"{key}={val:.4f}" if isinstance(val, float) else f"{key}={val}" for key, val in result.items()))
    typer.echo(f"per-prompt results: {files['per_prompt']}")
