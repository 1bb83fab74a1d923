"""The teacher-server pool under outage, against dead ports and fake teachers (no vLLM, no model): a
pool-wide outage fails in bounded time (``score.server_outage_s`` after the last answer, plus at most
one request's timeout), with one line and progress lines while it waits; a dead replica of two costs
retries, not the batch; a failed server gets no request during its cooldown and one on probation; the
client's own errors are one line naming the server; every URL is parsed when the config is read."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import config_from_dict, config_to_yaml
from gndpo.pipeline.exec.units import Worker
from gndpo.pipeline.run.run import open_run
from gndpo.stages.models import teacher_server
from gndpo.stages.models.teacher_server import ServerPool, ServerSettings
from tests.conftest import assert_one_line_error, invoke, tiny_config_dict, write_config
from tests.teacher_servers import FakeTeacher, free_port
from tests.test_leases import SlowJob

PROMPTS, RESPONSES = [[1, 2, 3]] * 48, [[4, 5, 6, 7]] * 48


@pytest.fixture
def fakes():
    servers = [FakeTeacher(), FakeTeacher()]
    yield servers
    for server in servers:
        server.close()


def pool_of(*urls: str, **settings) -> ServerPool:
    return ServerPool(ServerSettings(tuple(urls), "fake-teacher", **{"timeout_s": 2.0, "retries": 5, "in_flight": 4, **settings}))


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused


def test_a_total_outage_fails_within_the_deadline_plus_one_timeout(caplog):
    pool = pool_of(dead_url(), dead_url(), outage_s=2.0)
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="gndpo"), pytest.raises(GndpoError) as failure:
        pool.response_logprobs(PROMPTS, RESPONSES, 4)
    took = time.monotonic() - start
    pool.close()
    # Before the deadline the pool waits for a server to come back; after it, at most one request's timeout.
    assert 2.0 <= took <= 2.0 + 2.0 + 1.0, took
    message = str(failure.value)
    assert "\n" not in message and message.startswith("every teacher server failed for") and "score.server_outage_s 2" in message
    assert all(f"{s.url}: ConnectError" in message for s in pool.servers), message
    lines = [r.getMessage() for r in caplog.records]
    assert sum("out of the pool for 1s" in line for line in lines) == 2, lines  # each server's first cooldown, once
    waiting = [line for line in lines if line.startswith("every teacher server is failing")]
    assert waiting and "the unit fails in" in waiting[0] and len(waiting) <= 2, waiting  # one line every 10 s at most


def test_a_dead_replica_of_two_costs_retries_not_the_batch(fakes):
    alone = pool_of(fakes[0].url)
    expected = alone.response_logprobs(PROMPTS, RESPONSES, 4)
    alone.close()
    pool = pool_of(dead_url(), fakes[1].url, outage_s=1.0)
    got = pool.response_logprobs(PROMPTS, RESPONSES, 4)
    pool.close()
    for key in ("logprobs", "topk_ids", "topk_logprobs"):
        assert (got[key] == expected[key]).all(), key
    assert pool.cooldowns >= 1 and pool.retries >= 1
    assert pool.states()[pool.servers[1].url] == "up" and pool.states()[pool.servers[0].url].startswith(("out for", "on probation"))


def test_a_failed_server_gets_nothing_in_its_cooldown_and_one_request_on_probation(fakes, monkeypatch):
    """Fake A fails every request; B answers. After A's first failure (a 1 s cooldown), A receives no
    request for that second, then exactly one (probation) before it fails again; the batch completes on B."""
    monkeypatch.setattr(teacher_server, "COOLDOWN_S", (1.0, 1.0))  # every cooldown 1 s: the test sees several
    failing, healthy = fakes
    # B takes 10 ms an answer, 2 at a time: the batch lasts 2 s at least whatever the machine, so A's
    # cooldown ends before it does and A gets its probation request.
    monkeypatch.setattr(healthy, "delay_s", 0.01)
    failing.failing = True
    pool = pool_of(failing.url, healthy.url, in_flight=2)
    many = 400
    pool.response_logprobs([[1, 2, 3]] * many, [[4, 5, 6, 7]] * many, 0)
    pool.close()
    times = [t for t, path, _ in failing.received if path == "/v1/completions"]
    assert len(healthy.received) + len(times) >= many and len(times) >= 2
    # The first failure's requests were in flight together (at most in_flight); after them, one a cooldown.
    first_wave = [t for t in times if t - times[0] < 0.5]
    assert len(first_wave) <= 2, times
    later = times[len(first_wave):]
    assert all(b - a >= 0.95 for a, b in zip([first_wave[-1], *later], later)), times


def test_every_request_forces_the_teachers_raw_distribution(fakes):
    """What the docs promise of each scoring request, read from the requests a server received: the
    response's token ids as the prompt, one token to generate, its prompt log-probs with the top-k, and
    temperature 1, top-p 1, no top-k, no min-p, no penalties (a server's defaults may differ)."""
    pool = pool_of(fakes[0].url)
    pool.response_logprobs(PROMPTS[:4], RESPONSES[:4], 4)
    pool.close()
    scoring = [payload for _, path, payload in fakes[0].received if path == "/v1/completions"]
    assert len(scoring) == 4
    for payload in scoring:
        assert payload == {"model": "fake-teacher", "prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 1, "prompt_logprobs": 4, "temperature": 1.0,
                           "top_p": 1.0, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                           "repetition_penalty": 1.0, "seed": 0}


def test_the_clients_own_errors_are_one_line_naming_the_server():
    pool = pool_of("http:///nothing")
    with pytest.raises(GndpoError, match=r"teacher server http:///nothing: UnsupportedProtocol"):
        pool.request("/v1/models", None)
    pool.close()


@pytest.mark.parametrize("url, problem", [("http://127.0.0.1:notaport", "Invalid port: 'notaport'"), ("http://", "no host"),
                                          ("http://127.0.0.1:70000", "port 70000 is not 1-65535"), ("ftp://h:1", "scheme ftp")])
def test_a_malformed_server_url_is_one_line_at_init_and_nothing_is_written(url, problem, tmp_path, tiny_assets):
    config = write_config(tmp_path, tiny_config_dict(tiny_assets, score={"backend": "server", "servers": [url]}))
    result = invoke("init", tmp_path / "run", "--config", config)
    assert_one_line_error(result, f"score.servers: {url!r} is not a URL ({problem}")
    assert not (tmp_path / "run").exists()
    with pytest.raises(GndpoError, match="is not a URL"):
        config_from_dict({"score": {"backend": "server", "servers": {"a": ["http://a:1"], "b": [url]}}, "teachers": {"a": "x", "b": "y"}})


class ScoringJob(SlowJob):
    """A score unit that takes ``seconds`` while its pool's states are what the worker's heartbeats carry,
    as ScoreJob's do (``live_state``)."""

    def __init__(self, fs, pool: ServerPool, seconds: float):
        super().__init__(fs, seconds)
        self.pool = pool

    def live_state(self):
        return {"servers": self.pool.states()}


def test_status_shows_each_live_score_workers_servers(tmp_path, fakes):
    """A score worker's heartbeats carry its pool's states; `gndpo status` shows them under the table
    while the worker holds the unit: the dead server out of the pool with its last error, the live one up.
    (The run folder is a run.yaml of the defaults: status reads records, not models.)"""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.yaml").write_text(config_to_yaml(config_from_dict({})))
    pool = pool_of(dead := dead_url(), fakes[0].url)
    pool.response_logprobs(PROMPTS[:8], RESPONSES[:8], 0)  # the dead one fails and goes out of the pool
    run = open_run(str(tmp_path / "run"))
    worker = Worker(run.records(0, "score"), ScoringJob(run.fs, pool, seconds=1.5), ttl=0.4, log=lambda *_: None)
    thread = threading.Thread(target=worker.run)
    thread.start()
    time.sleep(0.8)  # a heartbeat or two (every ttl/4)
    shown = invoke("status", tmp_path / "run").output
    thread.join()
    pool.close()
    line = next(line for line in shown.splitlines() if line.startswith("round 0 score u0: teacher servers"))
    assert f"{dead} out for" in line or f"{dead} on probation" in line, line
    assert "ConnectError" in line and f"{fakes[0].url} up" in line, line


def test_an_idle_pool_starts_the_outage_clock_with_its_work(fakes):
    """A kept pool (gndpo run, between rounds) whose last answer was long ago still waits the whole
    deadline for a server to come back when its next work finds every server failing."""
    pool = pool_of(fakes[0].url, outage_s=1.0)
    pool.response_logprobs(PROMPTS[:2], RESPONSES[:2], 0)
    pool.last_answer -= 3600  # an hour idle
    fakes[0].failing = True
    start = time.monotonic()
    with pytest.raises(GndpoError, match="every teacher server failed for"):
        pool.response_logprobs(PROMPTS[:2], RESPONSES[:2], 0)
    pool.close()
    assert 1.0 <= time.monotonic() - start <= 1.0 + 2.0 + 1.0


def test_a_request_no_server_can_answer_fails_the_batch_in_bounded_time(fakes):
    """One server that answers every request but one: that request's failures count against its
    score.server_retries while the server answers others; once the others are answered the server
    looks as dead as in an outage, so the request fails at the latest score.server_outage_s later, in
    one line with the server's error."""
    fakes[0].poison = {9}
    pool = pool_of(fakes[0].url, retries=2, outage_s=1.5)
    start = time.monotonic()
    with pytest.raises(GndpoError, match="cannot answer this one") as failure:
        pool.response_logprobs([[1, 2]] * 40 + [[9, 2]], [[3, 4]] * 41, 0)
    pool.close()
    assert time.monotonic() - start < 1.5 + 2.0 + 8.0  # the outage time, a timeout, a backoff
    assert "\n" not in str(failure.value)
    assert sum(1 for _, path, body in fakes[0].received if path == "/v1/completions" and body["prompt"][0] == 9) >= 2  # retried
