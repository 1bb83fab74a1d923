"""The teacher-server pool under outage, against dead ports and fake teachers (no vLLM, no model): a
pool-wide outage fails in bounded time (``score.server_outage_s`` after the later of the last answer
and the last server's first failure, plus at most one request's timeout), with one line and progress
lines while it waits; the outage clock itself, read on a clock the test sets; a request that fails
while other servers answer is sent exactly 1 + ``score.server_retries`` times; a dead replica of two
costs retries, not the batch; a failed server gets no request during its cooldown and one on
probation; the client's own errors are one line naming the server; every URL is parsed when the config
is read, its port 1-65535."""

from __future__ import annotations

import logging
import re
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


def pool_of(*urls: str, clock=time.monotonic, **settings) -> ServerPool:
    return ServerPool(ServerSettings(tuple(urls), "fake-teacher", **{"timeout_s": 2.0, "retries": 5, "in_flight": 4, **settings}), clock=clock)


class SetClock:
    """A pool's clock that reads ``now`` (the test sets it), or real time plus ``skipped`` once set going:
    what a request lasted on the pool's clock without the test waiting for it."""

    def __init__(self, now: float | None = None):
        self.now, self.skipped = now, 0.0

    def __call__(self) -> float:
        return self.now if self.now is not None else time.monotonic() + self.skipped


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


def test_the_outage_clock_starts_when_the_last_server_fails_and_not_again_at_each_failure():
    """The outage clock, on a clock the test sets: while one server is up there is no outage; it starts
    when the last server fails, however long before that the last answer came (a 100 s request in
    flight is no outage), and stays there while servers go on failing (a probation request fails every
    cooldown); score.server_outage_s after its start the pool fails, in one line naming each server's
    last error; an answer stops it. A clock restarted at each failure would never run out."""
    clock = SetClock(now=1000.0)
    pool = pool_of("http://a:1", "http://b:1", outage_s=60.0, clock=clock)
    a, b = pool.servers
    clock.now = 1100.0  # a's request, sent with the work at 1000, fails after 100 s
    pool._failed(a, "ReadTimeout")
    assert pool.failing_since is None and pool._outage_left(1100.0) is None  # b answers
    clock.now = 1101.0
    pool._failed(b, "ConnectError")
    assert pool.last_answer == 1000.0 and pool.failing_since == 1101.0
    assert pool._outage_left(1101.0) == 60.0  # the whole deadline, not 60 - 101
    clock.now = 1103.0  # a's probation request, after its 1 s cooldown, fails too
    pool._failed(a, "ConnectError")
    assert a.failures == 2 and pool.failing_since == 1101.0
    assert pool._outage_left(1160.5) == 0.5
    with pytest.raises(GndpoError) as failure:
        pool._outage_left(1161.0)
    assert str(failure.value) == ("every teacher server failed for 60s (score.server_outage_s 60): "
                                  "http://a:1: ConnectError; http://b:1: ConnectError")
    clock.now = 1170.0
    pool._succeeded(b)
    assert pool.failing_since is None and pool.last_answer == 1170.0 and pool._outage_left(1170.0) is None
    pool.close()


def test_an_outage_after_a_long_request_waits_the_deadline_from_its_failure(fakes):
    """The pool's only server takes 100 s (on the pool's clock) to answer a request, with a 503: the
    last answer was 100 s before the outage began, and the pool still waits score.server_outage_s for
    the server to come back, from that failure on, before it fails (counting from the last answer
    alone, it would fail at once)."""
    clock = SetClock()
    server = fakes[0]
    answer = server.respond

    def slow_then_failing(path, body, headers):
        if not server.failing:
            server.failing = True
            clock.skipped += 100.0
        return answer(path, body, headers)

    server.respond = slow_then_failing
    pool = pool_of(server.url, outage_s=1.5, clock=clock)
    start = time.monotonic()
    with pytest.raises(GndpoError) as failure:
        pool.response_logprobs(PROMPTS[:1], RESPONSES[:1], 4)
    took = time.monotonic() - start
    pool.close()
    assert pool.failing_since - pool.last_answer >= 100.0  # the outage began 100 s after the last answer
    # Reported at the deadline, at most one request's timeout (and a wake-up) later; never 100 s.
    down = int(re.match(r"every teacher server failed for (\d+)s ", str(failure.value)).group(1))
    assert 1 <= down <= 1.5 + 2.0 + 1.0, failure.value
    assert took >= 1.5, took


