"""The architecture, checked: imports only go down the layers, and no module-level import cycle.

    storage  <-  pipeline foundation (config, exec, run, methods, tasks, observe)  <-  stages
             <-  pipeline apps and toys (init, fork, demo, compare, evaluation)  <-  cli

A module may import its own layer and the layers below it, never one above, and that holds for imports
inside functions too (they are scanned like the others). A gndpo import inside a function is allowed
only with a comment saying why (start-up time, a cycle it avoids), on its line or the line above.
Runs alone: ``python -m pytest tests/test_layers.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("storage", "pipeline", "stages", "cli")

# (package prefix, layer); the longest matching prefix decides.
LAYERS = (
    ("gndpo.errors", 0), ("gndpo.faults", 0), ("gndpo.storage", 0),
    ("gndpo.pipeline.config", 1), ("gndpo.pipeline.exec", 1), ("gndpo.pipeline.run", 1), ("gndpo.pipeline.methods", 1),
    ("gndpo.pipeline.tasks", 1), ("gndpo.pipeline.observe", 1),
    ("gndpo.stages", 2),
    ("gndpo.pipeline.apps", 3), ("gndpo.pipeline.toys", 3),
    ("gndpo.cli", 4),
)
LAYER_NAMES = ("storage", "pipeline foundation", "stages", "pipeline apps", "cli")
# Libraries that must stay out of a layer: storage is bytes and tables, no model code.
FORBIDDEN = {0: ("torch", "transformers", "vllm", "deepspeed")}


def layer_of(module: str) -> int | None:
    matches = [(len(prefix), layer) for prefix, layer in LAYERS if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1] if matches else None


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["gndpo", *parts])


def imports(tree: ast.Module, module: str):
    """(imported module, line, at module level?) for every import in ``tree``; ``from a import b`` yields
    ``a.b`` (b may be a module) and relative imports are resolved against ``module``."""
    top = {id(node) for node in tree.body}
    top |= {id(n) for node in tree.body if isinstance(node, (ast.If, ast.Try)) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: -node.level] if not module.endswith("__init__") else module.split(".")
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno, id(node) in top


def violations(root: Path) -> list[str]:
    """Every import that goes up a layer, reaches a forbidden library, or is a gndpo import in a function
    without a comment, in the code folders under ``root``."""
    found = []
    for folder in CODE:
        for path in sorted((root / folder).rglob("*.py")):
            module = module_name(path, root)
            own = layer_of(module)
            source = path.read_text()
            lines = source.splitlines()
            for target, line, at_top in imports(ast.parse(source), module):
                where = f"{path.relative_to(root)}:{line}"
                other = layer_of(target) if target.startswith("gndpo.") else None
                if own is not None and other is not None and other > own:
                    found.append(f"{where}: {module} ({LAYER_NAMES[own]}) imports {target} ({LAYER_NAMES[other]})")
                if own in FORBIDDEN and target.split(".")[0] in FORBIDDEN[own]:
                    found.append(f"{where}: {module} ({LAYER_NAMES[own]}) imports {target.split('.')[0]}")
                lazy = not at_top and target.startswith("gndpo.")
                if lazy and not any("#" in text for text in lines[max(line - 2, 0) : line]):
                    found.append(f"{where}: {module} imports {target} inside a function without a comment saying why")
    return found


def module_graph(root: Path) -> dict[str, set[str]]:
    """{module: gndpo modules it imports at module level} over the code folders."""
    modules = {module_name(p, root): p for folder in CODE for p in (root / folder).rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        edges = set()
        for target, _, at_top in imports(ast.parse(path.read_text()), module):
            if at_top:
                # ``from pkg import name``: the module pkg.name if there is one, else pkg itself
                edges.add(target if target in modules else target.rpartition(".")[0])
        graph[module] = {t for t in edges if t in modules and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    unplaced = [module_name(p, ROOT) for f in CODE for p in (ROOT / f).rglob("*.py") if layer_of(module_name(p, ROOT)) is None]
    assert unplaced in ([], ["gndpo.pipeline"], ["gndpo.stages"]) or set(unplaced) <= {"gndpo.pipeline", "gndpo.stages"}, unplaced


def test_imports_go_down_the_layers():
    assert violations(ROOT) == []


def test_no_import_cycles():
    assert cycles(module_graph(ROOT)) == []


def test_the_checks_catch_a_reverse_import_and_a_cycle(tmp_path):
    """The checker itself can fail: a foundation module importing a stage, an uncommented import in a
    function, torch in storage, and a two-module cycle are each reported."""
    files = {
        "storage/__init__.py": "",
        "storage/bytes.py": "import torch\n",
        "pipeline/__init__.py": "",
        "pipeline/exec/__init__.py": "",
        "pipeline/exec/rounds.py": "from gndpo.stages.score import ScoreJob\n",
        "pipeline/run/__init__.py": "",
        "pipeline/run/run.py": "def f():\n    from gndpo.storage import bytes\n",
        "stages/__init__.py": "",
        "stages/a.py": "from gndpo.stages import b\n",
        "stages/b.py": "import gndpo.stages.a\n",
        "cli/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = violations(tmp_path)
    assert any("rounds.py:1" in v and "(pipeline foundation) imports gndpo.stages.score.ScoreJob (stages)" in v for v in found), found
    assert any("run.py:2" in v and "inside a function" in v for v in found), found
    assert any("bytes.py:1" in v and "imports torch" in v for v in found), found
    assert cycles(module_graph(tmp_path)) == [["gndpo.stages.a", "gndpo.stages.b"]]


def test_commands_register_without_the_heavy_libraries():
    """`gndpo --help`, `status` and `sql` must start in about a second (bench/cli_startup.py measures
    it): registering every command imports neither torch, transformers, vLLM nor DeepSpeed; a command
    that needs them imports its pipeline function when it runs."""
    import subprocess
    import sys

    code = ("import sys; from gndpo.cli.app import _register; _register(); "
            "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
