"""Reading a config: a YAML file, ``key=value`` overrides, and model and data paths made absolute (the
file's relative to the file's folder, an override's relative to the current folder, as a shell user
expects); the result is built and checked by :func:`config_from_dict`."""

from __future__ import annotations

from pathlib import Path

import yaml

from gndpo.errors import GndpoError
from gndpo.pipeline.config.checks import check_combinations
from gndpo.pipeline.config.validate import build
from gndpo.pipeline.settings.schema import RUN_TEACHER, SELF_TEACHER, Config, split_run_teacher
from gndpo.pipeline.tasks.plugins import use_plugin_dirs


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
    """Read a YAML config and apply overrides. Relative model and data paths in the file resolve against
    the file's folder, those in overrides against the current folder. User plugins (rewards, tools named
    ``module:function``) import from ``plugin_dirs``: by default the config file's folder and the current
    folder, recorded as absolute paths so every later stage and worker imports them from there too."""
    data: dict = {}
    cwd = Path.cwd()
    base = cwd
    if path:
        p = Path(path)
        if not p.is_file():
            raise GndpoError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise GndpoError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise GndpoError(f"config file {path} must be a mapping of settings, got {type(data).__name__}")
        base = p.resolve().parent
    data = resolve_paths(data, base)
    dirs = data.get("plugin_dirs") or [str(base), str(cwd)]
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        raise GndpoError(f"plugin_dirs must be a list of folders, got {dirs!r}")
    data["plugin_dirs"] = list(dict.fromkeys(str((base / Path(d).expanduser()).resolve()) for d in dirs))
    use_plugin_dirs(data["plugin_dirs"])
    return build_config(data, overrides, cwd)


def build_config(data: dict, overrides: list[str], base: Path) -> Config:
    """The checked config of ``data`` (a YAML file's content) with ``overrides`` applied, its relative
    model and data paths resolved against ``base``."""
    return config_from_dict(resolve_paths(apply_overrides(data, list(overrides)), base))


def override_config(cfg: Config, overrides: list[str]) -> Config:
    """``cfg`` (a run's frozen config, say) with ``overrides`` applied, their relative paths resolved
    against the current folder as on the command line; ``cfg`` itself where there are none."""
    return build_config(cfg.to_dict(), overrides, Path.cwd()) if overrides else cfg


# Settings that name a local model or data file: (section or None, key).
PATH_KEYS = ((None, "student"), (None, "teacher"), ("data", "train"), ("data", "heldout"))


def resolve_paths(data: dict, base: Path) -> dict:
    """``data`` with its relative model and data paths (``student``, ``teacher`` unless ``self``, every
    entry of ``teachers``, ``data.train``, ``data.heldout``) made absolute against ``base``; values of
    the wrong type are left for the schema to refuse."""
    data = dict(data)
    for section, key in PATH_KEYS:
        node = data if section is None else data.get(section)
        if isinstance(node, dict) and isinstance(node.get(key), str) and node[key] != SELF_TEACHER:
            if section is not None:
                node = data[section] = dict(node)
            node[key] = _resolve(node[key], base)
    if isinstance(data.get("teachers"), dict):
        data["teachers"] = {name: _resolve(v, base) if isinstance(v, str) else v for name, v in data["teachers"].items()}
    return data


def _resolve(value: str, base: Path) -> str:
    """Local relative paths become absolute; URLs (s3://...) and hub ids are left alone."""
    if value.startswith(RUN_TEACHER):  # another run's policy: the run's folder resolves as a path, @K stays
        run, version = split_run_teacher(value)
        return f"{RUN_TEACHER}{_resolve(run, base)}{'@' if version else ''}{version}"
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
    """``cfg`` as YAML, its keys in the schema's order (what run.yaml holds)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def config_from_dict(data: dict) -> Config:
    """A Config from nested mappings: unknown keys, wrong types, values out of range and settings that
    contradict each other are one-line GndpoErrors naming the key."""
    cfg = build(Config, outcome_rewards_default(data), "")
    check_combinations(cfg)
    return cfg


def outcome_rewards_default(data: dict) -> dict:
    """``data`` with ``method.outcome.rewards``, when it is not given, set to the run's own ``reward``: a
    run graded with ``reward: math`` trains GRPO on math, not on the schema's ``exact_match`` (which on
    chat answers scores every response 0, and every advantage with it). Malformed sections are left
    for :func:`_build` to refuse."""
    if not isinstance(data, dict) or "reward" not in data:
        return data
    method = {} if data.get("method") is None else data["method"]
    if not isinstance(method, dict):
        return data
    outcome = {} if method.get("outcome") is None else method["outcome"]
    if not isinstance(outcome, dict) or "rewards" in outcome:
        return data
    return {**data, "method": {**method, "outcome": {**outcome, "rewards": [data["reward"]]}}}
