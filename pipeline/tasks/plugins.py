"""A user's own function named by import path (``package.module:function``), as rewards and tools are."""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Iterable

from gndpo.errors import GndpoError, did_you_mean, first_line


def named_callable(name: str, builtins: dict[str, Callable], kind: str) -> Callable:
    """The built-in ``kind`` (e.g. "reward") called ``name``, or a user's named by import path
    ``module:function``; a one-line GndpoError otherwise."""
    if name in builtins:
        return builtins[name]
    if ":" not in name:
        raise GndpoError(f"unknown {kind} {name!r}{did_you_mean(name, builtins)}; choose one of: {', '.join(sorted(builtins))}, "
                         "or name your own as module:function")
    return import_callable(name, kind)


def import_callable(path: str, kind: str) -> Callable:
    """The callable ``module:function`` names; a one-line GndpoError (naming the ``kind``, e.g.
    "reward") when it does not import or is not callable."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or anything the module raises while importing
        raise GndpoError(f"{kind} {path!r} does not import: {first_line(exc, with_type=True)}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise GndpoError(f"{kind} {path!r}: module {module_name} has no function {attr!r}")
    return fn


def use_plugin_dirs(dirs: Iterable[str]) -> None:
    """Make modules in ``dirs`` importable as plugins in this process. They go after everything already
    on the import path, so a user's ``json.py`` or ``rewards.py`` never shadows an installed module."""
    for d in dirs:
        if d not in sys.path:
            sys.path.append(d)
