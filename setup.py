"""Package list only; all metadata lives in pyproject.toml.

The repository root is the `gndpo` package (package-dir {"gndpo": "."} in pyproject.toml), and setuptools'
declarative `find` cannot add the `gndpo.` prefix to what it finds there. So: every regular package under the
code folders, found recursively (pipeline.methods and any future subpackage), is installed as gndpo.<name>.
tests/, bench/ and everything else at the root stay out of the wheel, and so does this file, which would
otherwise ship as the module gndpo.setup. (An editable install maps `gndpo` to this folder, so there
`import gndpo.setup` finds this file: the __main__ guard keeps that import harmless. setuptools runs this file
as __main__.)
"""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CODE_FOLDERS = ("apps", "cli", "pipeline", "stages", "storage")


class BuildPy(build_py):
    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("gndpo", "setup")]


if __name__ == "__main__":
    found = find_packages(where=str(ROOT), include=[p for f in CODE_FOLDERS for p in (f, f + ".*")])
    setup(packages=["gndpo"] + sorted("gndpo." + name for name in found), cmdclass={"build_py": BuildPy})
