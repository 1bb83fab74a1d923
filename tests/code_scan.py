"""Scans of the package's source shared by the tests and bench/house_figures.py (no gndpo import)."""

from __future__ import annotations

import ast

# logging.backends is another setting: comparisons with its names are not a teacher backend's.
LOGGING_BACKENDS = {"tensorboard", "wandb"}


def is_name_or_names(node: ast.AST) -> bool:
    """A string other than a logging backend's, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value not in LOGGING_BACKENDS
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts) and all(is_name_or_names(e) for e in node.elts)


def reads_backend(node: ast.AST) -> bool:
    """``<...>.score.backend``, ``score_cfg.backend``, or a name ``backend`` (what such code stores it in)."""
    if isinstance(node, ast.Attribute) and node.attr == "backend":
        return "score" in ast.unparse(node.value) or ast.unparse(node.value) in ("cfg", "self")
    return isinstance(node, ast.Name) and node.id == "backend"


def backend_comparisons(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, source) of every comparison in ``tree`` of score.backend with a backend's name (or names)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(reads_backend(s) for s in sides) and any(is_name_or_names(s) for s in sides):
                found.append((node.lineno, ast.unparse(node)))
    return found
