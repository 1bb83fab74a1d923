"""A regular (non-editable) wheel holds the whole `gndpo` package and works on its own.

The repository root is the package `gndpo` (package-dir {"gndpo": "."}); its code folders and all their
subpackages (pipeline/methods, ...) must install as gndpo.*. The wheel is built from a copy of the source tree
(so nothing is written into the checkout and no stale build/ can leak in), installed with
`pip install --target` into a fresh folder, and used from a Python that sees that folder and the venv's
site-packages (for dependencies) but not the source tree: `-S` keeps the venv's .pth files, among them the
editable install's finder that maps `gndpo` to the checkout, from being read, and the working directory is
an empty folder.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_FOLDERS = ("cli", "pipeline", "stages", "storage")
NOT_COPIED = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", "demo-run"}


def _copy_source(dest: Path) -> None:
    """The files git would see (tracked plus untracked, not ignored); without git, the tree less the usual junk."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, dest, ignore=lambda d, names: [n for n in names if n in NOT_COPIED or n.endswith(".egg-info")])
        return
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():  # tracked files deleted in the working tree are listed too
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _source_modules() -> set[str]:
    """Every module the wheel must hold, from the source tree: root modules plus the code folders, recursively."""
    modules = {"gndpo"} | {f"gndpo.{p.stem}" for p in ROOT.glob("*.py") if p.name not in ("__init__.py", "setup.py")}
    for folder in CODE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT)
            # Only regular packages: every folder on the way down has an __init__.py.
            if all((ROOT / Path(*rel.parts[:i]) / "__init__.py").is_file() for i in range(1, len(rel.parts))):
                parts = rel.with_suffix("").parts
                modules.add("gndpo." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


# Run by the installed-wheel Python: import every module found in the installed gndpo folder and report
# where each one came from, or why it failed.
IMPORT_ALL = r"""
import importlib, json, pkgutil, sys, traceback
target = sys.argv[1]
import gndpo
found, failed = {"gndpo": gndpo.__file__}, {}
def onerror(name):
    failed[name] = traceback.format_exc()
for info in pkgutil.walk_packages(gndpo.__path__, prefix="gndpo.", onerror=onerror):
    try:
        found[info.name] = importlib.import_module(info.name).__file__
    except BaseException:
        failed[info.name] = traceback.format_exc()
print(json.dumps({"found": found, "failed": failed,
                  "editable_finders": [repr(f) for f in sys.meta_path if "editable" in repr(f).lower()]}))
"""

RUN_METHODS = r"""
import sys
from gndpo.cli.app import main
import gndpo.pipeline.methods
print("methods module:", gndpo.pipeline.methods.__file__, file=sys.stderr)
sys.argv = ["gndpo", "methods"]
main()
"""


def test_wheel_installs_whole_package_and_runs(tmp_path):
    src = tmp_path / "src"
    _copy_source(src)
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        capture_output=True, text=True,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    wheel = next(dist.glob("gndpo-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()

    # (c) What the wheel holds: data files and subpackages in, tests/, bench/ and setup.py out.
    assert {"gndpo/apps/demo.yaml", "gndpo/apps/demo_tools.yaml", "gndpo/apps/demo_self_distill.yaml", "gndpo/apps/demo_privileged.yaml"} <= names
    for package in ("pipeline/config", "pipeline/exec", "pipeline/run", "pipeline/methods", "pipeline/tasks", "pipeline/observe",
                    "apps", "apps/demos", "stages/models", "stages/training", "stages/text"):
        assert f"gndpo/{package}/__init__.py" in names, package
    assert "gndpo = gndpo.cli.app:main" in entry_points
    stray = sorted(
        n for n in names
        if n.startswith(("tests/", "bench/", "gndpo/tests/", "gndpo/bench/", "gndpo/.venv/", "gndpo/build/"))
        or n == "gndpo/setup.py"
        or not n.startswith(("gndpo/", "gndpo-"))
    )
    assert not stray, f"the wheel holds files it should not: {stray}"

    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True, text=True,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    deps = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join([str(target), *dict.fromkeys(deps)])
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def installed_python(code, *args):
        return subprocess.run([sys.executable, "-S", "-c", code, *args],
                              env=env, cwd=run_dir, capture_output=True, text=True, timeout=300)

    # (a) Every module of the installed package imports, from the installed copy.
    out = installed_python(IMPORT_ALL, str(target))
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert not report["editable_finders"], report["editable_finders"]
    assert not report["failed"], "modules of the installed wheel that fail to import:\n" + "\n".join(
        f"--- {name}\n{tb}" for name, tb in report["failed"].items()
    )
    found = report["found"]
    outside = {name: f for name, f in found.items() if not Path(f).resolve().is_relative_to(target.resolve())}
    assert not outside, f"imported from outside the installed wheel: {outside}"
    missing = _source_modules() - found.keys()
    assert not missing, f"modules in the source tree but not in the installed wheel: {sorted(missing)}"
    assert "gndpo.pipeline.methods" in found

    # (b) `gndpo methods` through the installed code.
    out = installed_python(RUN_METHODS)
    assert out.returncode == 0, out.stdout + out.stderr
    assert str(target) in out.stderr, out.stderr
    for method in ("gndpo", "reverse_kl"):
        assert method in out.stdout, out.stdout
