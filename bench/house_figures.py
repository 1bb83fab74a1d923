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
  by the stage's name;
* ``product_lookups``: the string-key lookups above that read a stage's product: a file record's field
  (path, bytes, sha256, rows, kind, run), a unit's id or its numbers (``c["tokens"]``, in a stage's
  ``summarize``; ``commit.numbers["steps"]``), the policy's folders and carried state;
* ``stage_name_uses``: comparisons with, and lookups by, a stage's name (``stage == "train"``,
  ``records(r, "train")``, ``by[(r, "score")]``; tests/code_scan.stage_name_uses) outside the stage
  registry and the declarations of what each stage commits.

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

from tests.code_scan import backend_comparisons, stage_name_uses  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CODE = ("storage", "pipeline", "stages", "apps", "cli")
RECORD_NAMES = re.compile(r"^(unit|u|record|rec|manifest|rollouts|commit|c|f|file|meta|state|.*_record|.*_manifest)$")
STAGE_NAMES = {"rollout", "score", "normalize", "train"}
MAY_NAME_STAGES = ("stages/registry.py", "pipeline/run/products.py")
PRODUCT_KEYS = {"path", "bytes", "sha256", "rows", "kind", "run", "unit", "files", "model_dir", "ema_dir", "optimizer_state", "pending", "world"}
ALLOWED_BACKEND_COMPARISONS = ("pipeline/settings/schema.py", "pipeline/config/schema.py", "pipeline/config/checks.py", "stages/teachers/registry.py")


def code_files(root: Path):
    for folder in CODE:
        yield from sorted((root / folder).rglob("*.py"))


def is_record_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and bool(RECORD_NAMES.match(node.id))


def string_lookups(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """(value looked up in, key) of every ``x["key"]`` and ``x.get("key")`` on a record-named value."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_record_name(node.value):
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                found.append((node.value, node.slice.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if is_record_name(node.func.value) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.func.value, node.args[0].value))
    return found


def string_key_lookups(tree: ast.AST) -> int:
    return len(string_lookups(tree))


def product_lookups(tree: ast.AST) -> int:
    """String-key lookups that read a stage's product: a product key, a unit's numbers in a
    ``summarize``, or anything looked up in ``<...>.numbers``."""
    in_summarize = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "summarize" for n in ast.walk(f)}
    count = 0
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            value, key = node.value, node.slice.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                value, key = node.func.value, node.args[0].value
        if key is None:
            continue
        on_numbers = isinstance(value, ast.Attribute) and value.attr == "numbers"
        if on_numbers or (is_record_name(value) and (key in PRODUCT_KEYS or id(node) in in_summarize)):
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
           "string_key_lookups": 0, "product_lookups": 0, "dict_parameters": 0, "backend_comparisons": [], "stage_records_by_name": 0,
           "stage_name_uses": []}
    for path in code_files(root):
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text())
        out["string_key_lookups"] += string_key_lookups(tree)
        out["dict_parameters"] += dict_parameters(tree)
        out["stage_records_by_name"] += records_by_stage_name(tree)
        out["product_lookups"] += product_lookups(tree)
        if rel not in MAY_NAME_STAGES:
            out["stage_name_uses"] += [f"{rel}:{line}" for line, _ in stage_name_uses(tree, STAGE_NAMES)]
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
              for k in ("string_key_lookups", "product_lookups", "dict_parameters", "backend_comparisons", "stage_records_by_name",
                        "stage_name_uses"))]
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