@pytest.mark.parametrize("retries", [0, 2])
def test_a_request_failing_while_others_answer_is_sent_once_plus_its_retries(retries, monkeypatch):
    """score.server_retries N: a request every server fails (a 503 for it alone) while another server is
    up is sent exactly 1 + N times, then fails in one line; the pool counts N retries. One server more
    than the sends keeps another up at each failure."""
    monkeypatch.setattr(teacher_server, "BACKOFF_S", (0.0, 0.0))  # no wait between the sends
    servers = [FakeTeacher() for _ in range(retries + 2)]
    try:
        for server in servers:
            server.poison = {9}
        pool = pool_of(*(s.url for s in servers), retries=retries)
        with pytest.raises(GndpoError) as failure:
            pool.response_logprobs([[9, 2]], [[3, 4]], 0)
        pool.close()
        sends = sum(path == "/v1/completions" for s in servers for _, path, _ in s.received)
    finally:
        for server in servers:
            server.close()
    assert sends == 1 + retries and pool.retries == retries
    message = str(failure.value)
    assert message.startswith(f"a request to the teacher's servers failed {1 + retries} times while they answered others: ")
    assert "\n" not in message and "cannot answer this one" in message, message


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


def test_a_retry_goes_to_a_server_the_request_has_not_failed_on(fakes, monkeypatch):
    """A fails every request and is back on probation at once (no cooldown, no backoff): A is first and
    least loaded, so without the rule each retry of the one request would go back to A until its
    retries ran out while B stood idle. It is sent to A once, then answered by B."""
    monkeypatch.setattr(teacher_server, "COOLDOWN_S", (0.0, 0.0))
    monkeypatch.setattr(teacher_server, "BACKOFF_S", (0.0, 0.0))
    failing, healthy = fakes
    failing.failing = True
    pool = pool_of(failing.url, healthy.url, retries=1)
    pool.response_logprobs([[1, 2, 3]], [[4, 5]], 0)
    pool.close()
    sent = [len([r for r in server.received if r[1] == "/v1/completions"]) for server in fakes]
    assert sent == [1, 1] and pool.retries == 1


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


def test_a_server_port_is_1_to_65535():
    """The port range's ends are accepted and the numbers just past them refused, in one line (httpx
    itself takes 65536)."""
    for port in (1, 65535):
        url = f"http://127.0.0.1:{port}"
        assert config_from_dict({"score": {"backend": "server", "servers": [url]}}).score.servers == [url]
    for port in (0, 65536):
        url = f"http://127.0.0.1:{port}"
        with pytest.raises(GndpoError) as refused:
            config_from_dict({"score": {"backend": "server", "servers": [url]}})
        assert str(refused.value) == f"score.servers: {url!r} is not a URL (port {port} is not 1-65535): write http://host:port or https://host:port"


class ScoringJob(SlowJob):
    """A score unit that holds its lease until ``release`` is set, while its pool's states are what the
    worker's heartbeats carry, as ScoreJob's do (``live_state``)."""

    def __init__(self, fs, pool: ServerPool):
        super().__init__(fs, seconds=0.0)
        self.pool = pool
        self.release = threading.Event()

    def live_state(self):
        return {"servers": self.pool.states()}

    def run_unit(self, unit, out_dir):
        self.release.wait(timeout=120)  # the test's bound, should it fail before releasing
        return super().run_unit(unit, out_dir)


def servers_line(run_dir, deadline_s: float = 60.0) -> str:
    """`gndpo status`'s teacher-servers line for round 0's score unit, once a heartbeat has carried it
    (polled: on a loaded machine the worker's first heartbeats may come late)."""
    deadline = time.monotonic() + deadline_s
    while True:
        shown = invoke("status", run_dir).output
        lines = [line for line in shown.splitlines() if line.startswith("round 0 score u0: teacher servers")]
        if lines or time.monotonic() > deadline:
            assert lines, shown
            return lines[0]
        time.sleep(0.2)


def test_status_shows_each_live_score_workers_servers(tmp_path, fakes):
    """A score worker's heartbeats carry its pool's states; `gndpo status` shows them under the table
    while the worker holds the unit: the dead server out of the pool with its last error, the live one up.
    (The run folder is a run.yaml of the defaults: status reads records, not models.)"""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.yaml").write_text(config_to_yaml(config_from_dict({})))
    pool = pool_of(dead := dead_url(), fakes[0].url)
    pool.response_logprobs(PROMPTS[:8], RESPONSES[:8], 0)  # the dead one fails and goes out of the pool
    run = open_run(str(tmp_path / "run"))
    job = ScoringJob(run.fs, pool)
    worker = Worker(run.records(0, "score"), job, ttl=0.4, log=lambda *_: None)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        line = servers_line(tmp_path / "run")
    finally:
        job.release.set()
        thread.join()
        pool.close()
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
