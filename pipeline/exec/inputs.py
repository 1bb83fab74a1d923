"""What a stage reads: declared by the stage, resolved by the executor.

A stage class says which committed stages it reads, in the order they run (``reads = (Read("rollout"),
Read("score"))``; a stage of the previous round with ``previous_round=True``, as train reads the policy
round k-1's train exported; the train that exported the policy a round samples with, k-1 less the run's
staleness, with ``sampling_policy=True``). :class:`StageInputs` finds their manifests (a fork's inherited
ones included), refuses in one line to start a stage whose input is not committed, and hands the stage
the manifests and their files: no stage looks another up by name, and the order of a round is what
the stages read, not a list kept apart.

A read with ``per_unit=True`` is of single committed units: unit u of the reading stage reads unit u
of the read stage, and may start once that one unit is committed (score streaming behind rollout).
Such a stage plans from the read stage's plan, and the executor claims only its units whose input unit
is committed (:meth:`StageInputs.unit_ready`). Run without following (``follow=False``: a stage started
on its own, one after another), the read is still of the whole committed stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gndpo.errors import GndpoError
from gndpo.pipeline.run.run import Run
from gndpo.storage.records import Commit, Manifest

PLAN_POLL_S = 1.0  # seconds between looks for the plan of a stage that is being followed
READY_LIST_S = 0.5  # the least seconds between two listings of a followed stage's commits


@dataclass(frozen=True)
class Read:
    """One committed stage a stage reads: of its own round, of the previous one, or the train that
    exported the round's sampling policy; whole, or unit by unit."""

    stage: str
    previous_round: bool = False
    sampling_policy: bool = False
    per_unit: bool = False

    def round_of(self, run: Run, round_idx: int) -> int:
        if self.sampling_policy:
            return run.sampling_version(round_idx) - 1
        return round_idx - 1 if self.previous_round else round_idx


class StageInputs:
    """The committed manifests a stage of round ``round_idx`` reads (its ``reads``), fetched once; with
    ``follow``, its per-unit reads answer unit by unit while the read stage still runs."""

    def __init__(self, run: Run, round_idx: int, reads: tuple[Read, ...], follow: bool = False):
        self.run, self.round, self.reads, self.follow = run, round_idx, reads, follow
        self._manifests: dict[str, Manifest] = {}
        self._ready: dict[str, set[str]] = {}  # per-unit read stage -> its units seen committed
        self._listed_at = -float("inf")

    def require(self, stage: str) -> None:
        """A one-line GndpoError naming the latest input of ``stage`` that is not committed (round -1's
        inputs, before the first round, are none; a followed per-unit read is awaited, not required)."""
        for read in reversed(self.reads):
            r = read.round_of(self.run, self.round)
            if read.per_unit and self.follow:
                continue
            if r >= 0 and self.run.records(r, read.stage).manifest() is None:
                raise GndpoError(f"cannot run {stage} of round {self.round}: {read.stage} of round {r} is not committed")

    def _records(self, stage: str):
        """The records of the read ``stage`` in the round the read names."""
        return self.run.records(self._read(stage).round_of(self.run, self.round), stage)

    def _read(self, stage: str) -> Read:
        read = next((r for r in self.reads if r.stage == stage), None)
        if read is None:
            raise LookupError(f"{stage} is not among this stage's reads ({', '.join(r.stage for r in self.reads)})")
        return read

    def manifest(self, stage: str) -> Manifest:
        """The committed manifest of the read ``stage`` (a stage the class did not declare is a bug: a
        LookupError, not a user's error)."""
        if stage not in self._manifests:
            self._manifests[stage] = self._records(stage).require_manifest()
        return self._manifests[stage]

    def files(self, stage: str) -> list[dict]:
        """The file records of the read ``stage``'s manifest, in unit order; for rollout, its response
        shards (the evaluation unit's file is not one)."""
        manifest = self.manifest(stage)
        return manifest.response_shards() if stage == "rollout" else manifest.files()

    # -- per-unit reads ------------------------------------------------------------------------------
    def per_unit(self) -> Read | None:
        """The stage's per-unit read, if it has one."""
        return next((r for r in self.reads if r.per_unit), None)

    def plan_units(self, stage: str, on_wait=None) -> list[dict]:
        """The units of the read ``stage``'s plan, waiting for the plan while following (the stage read
        may not have started yet; ``on_wait`` is called once if it has not); without following, its
        committed manifest's."""
        records = self._records(stage)
        waited = False
        while self.follow and records.manifest() is None and records.plan() is None:
            if not waited and on_wait is not None:
                on_wait()
            waited = True
            time.sleep(PLAN_POLL_S)
        if not self.follow or records.manifest() is not None:
            return [{"unit": c.unit} for c in self.manifest(stage).units]
        return records.plan()["units"]

    def unit_ready(self, unit: str) -> bool:
        """Whether ``unit``'s input unit (the same-named unit of the per-unit read) is committed; always,
        without a per-unit read. One listing of the read stage's commits per call while any is missing."""
        read = self.per_unit()
        if read is None:
            return True
        seen = self._ready.setdefault(read.stage, set())
        # At most one listing per READY_LIST_S: a worker asks of every pending unit in each pass.
        if unit not in seen and time.monotonic() - self._listed_at > READY_LIST_S:
            seen |= self._records(read.stage).done_units()
            self._listed_at = time.monotonic()
        return unit in seen

    def committed_units(self, stage: str) -> list[Commit]:
        """The commit records of the read ``stage``'s units committed so far, in unit order."""
        records = self._records(stage)
        return [c for c in (records.done(u) for u in sorted(records.done_units())) if c is not None]

    def unit_commit(self, stage: str, unit: str) -> Commit:
        """The commit record of ``unit`` of the read ``stage`` (committed: :meth:`unit_ready` said so)."""
        commit = self._records(stage).done(unit)
        if commit is None:
            raise GndpoError(f"{stage} unit {unit} of round {self.round} is not committed")
        return commit
