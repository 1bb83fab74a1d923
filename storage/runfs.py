"""The run folder: one fsspec filesystem plus a root, and the only code that touches it.

Everything a stage persists goes through :class:`RunFS`, so a run folder can be a local path, a shared
filesystem or an object store URL (``s3://bucket/run``) without the stages knowing. Two primitives carry
the crash-safety protocol (docs/concepts/run-folder.md):

* :meth:`RunFS.create` writes a file only if it does not exist yet (exclusive create). Locally it writes a
  temporary file and hard-links it into place, which fails if the target exists; on object stores it uses
  ``pipe_file(mode="create")`` (a conditional PUT). Bodies are never empty: an empty object is not an
  exclusive marker on S3.
* Data files are written under attempt-scoped folders and are never overwritten, so a reader that follows
  commit records and manifests never sees a half-written file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import fsspec.asyn

from gndpo.errors import GndpoError
from gndpo.faults import crash_point
from gndpo.storage.meter import charge_write
from gndpo.storage.products import FileRecord


class RunFS:
    """A run folder addressed by URL; paths given to methods are relative to its root."""

    def __init__(self, url: str, storage_options: dict | None = None):
        if not url.strip():  # "" would be the current folder, turned into a run by init
            raise GndpoError("the run folder path is empty")
        self.url = url.rstrip("/")
        self.storage_options = storage_options
        fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.fs = fs
        self.root = root.rstrip("/")
        self.is_local = "file" in _protocols(fs)
        if self.is_local:
            self.root = os.path.abspath(self.root)
        # The parent runs' folders :meth:`holding` has opened, by URL. Per instance, not per process: a
        # parent is opened with this run's storage options, so a run opened with other options (other
        # credentials, another endpoint) never reuses a filesystem opened with these.
        self._others: dict[str, RunFS] = {}

    # -- addressing -------------------------------------------------------------------------------
    def path(self, rel: str) -> str:
        """The filesystem path (no protocol) of ``rel``."""
        return f"{self.root}/{rel}" if rel else self.root

    def uri(self, rel: str) -> str:
        """A URL that other tools (DuckDB, vLLM for local paths) can open."""
        p = self.path(rel)
        if self.is_local:
            return p
        proto = _protocols(self.fs)[0]
        return f"{proto}://{p}"

    def holding(self, record: FileRecord) -> "RunFS":
        """The run folder a file record's ``path`` is relative to: this one, or, for a record a forked
        run inherited (it carries ``run``, the parent's URL), the parent's."""
        url = record.run
        if not url or url == self.url:
            return self
        if url not in self._others:
            self._others[url] = RunFS(url, self.storage_options)
        return self._others[url]

    # -- reading ----------------------------------------------------------------------------------
    def _fresh(self, path: str) -> str:
        """Drop cached listings: other workers, on other machines, change the folder under us."""
        if not self.is_local:
            self.fs.invalidate_cache(path)
        return path

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self._fresh(self.path(rel)))

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self.fs.cat_file(self._fresh(self.path(rel)))
        except FileNotFoundError:
            raise GndpoError(f"missing file in run folder: {self.uri(rel)}") from None

    def read_json(self, rel: str) -> Any:
        data = self.read_bytes(rel)
        try:
            return json.loads(data)
        except ValueError:
            raise GndpoError(f"corrupt JSON record: {self.uri(rel)}") from None

    def read_json_or_none(self, rel: str) -> Any:
        return self.read_json(rel) if self.exists(rel) else None

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under ``rel``; empty if it does not exist."""
        path = self._fresh(self.path(rel))
        try:
            entries = self._entries(path)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def _entries(self, path: str) -> list[str]:
        # s3fs's ls answers an empty or missing prefix by listing its parent too (to tell a missing
        # folder from a file), so a never-claimed unit's claims folder cost a listing of every unit's
        # (bench/executor_scale.py: claiming grew from 50 to 104 s per 1,000 units). Its one-prefix
        # listing has no such fallback; other object stores check the prefix exists first.
        if self.is_local:
            return self.fs.ls(path, detail=False)
        if hasattr(self.fs, "_lsdir"):
            return [e["name"] for e in fsspec.asyn.sync(self.fs.loop, self.fs._lsdir, path)]
        return self.fs.ls(path, detail=False) if self.fs.exists(path) else []

    # -- writing ----------------------------------------------------------------------------------
    def create(self, rel: str, data: bytes) -> bool:
        """Write ``data`` to ``rel`` only if nothing is there. Returns False if it already existed."""
        if not data:
            raise ValueError("exclusive records must have a body")
        target = self.path(rel)
        if self.is_local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = os.path.join(os.path.dirname(target), f".tmp-{uuid.uuid4().hex}")
            # 0o666 less the umask, like any file a tool creates (mkstemp's 0600 would hide the run's
            # records from everyone else who may read it: colleagues, service accounts, other jobs' uids).
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.link(tmp, target)  # atomic, and fails if target exists
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        try:
            self.fs.pipe_file(target, data, mode="create")
            return True
        except FileExistsError:
            return False

    def create_json(self, rel: str, obj: Any) -> bool:
        return self.create(rel, json.dumps(obj, indent=1, sort_keys=True).encode())

    def write_new(self, rel: str, data: bytes) -> FileRecord:
        """Write an immutable data file and return its record (path, bytes, sha256).

        Locally the bytes go to a temporary name first and are renamed into place, so a crash never
        leaves a truncated file under the final name.
        """
        target = self.path(rel)
        start = time.perf_counter()
        if self.is_local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = f"{target}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                crash_point("storage.write")
                f.write(data[len(data) // 2 :])
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        else:
            self.fs.pipe_file(target, data)
        charge_write(len(data), time.perf_counter() - start)
        return FileRecord(rel, len(data), hashlib.sha256(data).hexdigest())

    def staging_dir(self, rel: str) -> tempfile.TemporaryDirectory:
        """A temporary local folder to write files into (a model export, an engine's state) that
        :meth:`move_dir_in` then makes ``rel``'s: beside ``rel`` when the run is local, so that the
        move renames each file into place instead of writing it a second time; the system's temporary
        folder otherwise. Removed when the context exits; a process killed before that leaves it in the
        folder above ``rel`` (an attempt's folder, which `gndpo gc` removes once nothing refers to it)."""
        if not self.is_local:
            return tempfile.TemporaryDirectory(prefix="gndpo-staging-")
        parent = os.path.dirname(self.path(rel))
        os.makedirs(parent, exist_ok=True)
        return tempfile.TemporaryDirectory(dir=parent, prefix=f".{os.path.basename(rel)}.staging-")

    def move_dir_in(self, local_dir: str | Path, rel: str) -> list[FileRecord]:
        """Make every file under a local folder an immutable file of the run under ``rel``, moved where
        it can be (:meth:`move_in`); returns their records."""
        local_dir = Path(local_dir)
        files = sorted(p for p in local_dir.rglob("*") if p.is_file())
        return [self.move_in(f"{rel}/{f.relative_to(local_dir).as_posix()}", f) for f in files]

    def move_in(self, rel: str, local: Path) -> FileRecord:
        """:meth:`write_new` for a file on local disk, never read whole into memory: on a local run's own
        filesystem it is made durable and renamed into place (``local`` is gone after), on another one
        copied, to an object store uploaded. Returns its record (path, bytes, sha256)."""
        target = self.path(rel)
        start = time.perf_counter()
        size, digest = local.stat().st_size, file_sha256(local)
        if self.is_local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.stat(local).st_dev != os.stat(os.path.dirname(target)).st_dev:
                copied = Path(f"{target}.{uuid.uuid4().hex}.tmp")
                shutil.copyfile(local, copied)
                local = copied
            with open(local, "rb") as f:
                os.fsync(f.fileno())  # its bytes on disk before its name is: a crash never leaves a short file
            os.replace(local, target)
        else:
            self.fs.put_file(str(local), target)
        charge_write(size, time.perf_counter() - start)
        return FileRecord(rel, size, digest)

    def local_dir(self, rel: str, cache_root: str | Path) -> str:
        """A local path holding ``rel``: itself for local runs, else a cached download."""
        if self.is_local:
            return self.path(rel)
        key = hashlib.sha1(self.uri(rel).encode()).hexdigest()[:16]
        dest = Path(cache_root) / key
        if not (dest / ".complete").exists():
            tmp = Path(tempfile.mkdtemp(dir=cache_root, prefix=".dl-"))
            src = self._fresh(self.path(rel).rstrip("/"))
            for remote in self.fs.find(src):
                local = tmp / remote[len(src) + 1 :]
                local.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(remote, str(local))
            (tmp / ".complete").write_text("ok")
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
        return str(dest)

    def rm(self, rel: str, recursive: bool = True) -> None:
        try:
            self.fs.rm(self.path(rel), recursive=recursive)
        except FileNotFoundError:
            pass


def _protocols(fs) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def export_files(source: RunFS, files: list[FileRecord], prefix: str, dest_url: str, storage_options: dict | None = None) -> list[FileRecord]:
    """Copy committed ``files`` (records: path, bytes, sha256) of ``source`` into the folder ``dest_url``
    (a path or URL that must not exist yet, or be an empty folder), named by their path under
    ``prefix``. Each file is checked against its record's sha256 before anything reaches ``dest_url``;
    a local folder then appears whole (staged beside it and renamed), an object store's is uploaded
    and removed again if the upload fails. Returns the written files' records, relative to ``dest_url``."""
    dest = RunFS(dest_url, storage_options)
    root = dest.path("").rstrip("/")
    if dest.fs.exists(root) and (not dest.fs.isdir(root) or dest.fs.ls(root)):
        raise GndpoError(f"{dest_url} exists and is not an empty folder; give a new folder")
    staging_parent = os.path.dirname(os.path.abspath(root)) if dest.is_local else None
    if staging_parent:
        os.makedirs(staging_parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=staging_parent, prefix=f".{os.path.basename(root)}.export-") as tmp:
        staged = Path(tmp) / "out"
        written = []
        for record in files:
            name = record.path[len(prefix):].lstrip("/")
            local = staged / name
            local.parent.mkdir(parents=True, exist_ok=True)
            source.fs.get_file(source.path(record.path), str(local))
            if file_sha256(local) != record.sha256:
                raise GndpoError(f"{source.uri(record.path)} differs from its commit record (sha256); nothing was exported")
            written.append(FileRecord(name, record.bytes, record.sha256))
        if dest.is_local:
            if os.path.isdir(root):
                os.rmdir(root)  # empty (checked above): the staged folder takes its place
            os.rename(staged, root)
        else:
            try:
                dest.fs.put(f"{staged}/", root, recursive=True)  # the trailing slash: its files, not the folder
            except BaseException:
                if dest.fs.exists(root):
                    dest.fs.rm(root, recursive=True)
                raise
    return written
