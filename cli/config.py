"""``gndpo config show`` and ``gndpo config keys``: a config with every default filled in, and every key
the schema declares (cli.app groups them under ``gndpo config``)."""

from pathlib import Path
from typing import List, Optional

import typer

from gndpo.cli.common import split_settings, user_errors
from gndpo.errors import GndpoError, did_you_mean
from gndpo.pipeline.config.keys import KeyDoc, config_keys
from gndpo.pipeline.config.load import config_to_yaml, load_config, override_config
from gndpo.pipeline.run.run import open_run
from gndpo.pipeline.settings.schema import Config

CONFIG_SUFFIXES = (".yaml", ".yml")


def resolved_config(source: str | None, settings: list[str]) -> Config:
    """The config of ``source`` (a YAML file; a run folder or URL, or its run.yaml; None: the defaults)
    with ``settings`` applied."""
    if source is not None and Path(source).name == "run.yaml":
        return override_config(open_run(source[: -len("run.yaml")] or ".").cfg, settings)
    if source is None or Path(source).is_file() or (source.endswith(CONFIG_SUFFIXES) and "://" not in source):
        return load_config(source, settings)
    return override_config(open_run(source).cfg, settings)


@user_errors
def show(
    arguments: Optional[List[str]] = typer.Argument(
        None, metavar="CONFIG_OR_RUN|KEY=VALUE", show_default=False,
        help="A config YAML file, or a run folder or URL (its frozen config); none: the defaults. Then settings, e.g. train.lr=1e-5.",
    ),
):
    """Print the whole config, every default filled in, as YAML `gndpo init --config` reads back (the
    same config fingerprint)."""
    sources, settings = split_settings(arguments)
    if len(sources) > 1:
        raise GndpoError(f"config show takes one CONFIG_OR_RUN, got {' '.join(sources)}; settings are written key=value")
    typer.echo(config_to_yaml(resolved_config(sources[0] if sources else None, settings)), nl=False)


def key_lines(docs: list[KeyDoc]) -> list[str]:
    """One aligned line per key: key, type, default, allowed values, description."""
    rows = [(d.key, d.type, d.default, d.allows or "-", d.description) for d in docs]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return ["  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[4]]).rstrip() for row in rows]


@user_errors
def keys(
    prefix: Optional[str] = typer.Argument(None, help="Only the keys that start with it, e.g. rollout or train.lr."),
):
    """List every config key: its type, default, range or choices, and what it does (from the schema,
    pipeline/settings/schema.py)."""
    docs = config_keys()
    chosen = [d for d in docs if prefix is None or d.key.startswith(prefix)]
    if not chosen:
        raise GndpoError(f"no config key starts with {prefix!r}{did_you_mean(prefix, [d.key for d in docs])}")
    for line in key_lines(chosen):
        typer.echo(line)
