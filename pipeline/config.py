"""Experiment configuration: one YAML file per experiment, ``key=value`` overrides, frozen per run.

The schema is a tree of dataclasses, so every knob has a type, a default and a docstring-able home, and an
unknown or mistyped key is a one-line error instead of a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gndpo.errors import GndpoError


@dataclass
class DataConfig:
    train: str = ""  # prompts for rollouts: jsonl / parquet / csv, any fsspec URL
    heldout: str = ""  # evaluation prompts with answers
    prompt_key: str = "prompt"
    answer_key: str = "answer"


@dataclass
class MethodConfig:
    name: str = "gndpo"  # opd | gndpo
    clamp: float = 5.0  # c_t = clamp(lpT - lpS, -clamp, clamp)
    policy_loss: str = "gspo"  # gspo | ppo | reinforce
    loss_agg: str = "seq-mean-token-mean"  # seq-mean-token-mean | token-mean
    clip_low: float = 0.2
    clip_high: float = 0.2
    std_eps: float = 1e-8


@dataclass
class RolloutConfig:
    prompts_per_round: int = 256
    n: int = 4  # samples per prompt
    prompts_per_unit: int = 64  # work-unit size; fixed by the plan, independent of worker count
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 8
    seed: int = 0
    eval_heldout: bool = True  # also log the policy's greedy held-out accuracy with the same engine


@dataclass
class ScoreConfig:
    rows_per_chunk: int = 128  # responses per forward pass; bounds memory (B x T x V per chunk)


@dataclass
class TrainConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    optimizer_steps: int = 1  # mini-batches per round (1 = one step per rollout batch, as the paper)
    micro_batch_size: int = 64  # responses per forward/backward
    grad_clip: float = 1.0
    zero_stage: int = 0
    carry_optimizer_state: bool = True  # keep AdamW moments across rounds (ZeRO-0)
    checkpoint_every: int = 8  # optimizer steps between in-round checkpoints a retry resumes from (ZeRO-0)
    num_processes: int = 1
    seed: int = 0


@dataclass
class EngineConfig:
    """vLLM engine settings shared by rollout and eval."""

    dtype: str = "float32"
    max_model_len: int = 64
    enforce_eager: bool = True
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU machines
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1


@dataclass
class Config:
    student: str = ""
    teacher: str = ""
    reward: str = "exact_match"
    data: DataConfig = field(default_factory=DataConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise GndpoError(f"config section {where or '<root>'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            raise GndpoError(f"unknown config key {where}{key}")
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            kwargs[key] = _build(typ, value or {}, f"{where}{key}.")
        else:
            kwargs[key] = _coerce(value, typ, f"{where}{key}")
    return cls(**kwargs)


def _coerce(value: Any, typ: type, name: str):
    if typ is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if typ is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise GndpoError(f"config key {name} must be {typ.__name__}, got {value!r}")
    return value


def config_from_dict(data: dict) -> Config:
    return _build(Config, data, "")


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
    data = apply_overrides(data, list(overrides))
    cfg = config_from_dict(data)
    cfg.student = _resolve(cfg.student, base)
    cfg.teacher = _resolve(cfg.teacher, base)
    cfg.data.train = _resolve(cfg.data.train, base)
    cfg.data.heldout = _resolve(cfg.data.heldout, base)
    return cfg


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
