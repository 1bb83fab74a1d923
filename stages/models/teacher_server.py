"""Teachers served apart (``score.backend: server``): a pool of OpenAI-compatible servers scores the
stored token ids, the way large teachers are deployed (vLLM's server, often shared by several jobs).

What a server must support (vLLM's OpenAI-compatible server does; SGLang's only where its API answers
the same): ``GET /v1/models`` (the name it serves), ``POST /tokenize`` (its tokenization of a text) and
``POST /v1/completions`` with a token-id ``prompt`` and vLLM's ``prompt_logprobs``: the log-prob of
every prompt position's token and of its top-k, which is all score needs. Each response is sent as the
prompt's and the response's ids (never re-tokenized) with ``max_tokens: 1``, temperature 1 and no
penalties, so the teacher's raw distribution is what comes back whatever the server's defaults.

The pool spreads requests over its servers by outstanding work (tokens in flight), at most
``score.server_in_flight`` a server; a request that fails (connection, timeout, 5xx, 429) is retried on
the least loaded server after a backoff with jitter, and the server that failed is taken out for a
cooldown, then probed back in with one request. Retries are bounded by the pool's state: while another
server answers, a request has ``score.server_retries`` retries (a request no server can answer fails
for good); while every server is failing, the pool waits for one to come back until
``score.server_outage_s`` has passed since the later of the last answer of any server and the moment
the last server began failing (a long request in flight is no outage), then fails with one line
naming each server's last error. Each server's going out and coming back, and the outage's time left,
are log lines. A 401/403 is one line naming the server, and so is any other error the HTTP client
raises. Score commits a unit only when every row is scored, so a server's failure costs retries and at
worst the unit's rerun, never rows.

Before a worker scores (and at ``gndpo init``), :func:`gndpo.stages.teachers.served.check_servers`
holds each server to the teacher the run expects: the model it reports, its tokenization of a probe text, and its log-probs on a fixed
probe sequence, which every server of the pool must give alike (within ``score.server_tolerance``).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import ssl
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable

import httpx

from gndpo.errors import GndpoError, first_line, whole_message
from gndpo.stages.models.prompt_logprobs import flat_response_logprobs

RETRIABLE_STATUS = {408, 429, 500, 502, 503, 504}
COOLDOWN_S = (1.0, 30.0)  # a failed server's first and longest time out of the pool
BACKOFF_S = (0.5, 8.0)  # a retry's first and longest wait (doubling, with jitter)
OUTAGE_NOTICE_S = 10.0  # while every server is failing, a line this often with the time left
log = logging.getLogger("gndpo")


class RetriableError(Exception):
    """A failure another attempt may not repeat: the connection, a timeout, an overloaded server."""


@dataclass(frozen=True)
class ServerSettings:
    """One teacher's servers and how to talk to them (from ``score.server_*``)."""

    urls: tuple[str, ...]
    model: str  # the name the servers serve the teacher under
    api_key: str | None = None  # sent as a bearer token; read from the environment, never stored
    verify: bool | str = True  # https: verify the certificate (a CA bundle's path, or the system's)
    timeout_s: float = 300.0
    retries: int = 5
    in_flight: int = 8
    outage_s: float = 60.0  # every server failing this long since the last answer: the request fails

    @classmethod
    def of(cls, score_cfg, urls: list[str], model: str) -> ServerSettings:
        """The settings of ``score_cfg`` (the run's ``score``) for servers ``urls`` serving ``model``;
        the key from the environment variable ``score.server_api_key_env`` names (a one-line error where
        it is named and not set)."""
        key, bundle = None, score_cfg.server_ca_bundle
        if bundle and not os.path.isfile(bundle):
            raise GndpoError(f"score.server_ca_bundle {bundle} is not a file")
        if score_cfg.server_api_key_env:
            key = os.environ.get(score_cfg.server_api_key_env)
            if not key:
                raise GndpoError(f"score.server_api_key_env names {score_cfg.server_api_key_env}, which is not set in this environment")
        return cls(tuple(base_url(u) for u in urls), model, key, bundle or True,
                   score_cfg.server_timeout_s, score_cfg.server_retries, score_cfg.server_in_flight, score_cfg.server_outage_s)


