"""The house's figures that issue 64 asked to bring down, counted the same way before and after.

* ``lines``: lines of pipeline/settings/schema.py and stages/train.py;
* ``string_key_lookups``: ``x["key"]`` and ``x.get("key")`` where ``x`` is a unit, record, manifest,
  commit or file record (by its name: unit, u, record, rec, manifest, rollouts, commit, c, f, file,
  meta, state, and names ending in _record or _manifest), in the package's code;
* ``dict_parameters``: function parameters annotated ``dict``, ``dict[...]``, ``list[dict]`` or
  ``list[dict[...]]``;
* ``backend_comparisons``: comparisons of ``score.backend`` (or a name ``backend`` holding it) with a
  string or a tuple of strings, outside the config schema (schema.py and its checks.py) and the teacher registry;
* ``stage_records_by_name``: calls ``records(<round>, "<stage>")`` that fetch another stage's records
  by the stage's name.

    .venv/bin/python bench/house_figures.py                 # this checkout's figures, as JSON
    .venv/bin/python bench/house_figures.py --before REV    # REV's and this checkout's: results/house_figures.{json,md}
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.code_scan
from common import RESULTS, machine, save_json  # noqa: E402

from tests.code_scan import backend_comparisons  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CODE = ("storage", "pipeline", "stages", "apps", "cli")
RECORD_NAMES = re.compile(r"^(unit|u|record|rec|manifest|rollouts|commit|c|f|file|meta|state|.*_record|.*_manifest)$")
ALLOWED_BACKEND_COMPARISONS = ("pipeline/settings/schema.py", "pipeline/config/schema.py", "pipeline/config/checks.py", "stages/teachers/registry.py")


def code_files(root: Path):
    for folder in CODE:
        yield from sorted((root / folder).rglob("*.py"))


def is_record_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and bool(RECORD_NAMES.match(node.id))


def string_key_lookups(tree: ast.AST) -> int:
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_record_name(node.value):
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                count += 1
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if is_record_name(node.func.value) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                count += 1
    return count


def dict_parameters(tree: ast.AST) -> int:
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                text = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if re.match(r"^(dict|list\[dict)", text.replace(" ", "")):
                    count += 1
    return count


def records_by_stage_name(tree: ast.AST) -> int:
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "records":
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                count += 1
    return count


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def figures(root: Path = ROOT) -> dict:
    """The figures of the checkout at ``root``."""
    schema = next(p for p in (root / "pipeline/settings/schema.py", root / "pipeline/config/schema.py") if p.exists())
    config = [schema, *(p for p in (root / "pipeline/config").glob("*.py") if p != schema)]
    out = {"lines": {"config schema": lines(schema), "config in all": sum(lines(p) for p in config), "stages/train.py": lines(root / "stages/train.py")},
           "string_key_lookups": 0, "dict_parameters": 0, "backend_comparisons": [], "stage_records_by_name": 0}
    for path in code_files(root):
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text())
        out["string_key_lookups"] += string_key_lookups(tree)
        out["dict_parameters"] += dict_parameters(tree)
        out["stage_records_by_name"] += records_by_stage_name(tree)
        if rel not in ALLOWED_BACKEND_COMPARISONS:
            out["backend_comparisons"] += [f"{rel}:{line}" for line, _ in backend_comparisons(tree)]
    return out


def compare(before: str) -> dict:
    """``before``'s figures (a temporary worktree of that revision) beside this checkout's."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", f"{tmp}/tree", before], check=True)
        try:
            old = figures(Path(tmp) / "tree")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", f"{tmp}/tree"], check=True)
    return {"before": {"rev": before, **old}, "after": {"rev": "working tree", **figures()}, "machine": machine()}


def markdown(result: dict) -> str:
    b, a = result["before"], result["after"]
    rows = [*(f"| lines of {k} | {b['lines'][k]} | {a['lines'][k]} |" for k in a["lines"]),
            *(f"| {k.replace('_', ' ')} | {b[k] if isinstance(b[k], int) else len(b[k])} | {a[k] if isinstance(a[k], int) else len(a[k])} |"
              for k in ("string_key_lookups", "dict_parameters", "backend_comparisons", "stage_records_by_name"))]
    return "\n".join([f"| figure | {b['rev'][:7]} | after |", "|---|---:|---:|", *rows]) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a revision to measure beside this checkout; writes results/house_figures.{json,md}")
    args = parser.parse_args()
    if args.before is None:
        print(json.dumps(figures(), indent=1))
    else:
        result = compare(args.before)
        save_json(RESULTS / "house_figures.json", result)
        (RESULTS / "house_figures.md").write_text(markdown(result))
        print(markdown(result))
