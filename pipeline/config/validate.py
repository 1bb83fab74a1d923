"""Building a settings tree from nested mappings: pydantic checks every value against the schema's
declarations, and its first error becomes one line that names the key.

The schema stays plain frozen dataclasses (their comments are the keys' documentation, their
fields the fingerprint); :func:`validator` derives from each section a pydantic ``TypedDict`` of the
keys given (unknown keys forbidden) and each declared type's pydantic form, strict as YAML needs it:

* an int or a bool is strict: 2.5, "3", 1 for a bool or "yes" are refused (YAML already read each value
  as what it is, so a string here is a mistake, not a number to parse);
* a float also takes an int, and a string YAML 1.1 leaves unparsed ("1e-4"); never inf or nan;
* a string also takes a number (a name such as ``7`` YAML read as an int); a choice of ``on`` and ``off``
  also takes the bool YAML 1.1 reads a bare ``on`` or ``off`` as;
* the items of a list or a mapping are checked, never converted: the config holds, and its fingerprint
  hashes, what the file says;
* ``Annotated[float, Range(...)]`` becomes pydantic's bounds; an empty section (``rollout:``) is its defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Annotated, Any, Literal, Union

import annotated_types
import typing_extensions
from pydantic import BeforeValidator, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, TypeAdapter, ValidationError

from gndpo.errors import GndpoError, did_you_mean
from gndpo.pipeline.config.keys import choices_text, describe_type
from gndpo.pipeline.settings.schema import Range

RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}
SECTION = ConfigDict(extra="forbid", allow_inf_nan=False)


def build(cls: type, data: dict, where: str = ""):
    """A ``cls`` (a schema section: ``Config`` for the whole) from ``data``; a one-line GndpoError naming
    the key of the first value the schema does not allow. ``where``: the section's dotted prefix."""
    try:
        checked = validator(cls).validate_python(data)
    except ValidationError as exc:
        raise GndpoError(error_line(cls, data, exc.errors()[0], where)) from None
    return instantiate(cls, checked)


@functools.cache
def validator(cls: type) -> TypeAdapter:
    return TypeAdapter(section_type(cls))


def section_type(cls: type) -> type:
    """The pydantic form of a section: a TypedDict of its keys, each optional, unknown keys forbidden."""
    hints = typing.get_type_hints(cls, include_extras=True)
    keys = {f.name: value_type(hints[f.name]) for f in dataclasses.fields(cls)}
    section = typing_extensions.TypedDict(cls.__name__, keys, total=False)
    section.__pydantic_config__ = SECTION
    return section


def value_type(typ) -> Any:
    """A key's declared type in its pydantic form (see the module's docstring)."""
    checks = []
    if typing.get_origin(typ) is Annotated:
        typ, *checks = typing.get_args(typ)
    if dataclasses.is_dataclass(typ):
        return Annotated[section_type(typ), BeforeValidator(lambda value: {} if value is None else value)]
    bounds = [annotated_types.Interval(gt=c.gt, ge=c.ge, lt=c.lt, le=c.le) for c in checks if isinstance(c, Range)]
    if typ is float:
        return Annotated[(StrictFloat, BeforeValidator(yaml_float), *bounds)]
    if typ is str:
        return Annotated[StrictStr, BeforeValidator(number_as_text)]
    if typing.get_origin(typ) is Literal and {"on", "off"} <= set(typing.get_args(typ)):
        return Annotated[typ, BeforeValidator(yaml_switch)]
    return Annotated[(item_type(typ), *bounds)] if bounds else item_type(typ)


def item_type(typ) -> Any:
    """A type as checked without conversion: a list's or a mapping's items, a TypedDict's fields."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is list:
        return list[item_type(args[0])]
    if origin is dict:
        return dict[item_type(args[0]), item_type(args[1])]
    if origin in (types.UnionType, typing.Union):
        return Union[tuple(value_type(a) for a in args)]  # noqa: UP007 - built from a tuple of types (each with its bounds)
    if typing.is_typeddict(typ):
        fields = typing.get_type_hints(typ)
        turn = typing_extensions.TypedDict(typ.__name__, {k: item_type(t) for k, t in fields.items()})
        turn.__pydantic_config__ = SECTION
        return turn
    # an int item stays an int where a float is declared (1 is a number, and the file said 1)
    strict = {int: StrictInt, bool: StrictBool, str: StrictStr, float: Union[StrictInt, StrictFloat]}  # noqa: UP007
    return typ if origin is Literal or typ is Any else strict[typ]


def yaml_float(value):
    """YAML 1.1 reads "1e-4" (no dot) as a string: parsed here; anything else is left to the check."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def yaml_switch(value):
    """YAML 1.1 reads a bare ``on`` or ``off`` (also ``yes``, ``no``) as a bool: for a choice of on and
    off, the choice it was written as."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


def number_as_text(value):
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def instantiate(cls: type, checked: dict):
    """The frozen ``cls`` of the checked keys (the others keep their defaults), its sections built alike."""
    hints = typing.get_type_hints(cls, include_extras=True)

    def section(name: str):
        typ = hints[name]
        typ = typing.get_args(typ)[0] if typing.get_origin(typ) is Annotated else typ
        return typ if dataclasses.is_dataclass(typ) else None

    values = {}
    for name, value in checked.items():
        sub = section(name)
        values[name] = instantiate(sub, value) if sub is not None else value
    return cls(**values)


def error_line(cls: type, data, error: dict, where: str) -> str:
    """pydantic's ``error`` as the one line a user reads: the dotted key, what it must be, what it got."""
    key, typ, value = where.rstrip("."), cls, data
    for part in error["loc"]:
        section = typ if dataclasses.is_dataclass(typ) else None
        if section is None:  # inside a list, a mapping or a union: the key's own type says it
            break
        hints = typing.get_type_hints(section, include_extras=True)
        if part not in hints:
            prefix = f"{key}." if key else ""
            return f"unknown config key {prefix}{part}{did_you_mean(str(part), hints, prefix)}"
        key, typ, value = f"{key}.{part}" if key else part, hints[part], value[part]
    checks = []
    if typing.get_origin(typ) is Annotated:
        typ, *checks = typing.get_args(typ)
    if dataclasses.is_dataclass(typ):
        return f"config section {key or '<root>'} must be a mapping, got {type(value).__name__}"
    if error["type"] == "finite_number":
        return f"config key {key} must be a finite number, got {value!r}"
    if error["type"] in RANGE_ERRORS:
        if typing.get_origin(typ) in (types.UnionType, typing.Union):  # the bounds of the union's numeric member
            checks = [c for arg in typing.get_args(typ) if typing.get_origin(arg) is Annotated for c in typing.get_args(arg)[1:]]
        number = yaml_float(error["input"])
        problem = next(c.violation(number) for c in checks if c.violation(number))
        return f"config key {key} {problem}, got {value!r}"
    if typing.get_origin(typ) is Literal:
        hint = did_you_mean(value, typing.get_args(typ)) if isinstance(value, str) else ""
        return f"config key {key} must be one of {choices_text(typ)}, got {value!r}{hint}"
    if typing.get_origin(typ) in (list, dict, types.UnionType, typing.Union):
        return f"config key {key} must be {describe_type(typ)}, got {value!r}"
    return f"config key {key} must be {typ.__name__}, got {value!r}"
