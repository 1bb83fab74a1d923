from pathlib import Path
from typing import Optional

import typer

from gndpo.cli.app import app
from gndpo.cli.common import user_errors
from gndpo.errors import GndpoError
from gndpo.pipeline.toys.real_models import PACKAGED, convert_gguf, ensure_real_model, packaged_gguf


@app.command()
@user_errors
def convert(
    source: str = typer.Argument(..., help=f"A .gguf file, or a packaged model: {', '.join(PACKAGED)}."),
    out: Optional[str] = typer.Argument(None, help="The Hugging Face folder to write (default for a packaged model: its cached folder)."),
):
    """Turn a GGUF model into a Hugging Face folder (safetensors, tokenizer, chat template) gndpo can train.

    Prints the folder's path on stdout."""
    if source in PACKAGED and out is None:
        typer.echo(str(ensure_real_model(source)))
        return
    if out is None:
        raise GndpoError("give the folder to write the converted model into (OUT)")
    gguf = Path(source) if source not in PACKAGED else None
    target = Path(out)
    if target.exists() and any(target.iterdir()):
        raise GndpoError(f"{out} exists and is not empty; give a new folder")
    target.mkdir(parents=True, exist_ok=True)
    if gguf is None:
        gguf = packaged_gguf(source)
    convert_gguf(gguf, target)
    typer.echo(str(target))
