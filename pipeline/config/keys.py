"""The schema read back: every key with its type, default, bounds or choices and its comment (what
``gndpo config keys`` lists and the docs' reference is generated from: one source, the schema's own
declarations and comments), and a declared type in words (the validator's messages use them too)."""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import re
import tokenize
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from gndpo.pipeline.settings.schema import Config


def choices_text(typ) -> str:
    """A Literal's choices in words: "a, b, ''"."""
    return ", ".join(repr(c) if c == "" else c for c in typing.get_args(typ))


def describe_type(typ) -> str:
    """``typ`` in words, for an error message: "a list of str", "a mapping of str to str"."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is Annotated:  # a union's bounded member: "int >= 1"
        inner, *checks = args
        return " ".join([describe_type(inner), *(c.describe() for c in checks if hasattr(c, "describe"))])
    if origin is Literal:
        return f"({' | '.join(args)})"
    if origin in (types.UnionType, typing.Union):
        return " or ".join(choices_text(arg) if typing.get_origin(arg) is Literal else describe_type(arg) for arg in args)
    if origin is list:
        return f"a list of {describe_type(args[0])}"
    if origin is dict:
        return f"a mapping with {describe_type(args[0])} keys" if args[1] is Any else f"a mapping of {describe_type(args[0])} to {describe_type(args[1])}"
    if typing.is_typeddict(typ):
        return "{" + ", ".join(f"{k}: {describe_type(t)}" for k, t in typing.get_type_hints(typ).items()) + "}"
    return typ.__name__


@dataclass(frozen=True)
class KeyDoc:
    """One config key as the schema declares it: dotted ``key``, its ``type`` in words, its ``default``
    (YAML flow style), what it ``allows`` (a Range's bounds or a Literal's choices, "" where any value of
    the type goes) and its ``description`` (the field's comments, on one line)."""

    key: str
    type: str
    default: str
    allows: str
    description: str


def config_keys(cls: type | None = None, prefix: str = "") -> list[KeyDoc]:
    """Every leaf key of ``cls`` (default :class:`Config`) and its sections, in the schema's order."""
    cls = Config if cls is None else cls
    hints = typing.get_type_hints(cls, include_extras=True)
    comments = field_comments(cls)
    found = []
    for f in dataclasses.fields(cls):
        typ, checks = hints[f.name], ()
        if typing.get_origin(typ) is Annotated:
            typ, *checks = typing.get_args(typ)
        if dataclasses.is_dataclass(typ):
            found += config_keys(typ, f"{prefix}{f.name}.")
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        allows = " and ".join(c.describe() for c in checks) or _allowedchoices_text(typ)
        found.append(KeyDoc(f"{prefix}{f.name}", _type_name(typ), json.dumps(default), allows, comments.get(f.name, "")))
    return found


def _type_name(typ) -> str:
    """``typ`` as a key listing shows it: int, float, str (a Literal's too), bool, list[str], dict[str, str]."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is Literal:
        return type(args[0]).__name__
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if origin in (types.UnionType, typing.Union):
        return " | ".join(_type_name(a) for a in args)
    if typing.is_typeddict(typ):
        return describe_type(typ)
    return "any" if typ is Any else typ.__name__


def _allowedchoices_text(typ) -> str:
    """"one of a, b" for a Literal (or a list of them), else ""."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is list and typing.get_origin(args[0]) is Literal:
        return f"each one of {choices_text(args[0])}"
    return f"one of {choices_text(typ)}" if origin is Literal else ""


def field_comments(cls: type) -> dict[str, str]:
    """{field: its description} of a dataclass of this module, read from its source: the block of
    ``#`` lines right above the field, then the comment at the end of its line, joined on one line."""
    lines = inspect.getsource(cls).splitlines()
    trailing, whole_line = {}, set()
    for tok in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0] - 1
            if not lines[row][: tok.start[1]].strip():
                whole_line.add(row)
            trailing[row] = tok.string.lstrip("#").strip()
    found = {}
    for i, line in enumerate(lines):
        match = re.match(r"    (\w+)\s*:", line)
        if match is None:
            continue
        above, j = [], i - 1
        while j >= 0 and j in whole_line:
            above.insert(0, trailing[j])
            j -= 1
        found[match.group(1)] = " ".join([*above, *([trailing[i]] if i in trailing and i not in whole_line else [])])
    return found
