"""Scans of the package's source shared by the tests and bench/house_figures.py (no gndpo import)."""

from __future__ import annotations

import ast
from pathlib import Path

# The package's code folders, the ones a scan reads.
CODE = ("storage", "pipeline", "stages", "apps", "cli")


def findings(root: Path, allowed: set[str], find) -> list[str]:
    """``where:line: source`` of what ``find(tree)`` reports in every module of ``root``'s code folders
    but the ``allowed`` ones (paths relative to ``root``)."""
    found = []
    for folder in CODE:
        for path in sorted((root / folder).rglob("*.py")):
            where = str(path.relative_to(root))
            if where not in allowed:
                found += [f"{where}:{line}: {text}" for line, text in find(ast.parse(path.read_text()))]
    return found


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


# -- stage names ---------------------------------------------------------------------------------------
# Calls that fetch another stage's output or class: a stage's name among their arguments is a lookup by name.
FETCHES = {"records", "manifest", "files", "plan_units", "unit_commit", "committed_units", "statistics", "job_class"}


def holds_name(node: ast.AST, names: set[str]) -> bool:
    """A string constant that is one of ``names``, or a tuple, list or set holding one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in names
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(holds_name(e, names) for e in node.elts)


def about_stages(node: ast.AST) -> bool:
    """Code whose text reads as a stage, or a table keyed by stage (``stage``, ``peak.stage``, ``by``)."""
    text = ast.unparse(node)
    return "stage" in text or text in ("by", "s")


def stage_name_uses(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, source) of every place in ``tree`` that compares a stage's name or looks a stage up by it:
    a comparison of a stage-like value with a name (or of a key tuple holding one: ``(r, "train") in
    by``), a subscript or ``.get`` by such a key, and a fetch (:data:`FETCHES`) given a name. A prompt
    split that shares a name ("train") is neither: it is not compared with a stage."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = [s for s in sides if holds_name(s, names)]
            if named and (any(isinstance(s, ast.Tuple) for s in named) or any(about_stages(s) for s in sides if s not in named)):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Subscript):
            if (isinstance(node.slice, ast.Tuple) and holds_name(node.slice, names)) or (holds_name(node.slice, names) and about_stages(node.value)):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            args = [*node.args, *(k.value for k in node.keywords)]
            if node.func.attr in FETCHES and any(holds_name(a, names) for a in args):
                found.append((node.lineno, ast.unparse(node)))
            elif node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Tuple) and holds_name(node.args[0], names):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)
