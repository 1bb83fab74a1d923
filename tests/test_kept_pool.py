"""A kept teacher server pool (score.backend server, `gndpo run` in one process, its default) is held to the
run's record of the served teacher (``served_probes``, made at init) each time a round's score worker
takes it, not only when it was made: a server redeployed with other weights between two rounds is
refused in one line by the next round's worker. The servers are fake teachers on loopback that answer
as vLLM's server does (tests/teacher_servers.py), so no model runs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from gndpo.errors import GndpoError
from gndpo.pipeline.run.run import open_run
from gndpo.stages.models.live import LiveModels
from gndpo.stages.models.loading import load_tokenizer, vocabulary_size
from gndpo.stages.models.probe import probe_token_ids
from gndpo.stages.teachers.registry import build_teacher
from gndpo.stages.teachers.served import PROBE_TEXT
from gndpo.stages.teachers.setup import ScoreSetup

from .conftest import invoke_ok, tiny_config_dict, write_config
from .teacher_servers import FakeTeacher


class RedeployableTeacher(FakeTeacher):
    """A fake teacher over ``folder``'s vocabulary that also tokenizes as its tokenizer does; its weights
    are version ``version``: version v answers at position i as the first version at position i + v."""

    def __init__(self, folder):
        self.tokens = load_tokenizer(str(folder))(PROBE_TEXT, add_special_tokens=False)["input_ids"]
        self.version = 0
        super().__init__(vocabulary=vocabulary_size(str(folder)))

    def logprobs(self, position: int) -> list[float]:
        return super().logprobs(position + self.version)

    def respond(self, path, body, headers):
        if path == "/tokenize":
            return 200, json.dumps({"tokens": self.tokens}).encode()
        return super().respond(path, body, headers)

    def checks(self) -> int:
        """How many times the pool has been checked: each check asks the server which model it serves."""
        return sum(path == "/v1/models" for _, path, _ in self.received)


@pytest.fixture
def served(tmp_path, tiny_assets):
    """(the run folder, its teacher's fake server): a run scored by one server, created against it."""
    teacher = tmp_path / "teacher"  # the served teacher's files without its weights: its server holds them
    teacher.mkdir()
    for path in (tiny_assets / "teacher").iterdir():
        if not path.name.endswith(".safetensors"):
            shutil.copy(path, teacher)
    server = RedeployableTeacher(teacher)
    cfg = tiny_config_dict(tiny_assets, teacher=str(teacher), method={"name": "reverse_kl"},
                           score={"backend": "server", "servers": [server.url], "server_model": server.model, "teacher_topk": 4})
    run = tmp_path / "run"
    try:
        invoke_ok("init", run, "--config", write_config(tmp_path, cfg))
        yield run, server
    finally:
        server.close()


def test_a_kept_pool_is_held_to_the_runs_record_when_the_next_round_takes_it(served):
    run_dir, server = served
    run = open_run(str(run_dir))
    ((name, folder),) = run.teacher_models(0).items()
    live = LiveModels(keep=True)  # `gndpo run`'s, for every round

    def take(round_idx: int):
        """What a round's score worker does first: build its teacher on the kept models."""
        setup = ScoreSetup(run, live, torch.device("cpu"), run.policy_path(0), None, None)
        return build_teacher(setup, run.teacher_models(round_idx))[1].pools

    try:
        (pool,) = take(0)
        checked = server.checks()
        (again,) = take(1)
        assert again is pool and server.checks() == checked + 1  # kept, and checked again

        server.version = 1  # redeployed between rounds, behind the same URL
        with pytest.raises(GndpoError) as refused:
            take(2)
    finally:
        live.close()
    # The gap to the record, re-derived from the fake's two versions at the probe's tokens.
    recorded = np.asarray(run.served_probes[name], np.float64)
    now = [server.logprobs(i)[token] for ids in probe_token_ids(vocabulary_size(folder)) for i, token in enumerate(ids[1:], start=1)]
    gap = float(np.abs(np.asarray(now) - recorded).mean())
    assert gap > 0.03 and str(refused.value) == (
        f"teacher server {server.url} scores the probe sequence {gap:.3g} apart from the teacher its servers served when the run "
        "was created (score.server_tolerance 0.03): it now serves other weights or another precision")
