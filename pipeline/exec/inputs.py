"""What a stage reads: declared by the stage, resolved by the executor.

A stage class says which committed stages it reads, in the order they run (``reads = (Read("rollout"),
Read("score"))``; a stage of the previous round with ``previous_round=True``, as rollout reads the
policy round k-1's train exported). :class:`StageInputs` finds their manifests (a fork's inherited
ones included), refuses in one line to start a stage whose input is not committed, and hands the stage
the manifests and their files: no stage looks another up by name, and the order of a round is what
the stages read, not a list kept apart.

Every read today is of a whole committed stage. A read of single committed units (score streaming
behind rollout, each score unit waiting only for the rollout unit it scores) keeps this shape: the
declaration gains the unit mapping, and :class:`StageInputs` answers per unit.
"""

from __future__ import annotations

from dataclasses import dataclass

from gndpo.errors import GndpoError
from gndpo.pipeline.run.run import Run
from gndpo.storage.records import Manifest


@dataclass(frozen=True)
class Read:
    """One committed stage a stage reads: of its own round, or of the previous one."""

    stage: str
    previous_round: bool = False

    def round_of(self, round_idx: int) -> int:
        return round_idx - 1 if self.previous_round else round_idx


class StageInputs:
    """The committed manifests a stage of round ``round_idx`` reads (its ``reads``), fetched once."""

    def __init__(self, run: Run, round_idx: int, reads: tuple[Read, ...]):
        self.run, self.round, self.reads = run, round_idx, reads
        self._manifests: dict[str, Manifest] = {}

    def require(self, stage: str) -> None:
        """A one-line GndpoError naming the latest input of ``stage`` that is not committed (round -1's
        inputs, before the first round, are none)."""
        for read in reversed(self.reads):
            r = read.round_of(self.round)
            if r >= 0 and self.run.records(r, read.stage).manifest() is None:
                raise GndpoError(f"cannot run {stage} of round {self.round}: {read.stage} of round {r} is not committed")

    def manifest(self, stage: str) -> Manifest:
        """The committed manifest of the read ``stage`` (a stage the class did not declare is a bug: a
        LookupError, not a user's error)."""
        if stage not in self._manifests:
            read = next((r for r in self.reads if r.stage == stage), None)
            if read is None:
                raise LookupError(f"{stage} is not among this stage's reads ({', '.join(r.stage for r in self.reads)})")
            self._manifests[stage] = self.run.records(read.round_of(self.round), stage).require_manifest()
        return self._manifests[stage]

    def files(self, stage: str) -> list[dict]:
        """The file records of the read ``stage``'s manifest, in unit order; for rollout, its response
        shards (the evaluation unit's file is not one)."""
        manifest = self.manifest(stage)
        return manifest.response_shards() if stage == "rollout" else manifest.files()
