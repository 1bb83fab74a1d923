"""The records of one stage of one round: plan, claims, heartbeats, commit records, manifest.

Layout (docs/concepts/run-folder.md)::

    rounds/r0003/<stage>/plan.json                      work units, written once
    rounds/r0003/<stage>/claims/<unit>/a001.json        lease for attempt 1 (exclusive create)
    rounds/r0003/<stage>/claims/<unit>/a001.hb          heartbeat (overwritten while the lease lives)
    rounds/r0003/<stage>/data/<unit>/a001/...           the attempt's immutable output files
    rounds/r0003/<stage>/done/<unit>.json               commit record (exclusive create)
    rounds/r0003/<stage>/_MANIFEST.json                 written last; what later stages and SQL read

Everything here is a record operation; the policy (who may claim what, when a lease is stale) lives in
``gndpo.pipeline.exec.units``.
"""

from __future__ import annotations

import json
import time
from typing import Generic

from gndpo.errors import GndpoError
from gndpo.storage.bell import CommitBell
from gndpo.storage.products import Commit, FileRecord, Manifest, N, Plan, Unit, UnitNumbers
from gndpo.storage.runfs import RunFS


def round_prefix(round_idx: int) -> str:
    return f"rounds/r{round_idx:04d}"


class StageRecords(Generic[N]):
    """Read and create the records of ``stage`` in round ``round_idx`` of a run; its units' numbers read
    as ``numbers`` (the stage's own type; the executor's fields alone by default)."""

    def __init__(self, run: RunFS, round_idx: int, stage: str, numbers: type[N] = UnitNumbers):
        self.run = run
        self.round = round_idx
        self.stage = stage
        self.numbers = numbers
        self.prefix = f"{round_prefix(round_idx)}/{stage}"

    # -- plan -------------------------------------------------------------------------------------
    def plan(self) -> Plan | None:
        """The stage's plan (units and the inputs they read), or None before a worker wrote it."""
        record = self.run.read_json_or_none(f"{self.prefix}/plan.json")
        return None if record is None else Plan.of(record)

    def create_plan(self, units: list[Unit], inputs: dict) -> Plan:
        """Write the plan once; if another worker won the race, return theirs (it must agree)."""
        plan = Plan(self.round, self.stage, units, inputs)
        if self.run.create_json(f"{self.prefix}/plan.json", plan.to_json()):
            CommitBell(self.run).ring()  # a stage that streams behind this one plans from it
        else:
            plan = self.plan()
        if plan.ids() != [u.id for u in units]:
            raise GndpoError(f"{self.run.uri(self.prefix)}/plan.json was planned from different inputs")
        return plan

    # -- leases -----------------------------------------------------------------------------------
    def attempts(self, unit: str) -> list[int]:
        names = self.run.listdir(f"{self.prefix}/claims/{unit}")
        return sorted(int(n[1:4]) for n in names if n.startswith("a") and n.endswith(".json"))

    def claim_path(self, unit: str, attempt: int) -> str:
        return f"{self.prefix}/claims/{unit}/a{attempt:03d}.json"

    def create_claim(self, unit: str, attempt: int, body: dict) -> bool:
        return self.run.create_json(self.claim_path(unit, attempt), body)

    def read_claim(self, unit: str, attempt: int) -> dict:
        return self.run.read_json(self.claim_path(unit, attempt))

    def _beat_path(self, unit: str, attempt: int) -> str:
        return f"{self.prefix}/claims/{unit}/a{attempt:03d}.hb"

    def heartbeat(self, unit: str, attempt: int, state: dict | None = None) -> None:
        """The attempt is alive now; ``state``: what its worker says of itself meanwhile (`gndpo status`)."""
        beat = {"t": time.time(), **({"state": state} if state else {})}
        self.run.fs.pipe_file(self.run.path(self._beat_path(unit, attempt)), json.dumps(beat).encode())

    def release(self, unit: str, attempt: int) -> None:
        """Give the lease up: its last heartbeat says so, and other workers may take the unit at once."""
        self.run.fs.pipe_file(self.run.path(self._beat_path(unit, attempt)), json.dumps({"t": time.time(), "released": True}).encode())

    def last_beat(self, unit: str, attempt: int) -> dict | None:
        """The attempt's newest heartbeat, ``{"t": seconds since the epoch, "released": bool, "state":
        what its worker said of itself, or {}}``, or None."""
        try:
            beat = json.loads(self.run.read_bytes(self._beat_path(unit, attempt)))
            return {"t": float(beat["t"]), "released": bool(beat.get("released", False)), "state": beat.get("state") or {}}
        except (GndpoError, ValueError, KeyError, TypeError):
            return None

    def attempt_dir(self, unit: str, attempt: int) -> str:
        return f"{self.prefix}/data/{unit}/a{attempt:03d}"

    # -- commits ----------------------------------------------------------------------------------
    def _record(self, path: str) -> dict | None:
        """The JSON record at ``path`` under this stage's folder, or None."""
        return self.run.read_json_or_none(f"{self.prefix}/{path}")

    def done(self, unit: str) -> Commit[N] | None:
        """``unit``'s commit (its files' records and the unit's own numbers), or None if not done."""
        record = self._record(f"done/{unit}.json")
        return None if record is None else Commit.of(record, self.numbers)

    def done_units(self) -> set[str]:
        """The ids of the units with a done marker."""
        return {n[: -len(".json")] for n in self.run.listdir(f"{self.prefix}/done") if n.endswith(".json")}

    def commit(self, unit: Unit, attempt: int, files: list[FileRecord], numbers: UnitNumbers) -> bool:
        """Make an attempt's files visible. False if another attempt committed the unit first."""
        commit = Commit(unit.id, attempt, files, sum(f.rows for f in files), sum(f.bytes for f in files), time.time(), numbers, unit.kind)
        created = self.run.create_json(f"{self.prefix}/done/{unit.id}.json", commit.to_json())
        if created:
            CommitBell(self.run).ring()  # a stage streaming behind this one may take the unit's successor now
        return created

    # -- waits ------------------------------------------------------------------------------------
    def note_wait(self, worker: str, waited: dict[str, float]) -> None:
        """What one worker of this stage waited, in seconds by cause (``waits/<worker>.json``, written once)."""
        self.run.create_json(f"{self.prefix}/waits/{worker.replace(':', '-')}.json", {"worker": worker, **waited})

    def waits(self) -> list[dict]:
        """Every worker's :meth:`note_wait` record of this stage."""
        return [w for n in self.run.listdir(f"{self.prefix}/waits") if (w := self._record(f"waits/{n}")) is not None]

    # -- pruning (`gndpo gc --keep-rounds`) --------------------------------------------------------
    def pruned(self) -> dict | None:
        """What `gndpo gc --keep-rounds` removed of this stage's committed files, or None."""
        return self.run.read_json_or_none(f"{self.prefix}/_PRUNED.json")

    def mark_pruned(self, body: dict) -> None:
        """Record, before anything is removed, that ``body["folders"]`` are being removed: a reader then
        says so instead of failing on a missing file, even if the removal stops half-way."""
        self.run.create_json(f"{self.prefix}/_PRUNED.json", body)

    # -- manifest ---------------------------------------------------------------------------------
    def manifest(self) -> Manifest[N] | None:
        """The stage's manifest (committed: its files, their records and the stage's metrics), or None."""
        record = self._record("_MANIFEST.json")
        return None if record is None else Manifest.of(record, self.numbers)

    def require_manifest(self) -> Manifest[N]:
        """The manifest; a one-line GndpoError naming the stage and round where it is not committed."""
        m = self.manifest()
        if m is None:
            raise GndpoError(f"stage {self.stage} of round {self.round} is not committed yet ({self.run.uri(self.prefix)})")
        return m

    def create_manifest(self, body: dict) -> tuple[Manifest[N], bool]:
        """Write the manifest once; a concurrent writer's identical manifest is accepted. Returns the
        manifest and whether this call wrote it."""
        body = {"round": self.round, "stage": self.stage, **body}
        created = self.run.create_json(f"{self.prefix}/_MANIFEST.json", body)
        if created:
            CommitBell(self.run).ring()  # the stages that read this one may start
        return self.manifest(), created


class InheritedRecords(StageRecords):
    """A forked run's view of a stage it takes from its parent run: the parent's records, read-only,
    with every file record marked with the parent's URL (``run``), so that readers open the file
    there (:meth:`RunFS.holding`) and it is never copied."""

    def _record(self, path: str) -> dict | None:
        return _mark(super()._record(path), self.run.url)

    def _refuse(self, *_args, **_kwargs):
        raise GndpoError(f"stage {self.stage} of round {self.round} is inherited from {self.run.url}; a fork never writes it")

    create_plan = create_claim = commit = create_manifest = heartbeat = release = _refuse


def _mark(obj, url: str):
    """``obj`` with ``run: url`` added to every file record (a dict with a path and a sha256) in it."""
    if isinstance(obj, dict):
        out = {k: _mark(v, url) for k, v in obj.items()}
        if "path" in obj and "sha256" in obj:
            out["run"] = url
        return out
    if isinstance(obj, list):
        return [_mark(v, url) for v in obj]
    return obj

