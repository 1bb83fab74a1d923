"""What a stage commits, as types: its files' records, its units, a unit's commit and the stage's manifest.

A committed stage is a manifest (``_MANIFEST.json``) listing its units' commits in plan order; each
commit lists the files its attempt wrote (:class:`FileRecord`: path, bytes, sha256, rows, what the
file holds) and the numbers the stage computed for it. The numbers' fields are the stage's own: a
stage declares their type (a :class:`UnitNumbers` subclass) and reads its own and other stages'
commits through it, so nothing between the stages is a dict read by key. Every record written since
the first release reads into these types (fields added later have defaults; a unit's kind was once
told by its id alone, :data:`LEGACY_HELDOUT_UNIT`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from gndpo.storage.meter import Phases


class FileKind(str, Enum):
    """What a committed file holds: rows of the stage's table (the default, not written in records),
    or a held-out evaluation's output."""

    ROWS = "rows"
    HELDOUT_ACCURACY = "eval"  # the greedy held-out responses with their rewards (one row per prompt)
    HELDOUT_ROLLOUTS = "heldout_rollouts"  # held-out responses as rollout rows, for score's teacher to read


@dataclass(frozen=True)
class FileRecord:
    """One committed file: where it is (``path``, relative to the run that holds it: ``run``, a forked
    run's parent's URL for a file it inherited, else None), its size and sha256, its row count (0 for
    a file that is not a table) and what it holds."""

    path: str
    bytes: int
    sha256: str
    rows: int = 0
    kind: FileKind = FileKind.ROWS
    run: str | None = None

    @classmethod
    def of(cls, raw: dict) -> FileRecord:
        return cls(raw["path"], raw["bytes"], raw["sha256"], raw.get("rows", 0), FileKind(raw.get("kind", FileKind.ROWS)), raw.get("run"))

    def to_json(self) -> dict:
        """The record as written: ``rows`` where the file is a table, ``kind`` and ``run`` where set."""
        out = {"path": self.path, "bytes": self.bytes, "sha256": self.sha256}
        if self.rows:
            out["rows"] = self.rows
        if self.kind is not FileKind.ROWS:
            out["kind"] = self.kind.value
        if self.run is not None:
            out["run"] = self.run
        return out

    def under(self, folder: str) -> bool:
        """Whether the file is inside the run-relative ``folder``."""
        return self.path.startswith(f"{folder.rstrip('/')}/")


class UnitKind(str, Enum):
    """A unit of the stage's own work, or the held-out evaluation a stage runs beside it (its numbers are
    a measure of the policy, not the stage's data)."""

    WORK = "work"
    HELDOUT_EVAL = "heldout_eval"


# The held-out evaluation unit's id in records written before units carried their kind.
LEGACY_HELDOUT_UNIT = "eval-heldout"


def unit_kind(raw: dict) -> UnitKind:
    """The kind of the unit a plan entry or commit record (``raw``, as read) describes."""
    if "kind" in raw:
        return UnitKind(raw["kind"])
    return UnitKind.HELDOUT_EVAL if raw["unit"] == LEGACY_HELDOUT_UNIT else UnitKind.WORK


@dataclass(frozen=True)
class Unit:
    """A planned unit of work: a stable id, its kind, and the prompts it covers (a stage that splits the
    round by prompts; empty otherwise)."""

    id: str
    kind: UnitKind = UnitKind.WORK
    prompt_ids: tuple[str, ...] = ()

    @classmethod
    def of(cls, raw: dict) -> Unit:
        return cls(raw["unit"], unit_kind(raw), tuple(raw.get("prompt_ids", ())))

    def to_json(self) -> dict:
        out: dict = {"unit": self.id}
        if self.kind is not UnitKind.WORK:
            out["kind"] = self.kind.value
        if self.prompt_ids:
            out["prompt_ids"] = list(self.prompt_ids)
        return out

    @property
    def is_work(self) -> bool:
        return self.kind is UnitKind.WORK


