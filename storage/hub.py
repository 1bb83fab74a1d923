"""Models named by Hugging Face Hub id: ``org/name`` or ``org/name@revision``.

``revision`` is a branch, a tag or a commit hash (default ``main``). :func:`resolve_hub_model` resolves
an id once, through ``huggingface_hub`` (its cache, ``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``,
``HF_TOKEN``, ``HF_ENDPOINT``), to the commit the revision names at that moment and a local snapshot
folder, downloading what is missing where the hub is reachable. ``gndpo init`` records
:meth:`HubModel.record` (id, revision, commit) in ``run.yaml``; every later reader asks
:func:`hub_snapshot` for that commit's folder, so a run never moves to a newer revision of its models, and
a worker on another node reads the same bytes (from its own cache, or downloaded at that commit).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from gndpo.errors import GndpoError, first_line

# org/name[@revision]: the hub's own repository-name characters; a revision has no blanks.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[^\s@]+))?$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# What counts as weights in a snapshot (transformers' and vLLM's formats).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a hub id rather than a model folder: ``org/name[@rev]``, not an existing
    path, not a URL, not an absolute or explicitly relative path."""
    if not name or "://" in name or name.startswith(("/", ".", "~")) or os.path.exists(name):
        return False
    return HUB_ID.match(name) is not None


@dataclass(frozen=True)
class HubModel:
    """A hub id resolved to one commit and a local snapshot folder of it."""

    id: str  # org/name
    revision: str  # what the config asked for: a branch, tag or commit (main when not given)
    commit: str  # the 40-hex commit the revision named when the run was created
    folder: str  # the local snapshot of that commit
    weights: bool = True  # False: a served teacher's snapshot, its weights left on the hub

    def record(self) -> dict:
        """What ``run.yaml`` keeps of the resolution (the folder is per machine)."""
        return {"id": self.id, "revision": self.revision, "commit": self.commit, **({} if self.weights else {"weights": False})}


def split_hub_id(name: str) -> tuple[str, str]:
    """(repository id, revision) of ``org/name[@revision]``; the revision defaults to ``main``."""
    match = HUB_ID.match(name)
    if match is None:
        raise GndpoError(f"{name!r} is not a hub id: write org/name or org/name@revision")
    return match["repo"], match["revision"] or "main"


def resolve_hub_model(name: str, role: str, weights: bool = True) -> HubModel:
    """``name`` (``org/name[@revision]``) resolved to a commit and its local snapshot, downloaded where
    missing and the hub is reachable (without ``weights``: its config and tokenizer only, for a teacher
    its servers hold). One-line GndpoErrors naming ``role`` for an unknown id or revision, an id that is
    neither cached nor reachable (offline), a gated model without access, and a snapshot without
    weights where they are needed."""
    repo, revision = split_hub_id(name)
    folder = _snapshot(repo, revision, role, name, weights)
    commit = Path(folder).name
    if not COMMIT.match(commit):
        raise GndpoError(f"{role} {name}: the hub cache gave {folder}, which is not a snapshots/<commit> folder")
    if weights and not any(p.name.endswith(WEIGHT_SUFFIXES) for p in Path(folder).rglob("*")):
        raise GndpoError(f"{role} {name}: the snapshot {commit[:12]} has no weights (no *.safetensors or *.bin files in {folder})")
    return HubModel(id=repo, revision=revision, commit=commit, folder=folder, weights=weights)


def hub_snapshot(record: dict, role: str = "model") -> str:
    """The local snapshot folder of a recorded resolution's commit: the cached one without asking the hub
    (a commit's files never change), else downloaded at that commit (weights only if it was resolved
    with them)."""
    weights = record.get("weights", True)
    try:
        return snapshot_download(record["id"], revision=record["commit"], local_files_only=True, ignore_patterns=_ignored(weights))
    except LocalEntryNotFoundError:
        return _snapshot(record["id"], record["commit"], role, f"{record['id']}@{record['commit'][:12]}", weights)


def _ignored(weights: bool) -> list[str] | None:
    """snapshot_download's ignore_patterns: the weight files where they are not wanted."""
    return None if weights else [f"*{suffix}" for suffix in WEIGHT_SUFFIXES]


def _snapshot(repo: str, revision: str, role: str, name: str, weights: bool = True) -> str:
    """snapshot_download with the hub library's failures as one-line GndpoErrors."""
    try:
        return snapshot_download(repo, revision=revision, ignore_patterns=_ignored(weights))
    except GatedRepoError:
        raise GndpoError(f"{role} {name} is a gated model: accept its terms on the hub and set HF_TOKEN "
                         "(or run `huggingface-cli login`) with an account that has access") from None
    except RevisionNotFoundError:
        raise GndpoError(f"{role} {name}: the hub has no revision {revision!r} of {repo}") from None
    except RepositoryNotFoundError:
        raise GndpoError(f"{role} {name}: no model {repo} on the hub (or it is private: set HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise GndpoError(f"{role} {name} is not in the Hugging Face cache and the hub cannot be reached (HF_HUB_OFFLINE or no network); "
                         f"download it first (`hf download {repo} --revision {revision}`) or name a local folder") from None
    except (HfHubHTTPError, OSError) as exc:
        raise GndpoError(f"{role} {name}: the hub download failed: {first_line(exc)}") from None
