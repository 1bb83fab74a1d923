"""What a stage reads: declared by the stage, resolved by the executor.

A stage class says which committed products it reads (:mod:`gndpo.pipeline.run.products`), in the
order they are made (``reads = (Read(ROLLOUTS), Read(SCORES))``; one of the previous round with
``previous_round=True``, as train reads the policy round k-1's train exported; the policy a round samples
with, k-1 less the run's staleness, with ``sampling_policy=True``). :class:`StageInputs` finds their
manifests (a fork's inherited ones included), refuses in one line to start a stage whose input is not
committed, and hands the stage what it reads, typed: a product's manifest and row files, the round's
statistics and the policy to start from. It is the only way into another stage's output: no stage
looks another up by name (train's resume reads the optimizer state carried to it through the typed
train product, :func:`gndpo.pipeline.run.products.carried_state`).

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
from gndpo.pipeline.methods.base import Stats
from gndpo.pipeline.run.products import POLICY, PolicyExport, Product, policy_export
from gndpo.pipeline.run.run import Run, require_exported
from gndpo.pipeline.run.stats import statistics
from gndpo.storage.bell import CommitBell
from gndpo.storage.products import Commit, FileRecord, Manifest, N, Unit
from gndpo.storage.records import StageRecords

READY_LIST_S = 0.5  # the least seconds between two listings of a followed stage's commits


@dataclass(frozen=True)
class Read:
    """One committed product a stage reads: of its own round, of the previous one, or the policy the
    round samples with; whole, or unit by unit."""

    product: Product
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
            if r >= 0 and self.run.records(r, read.product).manifest() is None:
                raise GndpoError(f"cannot run {stage} of round {self.round}: {read.product.stage} of round {r} is not committed")

    def _records(self, product: Product[N]) -> StageRecords[N]:
        """The records of the read ``product`` in the round the read names."""
        return self.run.records(self._read(product).round_of(self.run, self.round), product)

    def _read(self, product: Product) -> Read:
        read = next((r for r in self.reads if r.product == product), None)
        if read is None:
            raise LookupError(f"{product.stage} is not among this stage's reads ({', '.join(r.product.stage for r in self.reads)})")
        return read

    def manifest(self, product: Product[N]) -> Manifest[N]:
        """The committed manifest of the read ``product`` (one the class did not declare is a bug: a
        LookupError, not a user's error)."""
        if product.stage not in self._manifests:
            self._manifests[product.stage] = self._records(product).require_manifest()
        return self._manifests[product.stage]

    def files(self, product: Product) -> list[FileRecord]:
        """The row files of the read ``product``, in unit order (a held-out evaluation's files are not
        the stage's rows)."""
        return self.manifest(product).row_files()

    def statistics(self, product: Product) -> Stats:
        """The statistics the read ``product`` (a normalize stage's) holds."""
        return statistics(self.run.fs, self.manifest(product))

    # -- the policy ----------------------------------------------------------------------------------
    def policy_export(self) -> PolicyExport | None:
        """What the read train stage exported (None before the first round: the config's student)."""
        if self._read(POLICY).round_of(self.run, self.round) < 0:
            return None
        require_exported(self._records(POLICY))
        return policy_export(self.manifest(POLICY))


    # -- per-unit reads ------------------------------------------------------------------------------
    def per_unit(self) -> Read | None:
        """The stage's per-unit read, if it has one."""
        return next((r for r in self.reads if r.per_unit), None)

    def plan_units(self, product: Product, on_wait=None) -> list[Unit]:
        """The units of the plan of the stage that makes the read ``product``, waiting for the plan while
        following (that stage may not have started yet; ``on_wait`` is called once if it has not);
        without following, its committed manifest's."""
        records = self._records(product)
        waited, bell = False, CommitBell(self.run.fs)
        try:
            while self.follow and records.manifest() is None and records.plan() is None:
                if not waited and on_wait is not None:
                    on_wait()
                waited = True
                bell.wait(self.run.cfg.run.poll_seconds)
        finally:
            bell.close()
        if not self.follow or records.manifest() is not None:
            return [Unit(c.unit, c.kind) for c in self.manifest(product).units]
        return records.plan().units

    def unit_ready(self, unit: str) -> bool:
        """Whether ``unit``'s input unit (the same-named unit of the per-unit read) is committed; always,
        without a per-unit read. One listing of the read stage's commits per call while any is missing."""
        read = self.per_unit()
        if read is None:
            return True
        seen = self._ready.setdefault(read.product.stage, set())
        # At most one listing per READY_LIST_S: a worker asks of every pending unit in each pass.
        if unit not in seen and time.monotonic() - self._listed_at > READY_LIST_S:
            seen |= self._records(read.product).done_units()
            self._listed_at = time.monotonic()
        return unit in seen

    def look_again(self) -> None:
        """The next :meth:`unit_ready` lists the read stage's commits whenever it last did (a commit woke the
        caller)."""
        self._listed_at = -float("inf")

    def committed_units(self, product: Product[N]) -> list[Commit[N]]:
        """The commits of the read ``product``'s units committed so far, in unit order."""
        records = self._records(product)
        return [c for c in (records.done(u) for u in sorted(records.done_units())) if c is not None]

    def unit_commit(self, product: Product[N], unit: str) -> Commit[N]:
        """The commit of ``unit`` of the read ``product`` (committed: :meth:`unit_ready` said so)."""
        commit = self._records(product).done(unit)
        if commit is None:
            raise GndpoError(f"{product.stage} unit {unit} of round {self.round} is not committed")
        return commit
