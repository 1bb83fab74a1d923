"""The architecture, checked: imports only go down the layers, and no module-level import cycle.

    storage/  <-  pipeline/  <-  stages/  <-  apps/  <-  cli/

Each top-level folder is one layer (docs/development/architecture.md's table). A module may import its own layer
and the layers below it, never one above, and that holds for imports inside functions too (they are
scanned like the others) and for modules named by string (``importlib.import_module("gndpo...")``, a
``python -m gndpo...`` command line, an f-string that starts a module name): a string that names a gndpo
module is checked like an import. A gndpo import inside a function is allowed only with a comment
saying why (start-up time, a cycle it avoids), on its line or the line above.
Inside the foundation and the stages the sub-folders are floors too (:data:`SUB_FLOORS`, bottom first):
``pipeline/settings`` declares the settings every part takes; ``pipeline/config`` reads and checks them,
with the methods' and tasks' declarations, so neither imports config; a stage module (``stages/score.py``)
sits above every sub-folder of ``stages/``.
Runs alone: ``python -m pytest tests/test_layers.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("storage", "pipeline", "stages", "apps", "cli")

# Module prefix -> layer: the top-level folder decides (errors.py, faults.py and dist.py sit with storage).
LAYERS = {"gndpo.errors": 0, "gndpo.faults": 0, "gndpo.dist": 0, "gndpo.storage": 0, "gndpo.pipeline": 1, "gndpo.stages": 2, "gndpo.apps": 3, "gndpo.cli": 4}
LAYER_NAMES = ("storage", "pipeline", "stages", "apps", "cli")
# Libraries that must stay out of a layer: storage is bytes and tables, no model code.
FORBIDDEN = {0: ("torch", "transformers", "vllm", "deepspeed")}
# A string that is (or starts, in an f-string) a gndpo module name: "gndpo.stages.score",
# f"gndpo.stages.{stage}", "package.module:function" plugin paths.
# The sub-folders of a floor, bottom first. A module directly in the floor's folder (a stage:
# stages/score.py) sits above them all.
SUB_FLOORS = {
    "gndpo.pipeline": ("settings", "tasks", "methods", "config", "run", "observe", "exec"),
    "gndpo.stages": ("models", "samplers", "text", "scoring", "training", "teachers"),
}
MODULE_STRING = re.compile(r"gndpo(\.[A-Za-z_]\w*)+\.?(:\w+)?")


def layer_of(module: str) -> int | None:
    return LAYERS.get(".".join(module.split(".")[:2]))


def sub_floor(module: str) -> tuple[str, int] | None:
    """(floor, height inside it) of a module of a floor with sub-floors; None for the other floors."""
    parts = module.split(".")
    floor = ".".join(parts[:2])
    if floor not in SUB_FLOORS:
        return None
    order = SUB_FLOORS[floor]
    return floor, order.index(parts[2]) if len(parts) > 2 and parts[2] in order else len(order)


def goes_up(module: str, target: str) -> bool:
    """Whether importing ``target`` from ``module`` runs up a floor, or up a sub-floor of the same floor."""
    own, other = layer_of(module), layer_of(target)
    if own is None or other is None:
        return False
    if other != own:
        return other > own
    here, there = sub_floor(module), sub_floor(target)
    return here is not None and there is not None and there[1] > here[1]


def docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring nodes of ``tree``'s module, classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def string_references(tree: ast.Module):
    """(gndpo module, line) for every string literal, or head of an f-string, that names a gndpo
    module (docstrings, which mention modules to explain, are not references)."""
    skip = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and isinstance(head.value, str):
                skip.add(id(head))
                match = MODULE_STRING.match(head.value.strip())
                if match:
                    yield match.group(0).split(":")[0].rstrip("."), node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if MODULE_STRING.fullmatch(node.value.strip()):
                yield node.value.strip().split(":")[0].rstrip("."), node.lineno


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


def floor_names(module: str, target: str) -> tuple[str, str]:
    """The floors of ``module`` and ``target`` ("pipeline"), or their sub-floors when they share a
    floor ("pipeline/config"; "stages" for a stage module)."""
    if layer_of(module) != layer_of(target):
        return LAYER_NAMES[layer_of(module)], LAYER_NAMES[layer_of(target)]

    def name(m: str) -> str:
        parts, floor = m.split("."), LAYER_NAMES[layer_of(m)]
        return f"{floor}/{parts[2]}" if sub_floor(m)[1] < len(SUB_FLOORS[".".join(parts[:2])]) else floor

    return name(module), name(target)


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
            tree = ast.parse(source)
            for target, line in string_references(tree):
                if goes_up(module, target):
                    here, there = floor_names(module, target)
                    found.append(f"{path.relative_to(root)}:{line}: {module} ({here}) names {target} ({there}) by string")
            for target, line, at_top in imports(tree, module):
                where = f"{path.relative_to(root)}:{line}"
                if target.startswith("gndpo.") and goes_up(module, target):
                    here, there = floor_names(module, target)
                    found.append(f"{where}: {module} ({here}) imports {target} ({there})")
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
    assert unplaced == []
    top_level = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}  # tests/ is not shipped
    assert top_level == set(CODE), f"a top-level package without a layer, or a layer without its folder: {top_level ^ set(CODE)}"


def test_imports_go_down_the_layers():
    assert violations(ROOT) == []


def test_every_sub_folder_has_a_sub_floor():
    for floor, order in SUB_FLOORS.items():
        folder = ROOT / floor.split(".")[1]
        assert sorted(p.parent.name for p in folder.glob("*/__init__.py")) == sorted(order), floor


def test_no_import_cycles():
    assert cycles(module_graph(ROOT)) == []


def test_the_checks_catch_a_reverse_import_and_a_cycle(tmp_path):
    """The checker itself can fail: a foundation module importing a stage, importing one by string (a
    literal, an f-string, a ``-m`` command line), an uncommented import in a function, torch in storage,
    and a two-module cycle are each reported; a docstring naming a higher module is not."""
    files = {
        "storage/__init__.py": "",
        "storage/bytes.py": "import torch\n",
        "pipeline/__init__.py": "",
        "pipeline/exec/__init__.py": "",
        "pipeline/exec/rounds.py": "from gndpo.stages.score import ScoreJob\n",
        "pipeline/exec/by_name.py": ('"""Runs :mod:`gndpo.stages.score`."""\nimport importlib\n\n'
                                     'def job(stage):\n    return importlib.import_module(f"gndpo.stages.{stage}")\n\n'
                                     'SCORE = "gndpo.stages.score"\nCOMMAND = ["python", "-m", "gndpo.cli", "score"]\n'),
        "pipeline/run/__init__.py": "",
        "pipeline/run/run.py": "def f():\n    from gndpo.storage import bytes\n",
        "pipeline/methods/__init__.py": "",
        "pipeline/methods/loss.py": "from gndpo.pipeline.config.load import config_from_dict\n",
        "pipeline/config/__init__.py": "",
        "pipeline/config/load.py": "import gndpo.pipeline.methods\n",
        "stages/__init__.py": "",
        "stages/a.py": "from gndpo.stages import b\n",
        "stages/b.py": "import gndpo.stages.a\n",
        "cli/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = violations(tmp_path)
    assert any("rounds.py:1" in v and "(pipeline) imports gndpo.stages.score.ScoreJob (stages)" in v for v in found), found
    by_string = sorted(v.split(": ", 1)[1] for v in found if "by_name.py" in v)
    assert by_string == ["gndpo.pipeline.exec.by_name (pipeline) names gndpo.cli (cli) by string",
                         "gndpo.pipeline.exec.by_name (pipeline) names gndpo.stages (stages) by string",
                         "gndpo.pipeline.exec.by_name (pipeline) names gndpo.stages.score (stages) by string"], found
    assert any("run.py:2" in v and "inside a function" in v for v in found), found
    assert any("loss.py:1" in v and "(pipeline/methods) imports gndpo.pipeline.config.load.config_from_dict (pipeline/config)" in v for v in found), found
    assert not any("load.py" in v for v in found), found  # config may import methods
    assert any("bytes.py:1" in v and "imports torch" in v for v in found), found
    assert cycles(module_graph(tmp_path)) == [["gndpo.stages.a", "gndpo.stages.b"]]


def test_commands_register_without_the_heavy_libraries():
    """`gndpo --help`, `status` and `sql` must start in about a second (bench/cli_startup.py measures
    it): registering every command imports neither torch, transformers, vLLM nor DeepSpeed; a command
    that needs them imports its pipeline function when it runs."""
    import subprocess
    import sys

    code = ("import sys; from gndpo.cli.app import register; register(); "
            "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- the size of a function, and docstrings ---------------------------------------------------------------
MAX_FUNCTION_LINES, MAX_PARAMETERS = 50, 10


def functions(root: Path):
    """(path, node) of every function and method in the code folders."""
    for folder in CODE:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield path, node


def code_lines(node: ast.FunctionDef) -> int:
    """A function's lines, its docstring left out (a long explanation is documentation, not code)."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def parameters(node: ast.FunctionDef) -> int:
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return len([n for n in names if n not in ("self", "cls")])


