"""Reading a config: a YAML file, ``key=value`` overrides, and model and data paths made absolute
relative to the file; the result is built and checked by :func:`gndpo.pipeline.config.schema.config_from_dict`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from gndpo.errors import GndpoError
from gndpo.pipeline.config.schema import SELF_TEACHER, Config, config_from_dict

def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b=value`` overrides (values parsed as YAML scalars) to a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise GndpoError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise GndpoError(f"override {key}: {part} is not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw else ""
    return data


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply overrides, and resolve model and data paths relative to the file."""
    data: dict = {}
    base = Path.cwd()
    if path:
        p = Path(path)
        if not p.is_file():
            raise GndpoError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise GndpoError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
        base = p.resolve().parent
    return build_config(data, overrides, base)


def build_config(data: dict, overrides: list[str], base: Path) -> Config:
    """The checked config of ``data`` (a YAML file's content) with ``overrides`` applied, its relative
    model and data paths resolved against ``base``."""
    cfg = config_from_dict(apply_overrides(data, list(overrides)))
    return dataclasses.replace(
        cfg,
        student=_resolve(cfg.student, base),
        teacher=cfg.teacher if cfg.teacher == SELF_TEACHER else _resolve(cfg.teacher, base),
        teachers={name: _resolve(path, base) for name, path in cfg.teachers.items()},
        data=dataclasses.replace(cfg.data, train=_resolve(cfg.data.train, base), heldout=_resolve(cfg.data.heldout, base)),
    )


def _resolve(value: str, base: Path) -> str:
    """Local relative paths become absolute; URLs (s3://...) and hub ids are left alone."""
    if not value or "://" in value:
        return value
    p = Path(value).expanduser()
    if not p.is_absolute():
        candidate = (base / p).resolve()
        # A hub id like "Qwen/Qwen3-0.6B" stays as it is unless it names an existing local path.
        if candidate.exists() or value.startswith((".", "~")) or not _looks_like_hub_id(value):
            return str(candidate)
        return value
    return str(p)


def _looks_like_hub_id(value: str) -> bool:
    return value.count("/") == 1 and not value.endswith((".jsonl", ".json", ".parquet", ".csv"))


def config_to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
