"""The served teacher's record, without servers: what :func:`check_servers` holds each server to (the
record init kept, else the first server), that an answer no distance can be taken from is refused, and
that a run made from a recorded teacher (a fork, a re-init) keeps the record rather than today's answers."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import config_from_dict
from gndpo.stages.teachers import served
from gndpo.stages.teachers.served import ServerBackend, check_servers
from tests.conftest import tiny_config_dict

TOKENS = [5, 6, 7]  # the probe text's tokens, as the teacher's tokenizer and every server give them


class Pool:
    """Servers that serve model ``t`` and tokenize as the teacher does; each answers the probe as given."""

    def __init__(self, answers: dict[str, list[float]]):
        self.answers, self.settings = answers, SimpleNamespace(model="t")
        self.servers = [SimpleNamespace(url=url) for url in answers]

    def request(self, path, body, server):
        return {"data": [{"id": "t"}]} if path == "/v1/models" else {"tokens": TOKENS}


def tokenizer(text, add_special_tokens):
    return {"input_ids": TOKENS}


@pytest.fixture
def probes(monkeypatch):
    monkeypatch.setattr(served, "server_probe", lambda pool, server, probe: np.asarray(pool.answers[server.url], np.float32))


def test_each_server_is_held_to_the_record_and_an_unmeasurable_answer_is_refused(probes):
    assert check_servers(Pool({"a": [-1.0, -2.0], "b": [-1.001, -2.0]}), tokenizer, 8, 0.01) == [-1.0, -2.0]
    with pytest.raises(GndpoError, match="^teacher server b scores the probe sequence 0.5 apart from a "):
        check_servers(Pool({"a": [-1.0, -2.0], "b": [-1.0, -3.0]}), tokenizer, 8, 0.01)
    # A server whose log-probs are not numbers (an overflowing precision) is as far from any record as can be.
    for answers, recorded in (({"a": [-1.0, -2.0], "b": [math.nan, -2.0]}, None), ({"a": [math.nan, -2.0]}, [-1.0, -2.0])):
        server = list(answers)[-1]
        with pytest.raises(GndpoError, match=f"^teacher server {server} scores the probe sequence nan apart"):
            check_servers(Pool(answers), tokenizer, 8, 0.01, recorded)


def test_a_run_made_from_a_record_keeps_the_record(tiny_assets, monkeypatch):
    cfg = config_from_dict(tiny_config_dict(tiny_assets, score={"backend": "server", "servers": ["http://127.0.0.1:1"], "server_model": "t"}))
    today = SimpleNamespace(probe=[-1.004, -2.0], close=lambda: None)  # within tolerance of the record, not equal to it
    held_to = []
    monkeypatch.setattr(served, "checked_pool", lambda settings, folder, tolerance, recorded=None: held_to.append(recorded) or today)
    monkeypatch.setattr(served, "check_against_weights", lambda *args: None)
    name, record = cfg.teacher, [-1.0, -2.0]
    # Kept as it was: each fork recording today's answers would let the teacher drift a tolerance per fork.
    assert ServerBackend.check_teachers(cfg, cfg, False, {name: record}) == {name: record}
    assert ServerBackend.check_teachers(cfg, cfg, False) == {name: today.probe}  # a new run records its servers' answers
    assert held_to == [record, None]