def test_functions_hold_one_idea():
    """No function over 50 lines of code or 10 parameters. The exception: a `gndpo` command's function
    in cli/, whose parameters are the command's options (Typer reads them from the signature)."""
    too_long = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({code_lines(n)} lines)" for p, n in functions(ROOT) if code_lines(n) > MAX_FUNCTION_LINES]
    too_many = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({parameters(n)} parameters)" for p, n in functions(ROOT)
                if parameters(n) > MAX_PARAMETERS and p.relative_to(ROOT).parts[0] != "cli"]
    assert too_long + too_many == []


def test_public_classes_have_docstrings():
    missing = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name}" for folder in CODE for path in sorted((ROOT / folder).rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef) and not node.name.startswith("_")
               and ast.get_docstring(node) is None]
    assert missing == []


def test_the_architecture_doc_lists_the_layers_as_the_tree_has_them():
    """docs/development/architecture.md's layout table: one row per top-level code folder, in layer order, with the
    layer number this test enforces."""
    rows = re.findall(r"^\| `(\w+)/`[^|]*\| (\d) \|", (ROOT / "docs" / "development" / "architecture.md").read_text(), re.M)
    assert [(folder, int(layer)) for folder, layer in rows] == [(name, LAYERS[f"gndpo.{name}"]) for name in LAYER_NAMES]
