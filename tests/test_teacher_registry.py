"""The teacher interface: backends come from one registry by ``score.backend``, nothing else compares
the setting with a backend's name, and a backend added the documented way (a class and one registry
line) scores a round."""

from __future__ import annotations

import typing
from pathlib import Path

import numpy as np
import pytest

from gndpo.pipeline.settings.schema import ScoreConfig
from gndpo.stages.teachers.base import TeacherBackend
from gndpo.stages.teachers.hf import HFBackend
from gndpo.stages.teachers.registry import TEACHER_BACKENDS
from tests.code_scan import backend_comparisons as comparisons_in
from tests.code_scan import findings
from tests.conftest import committed_rows, invoke_ok, model_logprob_tol, model_logprobs, run_stages

ROOT = Path(__file__).resolve().parents[1]
# The places that may name a backend: the config schema declares the choices (and its checks refuse
# the settings one backend cannot take, whenever a config is read), the registry maps them.
MAY_NAME_BACKENDS = {"pipeline/settings/schema.py", "pipeline/config/checks.py", "stages/teachers/registry.py"}


def backend_comparisons(root: Path) -> list[str]:
    """Every comparison of score.backend with a name under ``root``'s code folders, outside the places
    that may name a backend."""
    return findings(root, MAY_NAME_BACKENDS, comparisons_in)


def test_no_code_outside_the_registry_and_the_schema_compares_the_backend_with_a_name():
    assert backend_comparisons(ROOT) == []


def test_the_check_finds_a_comparison(tmp_path):
    """The check can fail: the comparisons gndpo had before the registry are each reported."""
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "score.py").write_text(
        'def f(cfg, score_cfg, backend):\n'
        '    a = cfg.score.backend == "vllm"\n'
        '    b = score_cfg.backend in ("vllm", "server")\n'
        '    c = "hf" != backend\n')
    assert [f.split(": ")[0] for f in backend_comparisons(tmp_path)] == ["stages/score.py:2", "stages/score.py:3", "stages/score.py:4"]


def test_the_registry_holds_every_choice_the_schema_declares():
    choices = typing.get_args(typing.get_type_hints(ScoreConfig)["backend"])
    assert set(TEACHER_BACKENDS) == set(choices)
    for backend in TEACHER_BACKENDS.values():
        assert issubclass(backend, TeacherBackend) and backend.capabilities is not None


class CountingTeacher:
    """The wrapped teacher of :class:`WrappedHF`: scores through the transformers teacher, counting rows."""

    rows = 0

    def __init__(self, inner):
        self.inner = inner

    def score(self, rows, topk):
        CountingTeacher.rows += rows.n
        return self.inner.score(rows, topk)


class WrappedHF(TeacherBackend):
    """The suite's extra backend, added as docs/development/architecture.md says (a class and one
    registry line): the transformers teacher, wrapped."""

    capabilities = HFBackend.capabilities

    def __init__(self, setup):
        super().__init__(setup)
        self.inner = HFBackend(setup)

    def teacher(self, teachers):
        return CountingTeacher(self.inner.teacher(teachers))

    def columns(self, name, path, prompts):
        return self.inner.columns(name, path, prompts)


@pytest.mark.slow
def test_an_added_backend_scores_a_round_through_the_registry(rolled_out, tiny_assets, tmp_path, monkeypatch):
    """The extra backend takes ``score.backend: hf``'s registry line (the schema's choices are
    fixed at load): score builds it, and every stored teacher log-prob is the teacher's, recomputed here."""
    monkeypatch.setitem(TEACHER_BACKENDS, "hf", WrappedHF)
    CountingTeacher.rows = 0
    new = tmp_path / "run"
    invoke_ok("fork", rolled_out, new, "--from-round", "0")
    run_stages(new, "score", "normalize", "train")
    rollouts = {r["rollout_id"]: r for r in committed_rows(rolled_out)}
    scores = committed_rows(new, "score")
    assert CountingTeacher.rows == len(scores) == len(rollouts) > 0
    tol = model_logprob_tol(tiny_assets / "teacher")  # two float32 forwards of it (tests/conftest.py)
    for s in scores[:8]:
        r = rollouts[s["rollout_id"]]
        want = model_logprobs(tiny_assets / "teacher", r["prompt_token_ids"], r["response_token_ids"])
        np.testing.assert_allclose(s["teacher_logprobs"], want, **tol)
