import typer

from gndpo.cli.app import app
from gndpo.cli.common import user_errors
from gndpo.pipeline.runs import open_run
from gndpo.pipeline.sql import query


@app.command()
@user_errors
def sql(
    run: str = typer.Argument(..., help="Run folder (local path or fsspec URL)."),
    statement: str = typer.Argument(..., help="One read-only statement over rollouts, scores, stats, metrics."),
    csv: bool = typer.Option(False, "--csv", help="Print CSV instead of a table."),
):
    """Read-only DuckDB SQL over the run's committed shards."""
    df = query(open_run(run), statement)
    if csv:
        typer.echo(df.write_csv(), nl=False)
    else:
        import polars as pl

        with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, fmt_str_lengths=60):
            typer.echo(df)
