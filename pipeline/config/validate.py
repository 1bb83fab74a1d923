"""Building a settings tree from nested mappings, checked against the schema's declarations."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Annotated, Any, Literal

from gndpo.errors import GndpoError, did_you_mean
from gndpo.pipeline.config.keys import choices_text, describe_type


def build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise GndpoError(f"config section {where.rstrip('.') or '<root>'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls, include_extras=True)
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            raise GndpoError(f"unknown config key {where}{key}{did_you_mean(str(key), hints, where)}")
        typ, checks = hints[key], ()
        if typing.get_origin(typ) is Annotated:
            typ, *checks = typing.get_args(typ)
        if dataclasses.is_dataclass(typ):
            # An empty section (``rollout:`` with nothing under it) is its defaults; anything else that is
            # not a mapping is a mistake (``rollout=0`` would otherwise reset every rollout setting).
            kwargs[key] = build(typ, {} if value is None else value, f"{where}{key}.")
            continue
        kwargs[key] = _coerce(value, typ, f"{where}{key}")
        for check in checks:
            problem = check.violation(kwargs[key])
            if problem:
                raise GndpoError(f"config key {where}{key} {problem}, got {value!r}")
    return cls(**kwargs)


def _coerce(value: Any, typ: type, name: str):
    """``value`` as a ``typ``, or a GndpoError naming the key. A scalar is converted where YAML may have
    read it as another (a number for a string, "1e-4" for a float); the items of a list or a mapping are
    checked, never converted, so the config holds (and its fingerprint hashes) what the file says."""
    if typing.get_origin(typ) is Literal:
        if not _holds(value, typ):
            hint = did_you_mean(value, typing.get_args(typ)) if isinstance(value, str) else ""
            raise GndpoError(f"config key {name} must be one of {choices_text(typ)}, got {value!r}{hint}")
        return value
    if typing.get_origin(typ) in (list, dict, types.UnionType, typing.Union):
        if not _holds(value, typ):
            raise GndpoError(f"config key {name} must be {describe_type(typ)}, got {value!r}")
        return value
    if typ is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-4" (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):  # .inf and .nan are YAML floats; no setting means either
            raise GndpoError(f"config key {name} must be a finite number, got {value!r}")
        return float(value)
    if typ is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise GndpoError(f"config key {name} must be {typ.__name__}, got {value!r}")
    return value


def _holds(value: Any, typ) -> bool:
    """Whether ``value`` is a ``typ``: a scalar, a Literal's choice, a list or dict of them, a TypedDict."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is Literal:
        return isinstance(value, str) and value in args
    if origin in (types.UnionType, typing.Union):  # `bool | Literal["auto"]`: a value of one of its types, as written
        return any(_holds(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_holds(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(_holds(k, args[0]) and _holds(v, args[1]) for k, v in value.items())
    if typing.is_typeddict(typ):
        fields = typing.get_type_hints(typ)
        return isinstance(value, dict) and set(value) == set(fields) and all(_holds(value[k], t) for k, t in fields.items())
    if typ is Any:
        return True
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, typ) and not (typ is int and isinstance(value, bool))
