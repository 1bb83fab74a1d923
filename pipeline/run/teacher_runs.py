"""Teachers that are another run's trained policy: ``teacher: run:RUN`` or ``run:RUN@K``.

``RUN`` is a run folder or URL, ``K`` a policy version of it (the student after K trained rounds); without
``@K`` the newest policy committed when this run is created. ``gndpo init`` resolves each reference once
(:func:`resolve_reference`) and records the resolution in the new run's ``run.yaml`` under
``teacher_runs``: the parent's URL, the version, the folder train committed it to, and every file's
size and sha256, each checked against the parent's commit record at that moment. The reference stays in
the config (it is the teacher's name in the score shards and part of the run's fingerprint); every
later reader maps it to a local folder through the record (:func:`teacher_folder`), so the parent may
train further rounds without changing what this run's teacher is.
"""

from __future__ import annotations

import os
from pathlib import Path

from gndpo.errors import GndpoError
from gndpo.pipeline.settings.schema import RUN_TEACHER, split_run_teacher
from gndpo.storage.products import FileRecord
from gndpo.storage.runfs import RunFS, file_sha256


def is_reference(teacher: str) -> bool:
    """Whether a configured teacher names another run's policy (``run:...``) rather than a model folder."""
    return teacher.startswith(RUN_TEACHER)


def parse_reference(teacher: str) -> tuple[str, int | None]:
    """(run URL, policy version or None for the newest) of ``run:RUN`` or ``run:RUN@K``."""
    url, version = split_run_teacher(teacher)
    if not url:
        raise GndpoError(f"teacher {teacher!r} names no run: write run:RUN_FOLDER or run:RUN_FOLDER@K")
    if version and not version.isdigit():
        raise GndpoError(f"teacher {teacher!r}: the policy version after @ must be a whole number (K: the student after K trained rounds)")
    return (url if "://" in url else os.path.abspath(url)), (int(version) if version else None)


def references(teachers: dict[str, str]) -> list[str]:
    """The run references among a config's teacher values."""
    return sorted({t for t in teachers.values() if is_reference(t)})


def resolve_reference(reference: str, parent, cache_root: str) -> dict:
    """The resolution of ``reference`` in ``parent`` (the :class:`~gndpo.pipeline.run.run.Run` it names),
    with each file of the referenced policy checked against the parent's commit record where later
    stages read it (:meth:`RunFS.local_dir` under ``cache_root``: the parent's own folder, or the one
    download a remote parent needs). One-line errors for a parent with no trained policy yet, without
    the version, or whose files were removed or changed."""
    try:
        policy = parent.committed_policy(parse_reference(reference)[1])
    except GndpoError as exc:
        raise GndpoError(f"teacher {reference}: {exc}") from None
    holder = policy.records.run
    folder = Path(holder.local_dir(policy.model_dir, cache_root))
    start = len(policy.model_dir) + 1
    files = [FileRecord(f.path[start:], f.bytes, f.sha256) for f in policy.files]
    for record in files:
        local = folder / record.path
        if not local.is_file() or file_sha256(local) != record.sha256:
            raise GndpoError(f"teacher {reference}: {holder.uri(policy.model_dir)}/{record.path} differs from its commit record (sha256)")
    return {"run": holder.url, "policy": policy.version, "model_dir": policy.model_dir, "files": [f.to_json() for f in files]}


def teacher_folder(reference: str, resolution: dict, cache_root: str, storage_options: dict | None = None) -> str:
    """A local folder with the files ``resolution`` recorded for ``reference`` (the parent's own folder
    when it is on a local or shared filesystem, else a cached download), each still of its recorded size."""
    fs = RunFS(resolution["run"], storage_options)
    folder = fs.local_dir(resolution["model_dir"], cache_root)
    for record in map(FileRecord.of, resolution["files"]):
        path = os.path.join(folder, record.path)
        if not os.path.isfile(path) or os.path.getsize(path) != record.bytes:
            raise GndpoError(f"teacher {reference}: {fs.uri(resolution['model_dir'])}/{record.path} is gone or changed since this run "
                             f"was created (was `gndpo gc --keep-rounds` run on {resolution['run']}?)")
    return folder
