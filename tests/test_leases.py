"""Leases under a failing storage layer: every failed heartbeat is a warning, and a worker whose lease
went unrenewed past its ttl abandons the unit, so the worker that takes it over is the only one to
commit. No engines: a job that sleeps stands in for a long unit."""

import json
import logging
import time

import pyarrow as pa

from gndpo.pipeline.exec.inputs import StageInputs
from gndpo.pipeline.exec.stage import StageJob
from gndpo.pipeline.exec.units import Lease, Worker, lease_state
from gndpo.pipeline.run.products import Product
from gndpo.storage.products import Unit, UnitNumbers
from gndpo.storage.records import StageRecords
from gndpo.storage.runfs import RunFS
from gndpo.storage.shards import write_shard

TTL = 0.4


class SlowJob(StageJob):
    """One unit whose compute takes ``seconds`` (longer than the ttl)."""

    makes = Product("score", UnitNumbers)

    def __init__(self, fs, seconds: float):
        self.fs, self.seconds, self.computed = fs, seconds, 0
        self.inputs = StageInputs(None, 0, ())  # it reads nothing

    def plan(self):
        return [Unit("u0")], {}

    def run_unit(self, unit, out_dir):
        time.sleep(self.seconds)
        self.computed += 1
        return [write_shard(self.fs, f"{out_dir}/part-00000.parquet", pa.table({"i": [1, 2]}))], UnitNumbers()

    def summarize(self, commits):
        return {}


def failing_after_first_call(records, monkeypatch, error="ExpiredToken: the security token has expired"):
    """Make ``records.heartbeat`` write once (the claim's own heartbeat) and raise from then on."""
    real, calls = records.heartbeat, []

    def heartbeat(unit, attempt, state=None):
        calls.append(attempt)
        if len(calls) > 1:
            raise PermissionError(error)
        real(unit, attempt, state)

    monkeypatch.setattr(records, "heartbeat", heartbeat)
    return calls


def test_a_worker_that_cannot_renew_its_lease_abandons_the_unit(tmp_path, monkeypatch, caplog):
    fs = RunFS(str(tmp_path))
    records = StageRecords(fs, 0, "score")
    job = SlowJob(fs, seconds=3 * TTL)
    first = Worker(records, job, ttl=TTL, log=lambda *_: None)
    first.ensure_plan()
    calls = failing_after_first_call(records, monkeypatch)
    attempt = first.try_claim("u0")
    assert attempt == 1
    with caplog.at_level(logging.WARNING, logger="gndpo"):
        assert first.compute(Unit("u0"), attempt) is None
    assert job.computed == 1 and len(calls) > 2
    # Nothing committed, and the abandoned attempt's files are gone.
    assert records.done("u0") is None and not fs.exists(records.attempt_dir("u0", 1))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    failed = [w for w in warnings if "heartbeat of attempt 1 failed" in w]
    assert failed and all(w.startswith("score r0 u0:") and "ExpiredToken" in w for w in failed), warnings
    assert any("u0" in w and "abandoning" in w for w in warnings), warnings
    # Its lease is stale to everyone else: a worker with working storage takes the unit over and commits.
    monkeypatch.undo()
    assert lease_state(records, "u0") == "stale"
    second = Worker(records, SlowJob(fs, seconds=0), ttl=TTL, log=lambda *_: None)
    manifest = second.run()
    assert records.done("u0").attempt == 2 and [u.attempt for u in manifest.units] == [2]


def test_a_failed_beat_within_the_ttl_costs_nothing(tmp_path, monkeypatch, caplog):
    """One heartbeat fails, the next ones get through: the lease never went unrenewed past its ttl, so
    the unit, longer than the ttl, commits (and the failure was still reported)."""
    fs = RunFS(str(tmp_path))
    records = StageRecords(fs, 0, "score")
    real, calls = records.heartbeat, []

    def heartbeat(unit, attempt, state=None):
        calls.append(attempt)
        if len(calls) == 2:
            raise OSError("connection reset")
        real(unit, attempt, state)

    monkeypatch.setattr(records, "heartbeat", heartbeat)
    with caplog.at_level(logging.WARNING, logger="gndpo"):
        # A ttl with room for a loaded machine's scheduling delays: one missed beat leaves a 0.5 s gap.
        manifest = Worker(records, SlowJob(fs, seconds=1.5), ttl=1.0, log=lambda *_: None).run()
    assert [u.attempt for u in manifest.units] == [1]
    assert [r.getMessage() for r in caplog.records] == ["score r0 u0: heartbeat of attempt 1 failed: connection reset"]


def test_a_lost_lease_stays_lost():
    lease = Lease("u0", 1, ttl=10, renewed_at=100.0)
    assert not lease.lost(now=109.0)
    lease.renewed(at=109.0)
    assert not lease.lost(now=118.0)
    # A renewal that arrives after the lease went stale does not bring it back.
    lease.renewed(at=120.0)
    assert lease.lost(now=120.0) and lease.lost(now=120.5)


def test_a_unit_committed_by_a_worker_that_has_exited_is_not_claimed_again(tmp_path):
    """The race CI hit with three workers: B lists the pending units, A commits the last of them and
    exits, then B looks at that unit's lease. A's pid is gone, so the lease reads stale; B must still
    not start a second attempt of a unit that is already committed."""
    fs = RunFS(str(tmp_path))
    records = StageRecords(fs, 0, "score")
    a = Worker(records, SlowJob(fs, seconds=0), ttl=60, log=lambda *_: None)
    a.ensure_plan()
    assert a.compute(Unit("u0"), a.try_claim("u0")) is not None
    claim = records.read_claim("u0", 1)
    (tmp_path / records.claim_path("u0", 1)).write_text(json.dumps({**claim, "pid": 2**22 + 1}))  # A exited: no such pid
    assert lease_state(records, "u0") == "stale"
    b = Worker(records, SlowJob(fs, seconds=0), ttl=60, log=lambda *_: None)
    assert b.try_claim("u0") is None
    assert records.attempts("u0") == [1]
