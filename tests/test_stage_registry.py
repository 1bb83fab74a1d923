"""The stage registry: the round loop, the scheduler and the stage commands take their stages from it,
nothing else names a stage (a scan of the package, with its self-test), and a stage added the
documented way (a module and one registry line: tests/added_stage.py) runs in a round."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from gndpo.pipeline.exec.status import stage_rows
from gndpo.pipeline.run.products import ROUND, SCORES
from gndpo.pipeline.run.run import open_run
from gndpo.stages import registry
from gndpo.stages.registry import STAGE_REGISTRY, JobRef, job_class
from tests.added_stage import AUDIT
from tests.code_scan import findings, stage_name_uses
from tests.conftest import invoke_ok, tiny_config_dict, write_config

ROOT = Path(__file__).resolve().parents[1]
# The places that may name a stage: the registry, and the declarations of what each stage commits.
MAY_NAME_STAGES = {"stages/registry.py", "pipeline/run/products.py"}


def stage_name_lookups(root: Path) -> list[str]:
    """Every comparison with, or lookup by, a registered stage's name under ``root``'s code folders,
    outside the places that may name a stage."""
    return findings(root, MAY_NAME_STAGES, lambda tree: stage_name_uses(tree, set(STAGE_REGISTRY)))


def test_no_code_outside_the_registry_compares_or_looks_up_a_stage_by_name():
    assert stage_name_lookups(ROOT) == []


def test_the_scan_finds_a_planted_lookup(tmp_path):
    """The scan can fail: each way the code named stages before the registry is reported."""
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "score.py").write_text(
        'def f(run, r, stage, by, peak):\n'
        '    a = run.records(r - 1, "train").manifest()\n'
        '    b = stage == "rollout"\n'
        '    c = peak.stage not in ("rollout", "score")\n'
        '    d = by[(r, "normalize")]\n'
        '    e = (r, "train") in by\n'
        '    g = self.inputs.files("score")\n'
        '    h = run.prompts("train")  # a prompt split, not a stage\n')
    assert [f.split(": ")[0] for f in stage_name_lookups(tmp_path)] == [f"stages/score.py:{n}" for n in range(2, 8)]


def test_every_registered_stage_makes_its_own_product_and_a_round_makes_the_four_in_order():
    for name, ref in STAGE_REGISTRY.items():
        assert job_class(name).makes.stage == name and ref.help
    assert [p.stage for p in ROUND] == list(STAGE_REGISTRY)


@pytest.mark.slow
def test_a_stage_added_with_one_registry_line_runs_in_a_round(tmp_path, tiny_assets, monkeypatch):
    """The audit stage (tests/added_stage.py) registered between score and normalize: `gndpo run` runs it
    in its place, its manifest holds what it read from score's shards, and `gndpo status` shows it."""
    stages = list(STAGE_REGISTRY.items())
    at = [name for name, _ in stages].index(SCORES.stage) + 1
    monkeypatch.setattr(registry, "STAGE_REGISTRY", dict([*stages[:at], (AUDIT.stage, JobRef("tests.added_stage", "AuditJob", "Audit.")), *stages[at:]]))
    run_dir = tmp_path / "run"
    cfg = tiny_config_dict(tiny_assets, rollout={"backend": "hf", "eval_heldout": False})
    invoke_ok("init", run_dir, "--config", write_config(tmp_path, cfg))
    invoke_ok("--quiet", "run", run_dir, "--rounds", 1)
    run = open_run(str(run_dir))
    scores, audit = run.records(0, SCORES).require_manifest(), run.records(0, AUDIT).require_manifest()
    tokens = sum(len(row["teacher_logprobs"]) for f in scores.row_files() for row in pq.read_table(run_dir / f.path).to_pylist())
    assert [u.unit for u in audit.units] == [u.unit for u in scores.work()] and audit.metrics["tokens"] == tokens > 0
    assert sum(u.numbers.tokens for u in audit.units) == tokens
    # It ran in its place: after score committed, before normalize started.
    normalize = run.records(0, "normalize").require_manifest()
    assert scores.finished_at <= audit.finished_at <= min(u.committed_at for u in normalize.units)
    assert sorted((row["stage"], row["state"]) for row in stage_rows(run)) == sorted((s, "committed") for s in registry.STAGE_REGISTRY)
