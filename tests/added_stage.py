"""A stage added the way docs/how-to/extending.md describes: this module and one registry line
(:data:`gndpo.stages.registry.STAGE_REGISTRY`). It runs between score and normalize, reads the round's
scores, and commits each score shard's count of scored tokens and how many of them the teacher found
more likely than the student did, as one small table per score unit."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from gndpo.pipeline.exec.inputs import Read
from gndpo.pipeline.exec.stage import StageJob
from gndpo.pipeline.run.products import SCORES, Product
from gndpo.storage.products import Commit, Unit, UnitNumbers
from gndpo.storage.shards import read_shard, write_shard


class AuditNumbers(UnitNumbers):
    tokens: int = 0
    teacher_prefers: int = 0


AUDIT = Product("audit", AuditNumbers)


class AuditJob(StageJob):
    """One unit per score unit: the shard's scored tokens, and those where lpT > lpS."""

    makes = AUDIT
    reads = (Read(SCORES),)

    def plan(self):
        return [Unit(c.unit) for c in self.inputs.manifest(SCORES).work()], {"scores": len(self.inputs.files(SCORES))}

    def run_unit(self, unit, out_dir):
        scored = read_shard(self.run.fs, self.inputs.unit_commit(SCORES, unit.id).files[0], ["teacher_logprobs", "student_logprobs"])
        teacher = np.concatenate(scored.column("teacher_logprobs").to_numpy(zero_copy_only=False))
        student = np.concatenate(scored.column("student_logprobs").to_numpy(zero_copy_only=False))
        numbers = AuditNumbers(tokens=len(teacher), teacher_prefers=int((teacher > student).sum()))
        table = pa.table({"tokens": [numbers.tokens], "teacher_prefers": [numbers.teacher_prefers]})
        return [write_shard(self.run.fs, f"{out_dir}/audit.parquet", table)], numbers

    def summarize(self, commits: list[Commit[AuditNumbers]]) -> dict:
        tokens = sum(c.numbers.tokens for c in commits)
        return {"tokens": tokens, "teacher_prefers_fraction": sum(c.numbers.teacher_prefers for c in commits) / max(tokens, 1)}
