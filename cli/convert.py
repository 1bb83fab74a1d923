from pathlib import Path
from typing import Optional

import typer

from gndpo.apps.demos.real_models import PACKAGED, ensure_real_model, packaged_gguf
from gndpo.cli.common import stdout_kept_for_data, user_errors
from gndpo.errors import GndpoError
from gndpo.stages.models.gguf import convert_gguf
from gndpo.storage.cache import staged_folder


@user_errors
def convert(
    source: str = typer.Argument(..., help=f"A .gguf file, or a packaged model: {', '.join(PACKAGED)}."),
    out: Optional[str] = typer.Argument(None, help="The Hugging Face folder to write (default for a packaged model: its cached folder)."),
):
    """Turn a GGUF model into a Hugging Face folder (safetensors, tokenizer, chat template) gndpo can train.

    Prints the folder's path on stdout."""
    if source in PACKAGED and out is None:
        with stdout_kept_for_data():  # what libraries print while converting (DeepSpeed's import) is not the result
            folder = ensure_real_model(source)
        typer.echo(str(folder))
        return
    if out is None:
        raise GndpoError("give the folder to write the converted model into (OUT)")
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise GndpoError(f"{out} exists and is not an empty folder; give a new folder")
    gguf = packaged_gguf(source) if source in PACKAGED else Path(source)
    if not gguf.is_file():
        raise GndpoError(f"{source} is neither a GGUF file nor a packaged model ({', '.join(PACKAGED)})")
    try:
        with staged_folder(target) as staging, stdout_kept_for_data():  # a failed conversion leaves no OUT behind
            convert_gguf(gguf, staging)
    except FileExistsError:
        raise GndpoError(f"{out} was filled by something else during the conversion; nothing was written there") from None
    typer.echo(str(target))
