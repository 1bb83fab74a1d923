"""The storage protocol on a local run folder: exclusive create, verified shards, the unit executor."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gndpo.errors import GndpoError
from gndpo.pipeline.exec.inputs import StageInputs
from gndpo.pipeline.exec.stage import StageJob
from gndpo.pipeline.exec.units import Worker
from gndpo.pipeline.run.products import Product
from gndpo.storage.bell import BELLS, CommitBell
from gndpo.storage.products import FileRecord, Unit, UnitNumbers
from gndpo.storage.records import StageRecords
from gndpo.storage.runfs import RunFS
from gndpo.storage.shards import read_shard, write_shard


def test_create_is_exclusive_and_never_empty(tmp_path):
    fs = RunFS(str(tmp_path))
    assert fs.create("a/b.json", b'{"x": 1}')
    assert not fs.create("a/b.json", b'{"x": 2}')
    assert fs.read_json("a/b.json") == {"x": 1}
    with pytest.raises(ValueError):
        fs.create("a/c.json", b"")
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.json"]  # no temp files left


def test_a_staged_folder_is_moved_into_a_local_run_and_copied_elsewhere(tmp_path):
    """A local run stages big files (a model, an engine state) beside their final place and renames them
    in: the same inode, no copy, nothing left of the staging folder; the records hash what was written.
    A file on another filesystem (RAM's, where the machine has one) is copied and stays."""
    import hashlib
    import tempfile

    fs = RunFS(str(tmp_path / "run"))
    content = {"model.safetensors": os.urandom(1 << 20), "sub/config.json": b'{"a": 1}'}
    with fs.staging_dir("attempt/model") as staged:
        assert os.path.dirname(staged) == str(tmp_path / "run" / "attempt")
        for name, data in content.items():
            (Path(staged) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(staged) / name).write_bytes(data)
        inode = (Path(staged) / "model.safetensors").stat().st_ino
        records = fs.move_dir_in(staged, "attempt/model")
        assert not any(p.is_file() for p in Path(staged).rglob("*"))
    assert os.listdir(tmp_path / "run" / "attempt") == ["model"]
    assert (tmp_path / "run" / "attempt" / "model" / "model.safetensors").stat().st_ino == inode
    want = [FileRecord(f"attempt/model/{name}", len(data), hashlib.sha256(data).hexdigest()) for name, data in sorted(content.items())]
    assert records == want
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        return
    with tempfile.TemporaryDirectory(dir="/dev/shm") as elsewhere:
        (Path(elsewhere) / "state.pt").write_bytes(b"state")
        record = fs.move_in("attempt/optimizer/state.pt", Path(elsewhere) / "state.pt")
        assert (Path(elsewhere) / "state.pt").read_bytes() == b"state"
    assert record.sha256 == hashlib.sha256(b"state").hexdigest() and fs.read_bytes("attempt/optimizer/state.pt") == b"state"
    assert sorted(os.listdir(tmp_path / "run" / "attempt" / "optimizer")) == ["state.pt"]  # no temporary copy left


def test_shard_roundtrip_and_corruption_is_named(tmp_path):
    fs = RunFS(str(tmp_path))
    table = pa.table({"x": list(range(100))})
    rec = write_shard(fs, "d/part-00000.parquet", table)
    assert rec.rows == 100
    assert read_shard(fs, rec).equals(table)
    assert pq.read_table(tmp_path / "d/part-00000.parquet").num_rows == 100  # plain Parquet
    path = tmp_path / "d/part-00000.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(GndpoError, match="part-00000.parquet"):
        read_shard(fs, rec)


class Counted(UnitNumbers):
    tokens: int = 0


class CountingJob(StageJob):
    """A stage that writes one shard of ``n`` rows per unit (unit ``u<i>`` has ``sizes[i]``)."""

    makes = Product("rollout", Counted)

    def __init__(self, fs, sizes, fail_on=None):
        self.fs, self.sizes, self.fail_on, self.setups = fs, sizes, fail_on, 0
        self.inputs = StageInputs(None, 0, ())  # it reads nothing: every unit is ready

    def plan(self):
        return [Unit(f"u{i}") for i in range(len(self.sizes))], {"sizes": self.sizes}

    def setup(self):
        self.setups += 1

    def run_unit(self, unit, out_dir):
        if unit.id == self.fail_on:
            raise RuntimeError("crash")
        n = self.sizes[int(unit.id[1:])]
        rec = write_shard(self.fs, f"{out_dir}/part-00000.parquet", pa.table({"i": list(range(n))}))
        return [rec], Counted(tokens=n)

    def summarize(self, commits):
        return {"tokens": sum(c.numbers.tokens for c in commits)}


def test_worker_commits_every_unit_once_and_resumes_after_a_crash(tmp_path):
    fs = RunFS(str(tmp_path))
    records = StageRecords(fs, 0, "rollout", Counted)
    with pytest.raises(RuntimeError):
        Worker(records, CountingJob(fs, [3, 4, 5], fail_on="u1"), log=lambda *_: None).run()
    assert records.done_units() == {"u0"}
    assert records.manifest() is None
    # The crashed attempt's claim belongs to this (live) process; a real crash leaves a dead pid.
    claim = tmp_path / "rounds/r0000/rollout/claims/u1/a001.json"
    body = json.loads(claim.read_text())
    body["pid"] = 2**22 + 12345  # no such process
    claim.write_text(json.dumps(body))
    job = CountingJob(fs, [3, 4, 5])
    manifest = Worker(records, job, log=lambda *_: None).run()
    assert manifest.rows == 12 and manifest.metrics["tokens"] == 12
    # Beside the job's own metrics, where its units' time went (the shards: the write phase).
    assert manifest.metrics["phase_write_bytes"] == sum(u.bytes for u in manifest.units) > 0
    assert [u.unit for u in manifest.units] == ["u0", "u1", "u2"]
    assert records.done("u1").attempt == 2
    # A rerun after the manifest does no work at all.
    again = CountingJob(fs, [3, 4, 5])
    assert Worker(records, again, log=lambda *_: None).run() == manifest and again.setups == 0


def test_live_lease_is_not_taken_and_losing_commit_removes_its_attempt(tmp_path):
    fs = RunFS(str(tmp_path))
    records = StageRecords(fs, 0, "score", Counted)
    job = CountingJob(fs, [2])
    first, second = Worker(records, job, log=lambda *_: None), Worker(records, job, log=lambda *_: None)
    first.ensure_plan()
    assert first.try_claim("u0") == 1
    assert second.try_claim("u0") is None  # live heartbeat, same live pid
    assert second.run(wait_for_others=False) is None
    # Simulate a takeover: the second worker commits attempt 2 first; the first worker's commit loses.
    assert records.create_claim("u0", 2, {"worker": "other", "host": "h", "pid": 1, "ttl": 60, "claimed_at": 0})
    assert second.compute(job.plan()[0][0], 2)
    assert not first.compute(job.plan()[0][0], 1)
    assert not fs.exists(records.attempt_dir("u0", 1))
    assert records.done("u0").attempt == 2


def test_one_worker_lists_the_commits_a_bounded_number_of_times_not_once_a_unit(tmp_path, monkeypatch):
    """A worker knows its own commits; other workers' it lists when it finds nothing to claim and at
    most every LIST_EVERY_S. Listing after every unit made a stage of N units cost N listings of up to
    N commit records (bench/executor_scale.py measures it at 10,000 units)."""
    fs = RunFS(str(tmp_path))
    records = StageRecords(fs, 0, "rollout", Counted)
    listings, list_done = [], records.done_units
    monkeypatch.setattr(records, "done_units", lambda: listings.append(1) or list_done())
    manifest = Worker(records, CountingJob(fs, [1] * 60), log=lambda *_: None).run()
    assert [u.unit for u in manifest.units] == [f"u{i}" for i in range(60)]
    assert len(listings) <= 2, len(listings)


def test_a_commit_wakes_a_waiter_on_this_machine_at_once(tmp_path):
    """The commit bell (storage/bell.py): a worker waiting for another stage's commits wakes when another
    process commits, not at its next look; rings while nobody waits are not lost, and a pipe whose
    process is gone is removed by the next ring."""
    fs = RunFS(str(tmp_path / "run"))
    bell = CommitBell(fs)
    start = time.monotonic()
    bell.wait(0.2)
    assert time.monotonic() - start >= 0.2  # nothing rang: the full wait
    ring = "import sys; from gndpo.storage.bell import CommitBell; from gndpo.storage.runfs import RunFS; CommitBell(RunFS(sys.argv[1])).ring()"
    child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(0.5); {ring}", fs.url])
    start = time.monotonic()
    bell.wait(30)
    assert time.monotonic() - start < 10 and child.wait() == 0  # woken by the other process's commit
    records = StageRecords(fs, 0, "rollout", Counted)
    assert records.commit(Unit("u0"), 1, [], Counted(tokens=1))  # every commit rings
    start = time.monotonic()
    bell.wait(30)
    assert time.monotonic() - start < 1
    bell.close()
    os.mkfifo(fs.path(f"{BELLS}/424242-gone"))  # a waiter that died without closing
    CommitBell(fs).ring()
    assert os.listdir(fs.path(BELLS)) == []
