"""gndpo's local cache: one folder (``$GNDPO_CACHE``, default ``~/.cache/gndpo``) for what is built or
fetched once and reused by every run on the machine: the demo tasks' toys and converted real models,
vLLM's copies of a run's models, run-reference teachers downloaded from object storage, and the worker
logs of runs that live there. A folder is built in place atomically (:func:`cached_build`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """``$GNDPO_CACHE``, default ``~/.cache/gndpo`` (not created)."""
    return Path(os.environ.get("GNDPO_CACHE", Path.home() / ".cache" / "gndpo"))


def cache_dir(name: str) -> Path:
    """The cache's folder ``name``, created if missing."""
    folder = cache_root() / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def cached_build(name: str, build, root: Path | None = None) -> Path:
    """``root/name`` (default root: :func:`cache_root`), made by ``build(folder)`` first if it is not
    there (``info.json`` marks a finished build). Builds go to a temporary folder that is renamed into
    place (:func:`staged_folder`), so a crashed build leaves nothing and two processes building at once
    both end with one complete folder."""
    dest = (root or cache_root()) / name
    if (dest / "info.json").exists():
        return dest
    try:
        with staged_folder(dest) as tmp:
            build(tmp)
    except FileExistsError:  # another process finished the same build first; theirs is identical
        pass
    return dest


@contextmanager
def staged_folder(dest: Path):
    """A fresh temporary folder beside ``dest`` to write into; renamed to ``dest`` (which must not exist,
    or be an empty folder) when the block completes, removed when it raises: ``dest`` is either
    complete or absent. FileExistsError if ``dest`` was filled meanwhile."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    try:
        yield tmp
        try:
            tmp.rename(dest)
        except OSError as exc:
            raise FileExistsError(f"{dest} exists and is not empty") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
