"""A run folder written by an earlier release's code resumes with this one.

tests/data/run-6262a7f.tar.xz was written by gndpo at 6262a7f, before the stage products were typed
(tests/data/make_run_6262a7f.py): round 0 whole, round 1's rollout and score, on the suite's tiny toy.
Its records read into today's types (the held-out unit then had no kind, only its id; the train commit's
export and optimizer state were plain fields), and `gndpo run` finishes round 1 from them: normalize over
the old shards, train from the old export and the optimizer state the old round carried.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from gndpo.pipeline.exec.status import stage_rows
from gndpo.pipeline.run.products import POLICY, ROLLOUTS, SCORES, carried_state
from gndpo.pipeline.run.run import open_run
from gndpo.storage.products import FileKind, UnitKind
from tests.conftest import gndpo, invoke_ok

pytestmark = pytest.mark.slow
ARCHIVE = Path(__file__).parent / "data" / "run-6262a7f.tar.xz"
# Where the generating machine had the toy and the config (the run's paths name them).
WRITTEN_WITH = {"/tmp/oldcache/toy-efdca1341a29": "{toy}", "/tmp/oldgen": "{folder}"}


def unpacked(tmp_path: Path, toy: Path) -> Path:
    """The archived run under ``tmp_path``, its config pointed at this machine's toy (the same spec) and folder."""
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(tmp_path, filter="data")
    config = tmp_path / "run" / "run.yaml"
    text = config.read_text()
    for old, new in WRITTEN_WITH.items():
        text = text.replace(old, new.format(toy=toy, folder=tmp_path))
    config.write_text(text)
    return tmp_path / "run"


def test_a_run_written_by_6262a7f_reads_into_the_types_and_finishes_its_round(tmp_path, tiny_assets):
    run_dir = unpacked(tmp_path, tiny_assets)
    run = open_run(str(run_dir))
    # The old records, typed: the held-out unit known by its id, its file by its kind.
    for r in (0, 1):
        rollouts = run.records(r, ROLLOUTS).require_manifest()
        heldout = rollouts.heldout()
        assert heldout is not None and heldout.kind is UnitKind.HELDOUT_EVAL and [f.kind for f in heldout.files] == [FileKind.HELDOUT_ACCURACY]
        assert sum(f.rows for f in rollouts.row_files()) == 32 and all(f.kind is FileKind.ROWS for f in rollouts.row_files())
        assert sum(u.numbers.responses for u in rollouts.work()) == 32 and heldout.numbers.eval.accuracy is not None
        assert sum(u.numbers.tokens for u in run.records(r, SCORES).require_manifest().units) > 0
    export = run.exported(1)
    assert export.model_dir.endswith("/model") and any(f.path.endswith("model.safetensors") for f in export.files)
    state = carried_state(run.records(0, POLICY))
    assert state is not None and state.world == 1 and state.file_records()

    # This code finishes round 1: normalize over the old shards, train from the old export and state.
    invoke_ok("--quiet", "run", run_dir, "--rounds", 2)
    update = open_run(str(run_dir)).records(1, POLICY).require_manifest().only().numbers
    assert update.optimizer_state_resumed and len(update.steps) == 2 and update.model_dir.startswith("rounds/r0001/train/")
    assert [(row["round"], row["stage"], row["state"]) for row in stage_rows(open_run(str(run_dir)))] == [
        (r, s, "committed") for r in (0, 1) for s in ("rollout", "score", "normalize", "train")]
    out = gndpo("sql", run_dir, "SELECT count(*) AS n FROM rollouts r JOIN scores s USING (round, rollout_id)", "--format", "csv").stdout
    assert out.split() == ["n", "64"]
