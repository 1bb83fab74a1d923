"""score.backend: vllm against the HF teacher on the same rollouts (toy models, fp32): the teacher's
sampled-token log-probs agree within float32's rounding of a forward (tests/conftest.py's
model_logprob_tol) and its top-k ids are identical wherever the values are not tied; the student's
columns, computed by the same forward either way, are identical."""

import dataclasses

import numpy as np
import pyarrow as pa
import pytest

from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import config_from_dict
from gndpo.pipeline.run.products import ROLLOUTS
from gndpo.pipeline.run.run import open_run
from gndpo.stages.models.vllm_engine import shutdown_llm
from gndpo.stages.score import ScoreJob
from gndpo.stages.teachers.registry import check_teacher_backend
from gndpo.storage.shards import read_shard
from tests.conftest import assert_teacher_columns_agree, committed_rows, invoke_ok, model_logprob_tol, run_stages

pytestmark = pytest.mark.slow


def score_in_process(run_dir, name: str, **settings) -> tuple[dict, ScoreJob]:
    """Round 0's rollouts of ``run_dir`` scored again in this process with other ``score`` settings,
    into the folder ``name`` (nothing committed): ({rollout id: score row}, the job)."""
    run = open_run(str(run_dir))
    run.cfg = dataclasses.replace(run.cfg, score=dataclasses.replace(run.cfg.score, **settings))
    job = ScoreJob(run, 0)
    units, _ = job.plan()
    job.setup()
    rows = []
    for unit in units:
        files, _ = job.run_unit(unit, f"{name}/{unit.id}")
        rows += pa.concat_tables([read_shard(run.fs, f) for f in files]).to_pylist()
    return {r["rollout_id"]: r for r in rows}, job


@pytest.fixture(scope="module")
def backends_run(tmp_path_factory, rolled_out):
    """A fork of the rolled-out run whose round 0 the HF backend scored through the stage."""
    run_dir = tmp_path_factory.mktemp("backends") / "run"
    # forward_kl needs the teacher's top-k.
    invoke_ok("fork", rolled_out, run_dir, "--from-round", "0", "method.name=forward_kl", "score.teacher_topk=4")
    run_stages(run_dir, "score")
    return run_dir


@pytest.fixture(scope="module")
def scored(backends_run):
    """(HF rows, the same rollouts scored by the vLLM backend), by rollout id."""
    rows, job = score_in_process(backends_run, "vllm-backend", backend="vllm")
    # The engine the teacher's scorer is bound to, closed before pytest closes the streams its exit handler logs to.
    shutdown_llm(next(iter(job.teacher.scorers.values())).args[0])
    return {r["rollout_id"]: r for r in committed_rows(backends_run, "score")}, rows


def test_engine_student_logprobs_are_the_samplers_and_skip_the_students_forward(backends_run, rolled_out, tiny_assets):
    """score.student_logprobs engine: the student's column is the rollout engine's log-probs, no student
    module is loaded, the teacher's columns are the recomputing run's, and engine and forward agree."""
    recomputed = {r["rollout_id"]: r for r in committed_rows(backends_run, "score")}
    rollouts = {r["rollout_id"]: r for r in committed_rows(rolled_out, "rollout")}  # the fork's round 0 is its parent's
    rows, job = score_in_process(backends_run, "engine-student", student_logprobs="engine")
    assert job.teacher.forward.student is None
    assert rows.keys() == recomputed.keys() and len(rows) == 32
    # Two float32 computations of each model's log-probs (the teacher's forwards in other batches, the
    # student's engine against its forward): within each one's rounding (tests/conftest.py).
    teacher_tol, student_tol = model_logprob_tol(tiny_assets / "teacher"), model_logprob_tol(tiny_assets / "student")
    for key, row in rows.items():
        np.testing.assert_array_equal(row["student_logprobs"], np.float32(rollouts[key]["sampler_logprobs"]))
        np.testing.assert_allclose(row["teacher_logprobs"], recomputed[key]["teacher_logprobs"], **teacher_tol)
        assert row["teacher_topk_ids"] == recomputed[key]["teacher_topk_ids"]
        np.testing.assert_allclose(row["student_logprobs"], recomputed[key]["student_logprobs"], **student_tol)