class UnitNumbers(BaseModel):
    """The numbers a unit's commit carries: what the executor adds to every unit (its ``seconds``, the
    ``worker`` that computed it and where its time went, ``phases``), and in a subclass the stage's own.
    Fields a stage wrote that its type does not declare are kept (``extra``), so a record reads back
    whole whatever wrote it."""

    model_config = ConfigDict(extra="allow")

    seconds: float = 0.0
    worker: str | None = None
    phases: Phases = {}

    @classmethod
    def of(cls, raw: dict):
        return cls.model_validate(raw)

    def to_json(self) -> dict:
        """The numbers as written: the fields that were given (none filled in from defaults)."""
        return self.model_dump(mode="json", exclude_unset=True)

    def with_cost(self, seconds: float, worker: str, phases: Phases) -> UnitNumbers:
        """These numbers with the executor's: how long the unit took, on which worker, in which phases."""
        return self.model_copy(update={"seconds": seconds, "worker": worker, "phases": phases})


N = TypeVar("N", bound=UnitNumbers)
COMMIT_FIELDS = ("unit", "attempt", "files", "rows", "bytes", "committed_at", "kind")


@dataclass(frozen=True)
class Commit(Generic[N]):
    """A committed unit (``done/<unit>.json``): its files and the numbers its stage computed for it."""

    unit: str
    attempt: int
    files: list[FileRecord]
    rows: int
    bytes: int
    committed_at: float
    numbers: N
    kind: UnitKind = UnitKind.WORK

    @classmethod
    def of(cls, raw: dict, numbers: type[N] = UnitNumbers) -> Commit[N]:
        """The commit a record (``raw``, as read) describes, its numbers read as ``numbers``."""
        files = [FileRecord.of(f) for f in raw["files"]]
        own = numbers.of({k: v for k, v in raw.items() if k not in COMMIT_FIELDS})
        return cls(raw["unit"], raw["attempt"], files, raw["rows"], raw["bytes"], raw["committed_at"], own, unit_kind(raw))

    def to_json(self) -> dict:
        """The commit as its record reads (the stage's numbers beside the fixed fields)."""
        out = {"unit": self.unit, "attempt": self.attempt, "files": [f.to_json() for f in self.files], "rows": self.rows,
               "bytes": self.bytes, "committed_at": self.committed_at}
        if self.kind is not UnitKind.WORK:
            out["kind"] = self.kind.value
        return {**out, **self.numbers.to_json()}

    @property
    def is_work(self) -> bool:
        return self.kind is UnitKind.WORK


@dataclass(frozen=True)
class Manifest(Generic[N]):
    """A committed stage (``_MANIFEST.json``): its units' commits in plan order, what it was planned
    from, its metrics (by name: docs/reference/metrics.md), and when the last worker wrote it."""

    round: int
    stage: str
    units: list[Commit[N]]
    inputs: dict
    metrics: dict
    rows: int
    bytes: int
    finished_at: float

    @classmethod
    def of(cls, raw: dict, numbers: type[N] = UnitNumbers) -> Manifest[N]:
        units = [Commit.of(u, numbers) for u in raw["units"]]
        return cls(raw["round"], raw["stage"], units, raw.get("inputs", {}), raw.get("metrics", {}), raw.get("rows", sum(u.rows for u in units)),
                   raw.get("bytes", sum(u.bytes for u in units)), raw.get("finished_at", 0.0))

    def files(self) -> list[FileRecord]:
        """Every unit's files, in unit order."""
        return [f for unit in self.units for f in unit.files]

    def work(self) -> list[Commit[N]]:
        """The commits of the stage's own work (a held-out evaluation's left out)."""
        return [unit for unit in self.units if unit.is_work]

    def row_files(self) -> list[FileRecord]:
        """The stage's rows: its work units' files (a held-out evaluation's are not the stage's data)."""
        return [f for unit in self.work() for f in unit.files]

    def heldout(self) -> Commit[N] | None:
        """The held-out evaluation's commit, where the stage ran one."""
        return next((unit for unit in self.units if not unit.is_work), None)

    def only(self) -> Commit[N]:
        """The commit of a stage of one unit (normalize's statistics, train's update)."""
        return self.units[0]


@dataclass(frozen=True)
class Plan:
    """A stage's plan (``plan.json``): its units, and what it was planned from."""

    round: int
    stage: str
    units: list[Unit]
    inputs: dict = field(default_factory=dict)

    @classmethod
    def of(cls, raw: dict) -> Plan:
        return cls(raw["round"], raw["stage"], [Unit.of(u) for u in raw["units"]], raw.get("inputs", {}))

    def to_json(self) -> dict:
        return {"round": self.round, "stage": self.stage, "units": [u.to_json() for u in self.units], "inputs": self.inputs}

    def ids(self) -> list[str]:
        return [u.id for u in self.units]
