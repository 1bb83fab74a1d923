import typer

from gndpo.cli.common import user_errors
from gndpo.errors import GndpoError
from gndpo.pipeline.observe.sql import query
from gndpo.pipeline.run.run import open_run
from gndpo.storage.tables import FRAME_FORMATS, encode_frame, write_file


@user_errors
def sql(
    run: str = typer.Argument(..., help="Run folder (local path or fsspec URL)."),
    statement: str = typer.Argument(
        ..., help="One read-only statement over the views rollouts, scores, tokens, stats, metrics (each has `round`)."
    ),
    fmt: str = typer.Option("table", "--format", "-f", help=f"Output format: {' | '.join(FRAME_FORMATS)}."),
    out: str = typer.Option(None, "--out", "-o", help="Write the result to this file (any fsspec URL) instead of stdout."),
    allow_files: bool = typer.Option(
        False, "--allow-files", help="Let the query open files other than the run's committed shards (to join your own data)."
    ),
):
    """Read-only DuckDB SQL over the run's committed shards."""
    if fmt not in FRAME_FORMATS:
        raise GndpoError(f"unknown --format {fmt!r} (use one of {', '.join(FRAME_FORMATS)})")
    if fmt == "parquet" and out is None:
        raise GndpoError("--format parquet needs --out FILE")
    df = query(open_run(run), statement, allow_files=allow_files)
    data = encode_frame(df, fmt)
    if out is None:
        typer.echo(data.decode(), nl=False)
    else:
        write_file(out, data)