def auto_choice(run_dir, monkeypatch, entropy_metrics: bool, engine_bits: int | None = None, **rollout) -> bool:
    """What score.student_logprobs auto chooses for round 0 of ``run_dir`` (True: the engine's log-probs),
    with ``logging.entropy_metrics``, ``rollout`` settings and, if given, the engine precision each
    rollout unit's commit records replaced."""
    run = open_run(str(run_dir))
    cfg = run.cfg
    run.cfg = dataclasses.replace(cfg, score=dataclasses.replace(cfg.score, student_logprobs="auto"),
                                  logging=dataclasses.replace(cfg.logging, entropy_metrics=entropy_metrics),
                                  rollout=dataclasses.replace(cfg.rollout, **rollout))
    job = ScoreJob(run, 0)
    if engine_bits is not None:
        commits = [dataclasses.replace(c, numbers=c.numbers.model_copy(update={"engine_dtype_bits": engine_bits}))
                   if c.numbers.engine_dtype_bits is not None else c for c in job.inputs.committed_units(ROLLOUTS)]
        monkeypatch.setattr(job.inputs, "committed_units", lambda product: commits)
    return job.student_from_engine()


def test_auto_takes_the_engines_logprobs_only_where_they_are_the_fp32_students(backends_run, monkeypatch):
    """score.student_logprobs auto: the engine's log-probs where the rollout engine sampled in fp32 and
    nothing needs the student's forward; the forward where the engine ran in 16 bits, the student's
    entropy metric is on, or the sampler's numbers are not the student's (a temperature other than 1)."""
    assert open_run(str(backends_run)).records(0, "rollout").require_manifest().metrics["engine_dtype_bits"] == 32
    assert auto_choice(backends_run, monkeypatch, entropy_metrics=False) is True
    assert auto_choice(backends_run, monkeypatch, entropy_metrics=True) is False
    assert auto_choice(backends_run, monkeypatch, entropy_metrics=False, temperature=0.7) is False
    assert auto_choice(backends_run, monkeypatch, entropy_metrics=False, engine_bits=16) is False


def test_teacher_columns_agree_within_float32_rounding(scored, tiny_assets):
    """The teacher's sampled-token and top-k log-probs within float32's rounding of a forward, its
    top-k ids identical where not tied."""
    hf, engine = scored
    assert hf.keys() == engine.keys() and len(hf) == 32
    diffs = np.concatenate([np.subtract(hf[k]["teacher_logprobs"], engine[k]["teacher_logprobs"]) for k in hf])
    print(f"teacher log-probs, vLLM vs HF: max |diff| {np.abs(diffs).max():.2e} over {diffs.size} tokens")
    assert diffs.size > 100
    assert_teacher_columns_agree([hf[k] for k in sorted(hf)], [engine[k] for k in sorted(hf)], model_logprob_tol(tiny_assets / "teacher"), topk=True)


def test_student_columns_and_row_sums_match(scored, tiny_assets):
    hf, engine = scored
    tol = model_logprob_tol(tiny_assets / "teacher")
    for k in hf:
        assert hf[k]["student_logprobs"] == engine[k]["student_logprobs"]
        assert hf[k]["n_valid"] == engine[k]["n_valid"]
        # A sum (in float64) of n_valid clipped teacher-minus-student log-probs, each within the
        # teacher's atol + rtol * |lp| <= 2 * atol: within n_valid times that.
        assert engine[k]["c_sum"] == pytest.approx(hf[k]["c_sum"], abs=2 * tol["atol"] * hf[k]["n_valid"])


@pytest.mark.parametrize("method, need", [
    ({"name": "eopd"}, "the teacher's entropy"),
    ({"name": "gndpo", "tip": {"enabled": True}}, "the full-vocabulary KL"),
    ({"name": "tropd"}, None),
    ({"name": "gndpo"}, None),
])
def test_methods_that_need_the_whole_teacher_distribution_are_refused(method, need):
    cfg = config_from_dict({"method": method, "score": {"backend": "vllm"}})
    if need is None:
        check_teacher_backend(cfg)
        return
    with pytest.raises(GndpoError, match=f"score.backend vllm .*needs {need}"):
        check_teacher_backend(cfg)
