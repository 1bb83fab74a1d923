"""The packages a lent GPU machine lacks, carried there as one compressed site folder.

The GPU machines this project is lent have CUDA torch, transformers, accelerate and peft, but not the
rest of gndpo's dependencies, and no network. ``pack`` copies the named distributions out of this
environment (every file their ``RECORD`` lists; pure Python, or built for the same CPython and Linux)
into an xz-compressed tar; ``unpack`` (there) extracts it into a folder and links this repository as
``gndpo`` beside it, so ``PYTHONPATH=FOLDER`` makes both importable.

    .venv/bin/python bench/gpu_site.py pack --out .gpu/site.tar.xz          # here (about 3 minutes)
    python3 bench/gpu_site.py unpack .gpu/site.tar.xz /tmp/site             # there; then PYTHONPATH=/tmp/site
"""

from __future__ import annotations

import argparse
import sys
import tarfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

# gndpo's dependencies the GPU image lacks (and theirs), by distribution name: the pure-Python ones and
# polars' runtime (one build for every CPython 3), copied from this environment whatever its Python.
# The image (Python 3.12) has torch, transformers, accelerate, peft, pyarrow, fsspec, msgpack, ninja,
# py-cpuinfo, httpx, pyyaml and sympy; the compiled ones it lacks (duckdb, pydantic-core) travel as
# CPython 3.12 wheels (the device README's ``pip download``) and are installed there with pip.
# typer and rich travel though the image has them: gndpo needs typer 0.26's vendored click.
MISSING = (
    "deepspeed", "hjson", "pydantic", "annotated-types", "typing-inspection", "polars", "polars-runtime-32",
    "math-verify", "latex2sympy2-extended", "antlr4-python3-runtime", "typer", "rich", "markdown-it-py", "mdurl", "shellingham",
)


def distribution_files(name: str) -> list[tuple[Path, str]]:
    """(file on disk, its path in the site folder) for every file distribution ``name`` installed."""
    dist = distribution(name)
    return [(Path(dist.locate_file(f)), str(f)) for f in dist.files or [] if not str(f).startswith("..") and "__pycache__" not in str(f)]


def pack(out: Path, names: tuple[str, ...]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz", preset=6) as tar:
        for name in names:
            try:
                files = distribution_files(name)
            except PackageNotFoundError:
                sys.exit(f"error: {name} is not installed in this environment")
            for path, arcname in files:
                if path.is_file():
                    tar.add(path, arcname=arcname)
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB, {len(names)} distributions")


def unpack(archive: Path, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    link = folder / "gndpo"
    if not link.exists():
        link.symlink_to(Path(__file__).resolve().parents[1])
    print(f"{folder}: PYTHONPATH={folder}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--skip", nargs="*", default=[], help="distributions of MISSING the target already has")
    u = sub.add_parser("unpack")
    u.add_argument("archive", type=Path)
    u.add_argument("folder", type=Path)
    a = ap.parse_args(argv)
    if a.command == "pack":
        pack(a.out, tuple(n for n in MISSING if n not in a.skip))
    else:
        unpack(a.archive, a.folder)


if __name__ == "__main__":
    main()