def base_url(url: str) -> str:
    """``url`` without a trailing slash or ``/v1``: http://host:8000/v1/ -> http://host:8000."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class Server:
    """One server of the pool and its state: work in flight, and when it may be tried again."""

    url: str
    outstanding: int = 0  # tokens of the requests in flight
    requests: int = 0  # requests in flight
    down_until: float = 0.0  # out of the pool until then; afterwards on probation (one request) until one succeeds
    failures: int = 0  # consecutive
    last_error: str = ""

    def capacity(self, in_flight: int, now: float) -> int:
        if now < self.down_until:
            return 0
        return 1 if self.failures else in_flight

    def state(self, now: float) -> str:
        """``up``, ``out for 8s`` (its cooldown) or ``on probation`` (one request), with its failures."""
        if not self.failures:
            return "up"
        where = f"out for {self.down_until - now:.0f}s" if now < self.down_until else "on probation"
        return f"{where} ({self.failures} failures; last: {self.last_error})"


@dataclass
class ServerPool:
    """The servers of one teacher (:class:`ServerSettings`) and the client that spreads requests over them."""

    settings: ServerSettings
    servers: list[Server] = field(init=False)
    _lock: threading.Condition = field(init=False, default_factory=threading.Condition)
    # What the outage clock, the cooldowns and the states read the time from (a test's own clock); the
    # waits for a server stay in real time.
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def __post_init__(self):
        self.servers = [Server(u) for u in self.settings.urls]
        headers = {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}
        timeout = httpx.Timeout(self.settings.timeout_s, connect=min(10.0, self.settings.timeout_s))
        verify = self.settings.verify
        if isinstance(verify, str):  # a CA bundle's path
            verify = ssl.create_default_context(cafile=verify)
        # trust_env off: proxy variables meant for the internet do not reroute a cluster's own servers.
        self.client = httpx.Client(headers=headers, timeout=timeout, verify=verify, trust_env=False)
        self._threads = ThreadPoolExecutor(max_workers=len(self.servers) * self.settings.in_flight, thread_name_prefix="teacher-server")
        self._batches, self._cancelled = itertools.count(1), set()
        # The outage clock: the last answer of any server (or the start of work after the pool was idle),
        # and since when every server has been failing (None while one is not).
        self.last_answer, self.failing_since, self._next_notice = self.clock(), None, 0.0
        self.retries = self.cooldowns = 0  # for the round's metrics
        self.probe: list[float] | None = None  # the servers' answers to the probe, once checked

    def states(self) -> dict[str, str]:
        """{url: :meth:`Server.state`} for `gndpo status` and the logs."""
        with self._lock:
            now = self.clock()
            return {s.url: s.state(now) for s in self.servers}

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    # -- scoring ---------------------------------------------------------------------------------------
    def response_logprobs(self, prompts: list, responses: list, topk: int, images: list | None = None) -> dict:
        """As :func:`gndpo.stages.models.vllm_engine.response_logprobs`, from the pool: one request a
        response, all in flight at once within each server's bound. ``images`` must be None: the
        completions API takes no pictures beside a token-id prompt (init refuses such a teacher)."""
        if images is not None and any(images):
            raise GndpoError("score.backend server cannot show a teacher pictures: /v1/completions takes token ids without images")
        sequences = [[int(t) for t in p] + [int(t) for t in r] for p, r in zip(prompts, responses)]
        batch = next(self._batches)
        with self._lock:  # an idle pool (a kept one, between rounds) starts the outage clock with the work
            if not any(s.requests for s in self.servers):
                self.last_answer = self.clock()
        futures = [self._threads.submit(self.prompt_logprobs, ids, topk, batch=batch) for ids in sequences]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f.exception() for f in done if f.exception() is not None), None)
        if failed is not None:
            # The batch cannot commit: its other requests stop waiting for a server (those in flight end
            # with their answer or their timeout, unread).
            with self._lock:
                self._cancelled.add(batch)
                self._lock.notify_all()
            raise failed
        return flat_response_logprobs([f.result() for f in futures], responses, topk)

    def prompt_logprobs(self, ids: list[int], topk: int, server: Server | None = None, batch: int = 0) -> list[dict]:
        """The teacher's answer at every position of ``ids`` ({token id: (rank, log-prob)}; the first
        position has none), from whichever server the pool gives the request to (or ``server``);
        ``batch``: the call of :meth:`response_logprobs` it belongs to."""
        payload = {"model": self.settings.model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": topk,
                   # The teacher's raw distribution, whatever the server's defaults (a teacher scored at
                   # temperature 0 or with a penalty gives other numbers for the same tokens).
                   "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0,
                   "frequency_penalty": 0.0, "repetition_penalty": 1.0, "seed": 0}
        answer = self.request("/v1/completions", payload, cost=len(ids), server=server, batch=batch)
        try:
            positions = answer["choices"][0]["prompt_logprobs"]
            parsed = [{} if p is None else {int(t): (v["rank"], float(v["logprob"])) for t, v in p.items()} for p in positions]
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise GndpoError(f"a teacher server's completions answer has no usable prompt_logprobs ({whole_message(exc)}): "
                             "a teacher server must support vLLM's prompt_logprobs") from None
        if len(parsed) != len(ids):
            raise GndpoError(f"a teacher server answered prompt_logprobs for {len(parsed)} positions of a {len(ids)}-token prompt; "
                             "it must score the token ids it is sent")
        return parsed

    # -- the pool --------------------------------------------------------------------------------------
    def request(self, path: str, payload: dict | None, cost: int = 1, server: Server | None = None, batch: int = 0) -> dict:
        """POST ``payload`` (GET where None) to ``path`` of the least loaded server, retrying elsewhere
        after a retriable failure, or once to ``server`` (the checks). A GndpoError (one line) once the
        request has failed 1 + ``score.server_retries`` times while another server answered, once every
        server has failed for ``score.server_outage_s``, or at once for a refusal no retry mends."""
        if server is not None:
            return self._request_from(server, path, payload, cost)
        failures = 0  # of this request while another server was up or answered: the request itself may be what fails
        failed_on: set[str] = set()  # the URLs of the servers this request failed on
        for attempt in itertools.count():
            chosen = self._acquire(cost, batch, avoid=failed_on)
            sent = self.clock()
            try:
                answer = self._send(chosen, path, payload)
                self._succeeded(chosen)
                return answer
            except RetriableError as exc:
                if self._failed(chosen, whole_message(exc)) or self.last_answer > sent:
                    failures += 1
                failed_on.add(chosen.url)
            finally:
                self._release(chosen, cost)
            if failures > self.settings.retries:
                raise GndpoError(f"a request to the teacher's servers failed {failures} times while they answered others: {self._errors()}")
            with self._lock:
                self.retries += 1
            time.sleep(min(BACKOFF_S[1], BACKOFF_S[0] * 2**min(attempt, 8)) * random.uniform(0.5, 1.0))

    def _request_from(self, server: Server, path: str, payload: dict | None, cost: int) -> dict:
        """One attempt on ``server`` (the checks): its failure is the one line, the pool's state unchanged."""
        self._take(server, cost)
        try:
            return self._send(server, path, payload)
        except RetriableError as exc:
            raise GndpoError(f"teacher server {server.url}: {whole_message(exc)}") from None
        finally:
            self._release(server, cost)

    def _errors(self) -> str:
        return "; ".join(f"{s.url}: {s.last_error or 'no error'}" for s in self.servers)

    def _send(self, server: Server, path: str, payload: dict | None) -> dict:
        try:
            if payload is None:
                response = self.client.get(server.url + path)
            else:
                response = self.client.post(server.url + path, json=payload)
        except httpx.TransportError as exc:  # refused, reset, timed out, TLS
            if isinstance(exc, httpx.ConnectError) and "CERTIFICATE_VERIFY_FAILED" in str(exc):
                raise GndpoError(f"teacher server {server.url}: its certificate does not verify ({whole_message(exc)}); "
                                 "name its CA bundle in score.server_ca_bundle") from None
            if isinstance(exc, httpx.UnsupportedProtocol):
                raise GndpoError(f"teacher server {server.url}: {first_line(exc, with_type=True)}") from None
            raise RetriableError(first_line(exc, with_type=True)) from None
        except (httpx.HTTPError, httpx.InvalidURL, httpx.CookieConflict, httpx.StreamError) as exc:  # nothing a retry mends
            raise GndpoError(f"teacher server {server.url}: {first_line(exc, with_type=True)}") from None
        if response.status_code in (401, 403):
            raise GndpoError(f"teacher server {server.url} refused the request ({response.status_code}): "
                             "set the key it expects in the environment variable score.server_api_key_env names")
        if response.status_code in RETRIABLE_STATUS:
            raise RetriableError(f"HTTP {response.status_code} {whole_message(response.text, 200)}")
        if response.status_code >= 400:
            raise GndpoError(f"teacher server {server.url} answered {path} with HTTP {response.status_code}: {whole_message(response.text)}")
        try:
            return response.json()
        except ValueError:
            raise RetriableError(f"an answer that is not JSON: {whole_message(response.text, 120)}") from None

    def _acquire(self, cost: int, batch: int, avoid: set[str] | frozenset[str] = frozenset()) -> Server:
        """The server with the least outstanding work and a free slot, waiting for one; servers out of
        the pool come back on probation once their cooldown has passed. A retried request skips the
        servers in ``avoid`` (the URLs it failed on) while another is in the pool, and takes any once
        none is: otherwise the retry that wakes first after a cooldown takes the probation slot, and
        one request can spend all its retries on the failing server while the others answer. A
        GndpoError once another request of ``batch`` has failed for good, or once every server has
        failed for the outage time."""
        with self._lock:
            while True:
                if batch in self._cancelled:
                    raise GndpoError("another request of the batch failed")
                now = self.clock()
                left = self._outage_left(now)
                untried = [s for s in self.servers if s.url not in avoid and now >= s.down_until]
                free = [s for s in untried or self.servers if s.requests < s.capacity(self.settings.in_flight, now)]
                if free:
                    chosen = min(free, key=lambda s: (s.outstanding, s.requests))
                    chosen.outstanding += cost
                    chosen.requests += 1
                    return chosen
                waits = [s.down_until - now for s in self.servers if s.down_until > now]
                if left is not None:
                    waits.append(min(left, max(self._next_notice - now, 0.0)))
                self._lock.wait(timeout=max(0.05, min(waits)) if waits else None)

    def _outage_left(self, now: float) -> float | None:
        """While every server's last request failed: the seconds left before the outage fails the
        request (a GndpoError past them), and a line every OUTAGE_NOTICE_S; None while one answers.
        Called with the lock held."""
        if self.failing_since is None:
            return None
        # From the last answer, or from when the last server began failing where an answer came after
        # it was sent: a healthy server's long request is no outage.
        start = max(self.last_answer, self.failing_since)
        down, left = now - start, self.settings.outage_s - (now - start)
        if left <= 0:
            raise GndpoError(f"every teacher server failed for {down:.0f}s (score.server_outage_s {self.settings.outage_s:g}): {self._errors()}")
        if now >= self._next_notice:
            log.warning(f"every teacher server is failing ({down:.0f}s without an answer): the unit fails in {left:.0f}s "
                        f"(score.server_outage_s {self.settings.outage_s:g}) unless one answers; {self._errors()}")
            self._next_notice = now + OUTAGE_NOTICE_S
        return left

    def _take(self, server: Server, cost: int) -> None:
        with self._lock:
            server.outstanding += cost
            server.requests += 1

    def _release(self, server: Server, cost: int) -> None:
        with self._lock:
            server.outstanding -= cost
            server.requests -= 1
            self._lock.notify_all()

    def _succeeded(self, server: Server) -> None:
        with self._lock:
            self.last_answer = self.clock()
            if server.failures:
                log.info(f"teacher server {server.url} answers again after {server.failures} failures: back in the pool")
            server.failures, self.failing_since = 0, None

    def _failed(self, server: Server, error: str) -> bool:
        """Out of the pool for a cooldown that doubles with each failure, counting once the requests
        that were in flight together when it failed; the outage clock starts when the last server fails.
        Returns whether another server is up (its last request answered): then the failure is the request's."""
        with self._lock:
            server.last_error = error
            now = self.clock()
            if now >= server.down_until:
                server.failures += 1
                cooldown = min(COOLDOWN_S[1], COOLDOWN_S[0] * 2 ** (server.failures - 1))
                server.down_until = now + cooldown
                self.cooldowns += 1
                log.warning(f"teacher server {server.url} failed ({error}): out of the pool for {cooldown:g}s, then one request on probation")
            if self.failing_since is None and all(s.failures for s in self.servers):
                self.failing_since = now
            return any(not s.failures for s in self.servers if s is not server)


def checked(pool: ServerPool, check: Callable[[ServerPool], None]) -> ServerPool:
    """``pool`` once ``check(pool)`` has passed (it holds the servers to the teacher the run expects:
    :func:`gndpo.stages.teachers.served.hold_to_teacher`); closed when it has not."""
    try:
        check(pool)
    except BaseException:
        pool.close()
        raise
    return pool
