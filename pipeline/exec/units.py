"""Work units and leases: the executor that makes every stage a resumable, shareable batch job.

A stage (a :class:`StageJob`) only says how to split its input into units and how to compute one unit
into files under a given folder. This module owns everything else, so that each stage is resumable and
several workers on several machines can share it:

1. The plan (the unit list) is written once with exclusive create; its units do not depend on how many
   workers run, so any worker computes the same plan.
2. A worker claims a unit by exclusively creating ``claims/<unit>/aNNN.json`` for the next attempt number
   and heartbeats while it computes. A claim whose heartbeat is older than its ttl, or whose process is
   known dead (same host, pid gone), is stale: another worker takes the unit by claiming attempt N+1.
   A worker that could not renew its own lease for longer than the ttl (its storage failing) abandons
   the unit without committing: from then on another worker may hold it, and only that one commits.
3. Output goes to the attempt's own folder; the unit becomes visible only when its commit record is
   created exclusively. The loser of a commit race deletes its attempt folder.
4. When every unit is committed, the manifest (written last) lists the commit records. It is the only
   thing later stages and SQL read.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from gndpo.errors import GndpoError, first_line
from gndpo.faults import crash_point
from gndpo.pipeline.exec.signals import pid_alive
from gndpo.pipeline.exec.stage import StageJob
from gndpo.pipeline.observe import progress
from gndpo.pipeline.observe.logs import FILE_ONLY, info, unit_context
from gndpo.storage.bell import CommitBell
from gndpo.storage.meter import Phases, phase, unit_clock
from gndpo.storage.products import Commit, Manifest, Plan, Unit, UnitNumbers
from gndpo.storage.records import StageRecords

_units_log = logging.getLogger(__name__)
# Counts of a unit's commit summary that progress sums and shows with their rate.
PROGRESS_COUNTS = ("prompts", "responses", "tokens")
LIST_EVERY_S = 10.0  # seconds between a worker's listings of the commits other workers made
# Why a worker waited (its stage's waits/ records): for what the stage reads to be committed, or, its own
# work done, for the stages after it to take it (an actor ahead of the learner by the order's bound).
WAIT_INPUT, WAIT_HELD = "input_seconds", "held_seconds"
WORKING = "ckpt"  # an attempt's working folder: what it writes while it computes and its commit never lists


def working_dir(records: StageRecords, unit: str, attempt: int) -> str:
    """Where an attempt keeps what it writes while it computes (train's in-round checkpoints): a later
    attempt of the uncommitted unit may resume from it; no commit references it, so `gndpo gc` removes
    it once the unit is committed."""
    return f"{records.attempt_dir(unit, attempt)}/{WORKING}"


def lease_state(records: StageRecords, unit: str, now: float | None = None) -> str | None:
    """State of the newest lease on ``unit``: None (never claimed), "claimed" (its holder is alive),
    or "stale": released by its worker (stopped by a signal or an error), no heartbeat within the
    lease's own ttl, or its process is known dead (same host)."""
    attempts = records.attempts(unit)
    if not attempts:
        return None
    claim = records.read_claim(unit, attempts[-1])
    if claim.get("host") == socket.gethostname() and not pid_alive(int(claim.get("pid", -1))):
        return "stale"
    beat = records.last_beat(unit, attempts[-1])
    if beat is not None and beat["released"]:
        return "stale"
    last = beat["t"] if beat is not None else float(claim.get("claimed_at", 0))
    return "stale" if (now or time.time()) - last > float(claim["ttl"]) else "claimed"


class Lease:
    """A worker's hold on one claimed attempt while it computes: renewed by heartbeats, lost once it went
    unrenewed for longer than its ttl (other workers then see it stale and may claim the unit). Lost is
    for good: a later heartbeat that gets through does not undo a takeover that may have happened."""

    def __init__(self, unit: str, attempt: int, ttl: float, renewed_at: float | None = None):
        self.unit, self.attempt, self.ttl = unit, attempt, ttl
        self.renewed_at = time.time() if renewed_at is None else renewed_at
        self._lost = False

    def renewed(self, at: float) -> None:
        """A heartbeat sent at ``at`` was written."""
        if not self.lost(at):
            self.renewed_at = at

    def lost(self, now: float | None = None) -> bool:
        if not self._lost and (time.time() if now is None else now) - self.renewed_at > self.ttl:
            self._lost = True
        return self._lost


class Worker:
    """Claims, computes and commits units of one stage until none is left to claim."""

    def __init__(
        self, records: StageRecords, job: StageJob, ttl: float = 120.0, poll: float = 2.0, log=info, set_up: bool = False,
        on_manifest=None,
    ):
        self.records = records
        self.job = job
        self.ttl = ttl
        self.poll = poll
        self._bell: CommitBell | None = None  # made on the first wait
        self.waited = 0.0  # seconds this worker waited for the units it reads to be committed
        self.log = log
        self.host = socket.gethostname()
        self.worker_id = f"{self.host}:{os.getpid()}:{int(time.time() * 1000) % 10**9}"
        self._is_set_up = set_up  # True when the caller already ran job.setup()
        # Called with the manifest by the one worker whose write of it succeeded (metrics publishing).
        self.on_manifest = on_manifest

    # -- leases -----------------------------------------------------------------------------------
    def try_claim(self, unit: str) -> int | None:
        """Claim ``unit`` (a fresh one, or a stale lease's next attempt); None if someone holds it or
        it is already committed."""
        if lease_state(self.records, unit) == "claimed":
            return None
        # A lease also reads stale once its worker committed the unit and exited, after our last
        # listing of commits: look again, after the lease, so that such a commit is seen.
        if self.records.done(unit) is not None:
            return None
        attempts = self.records.attempts(unit)
        attempt = attempts[-1] + 1 if attempts else 1
        body = {
            "worker": self.worker_id,
            "host": self.host,
            "pid": os.getpid(),
            "ttl": self.ttl,
            "claimed_at": time.time(),
        }
        if not self.records.create_claim(unit, attempt, body):
            return None  # another worker claimed this attempt first
        self.records.heartbeat(unit, attempt)
        return attempt

    def _live_state(self, where: str) -> dict:
        """What the job says of itself for the heartbeat (``live_state``); {} where it cannot say: a
        heartbeat is never lost to it."""
        try:
            return self.job.live_state()
        except Exception as exc:  # noqa: BLE001 - the lease matters more than what status shows
            _units_log.debug("%s: no live state for the heartbeat: %s", where, first_line(exc))
            return {}

    def _heartbeat_loop(self, lease: Lease, stop: threading.Event) -> None:
        """Renew ``lease`` every ttl/4 until ``stop``; each failed renewal is a warning, and once the lease
        went unrenewed past its ttl the loop ends: the unit is no longer this worker's to commit."""
        where = f"{self.records.stage} r{self.records.round} {lease.unit}"
        while not stop.wait(self.ttl / 4):
            sent = time.time()
            try:
                self.records.heartbeat(lease.unit, lease.attempt, self._live_state(where))
            except Exception as exc:  # noqa: BLE001 - any storage failure: the lease decides what it costs
                _units_log.warning("%s: heartbeat of attempt %d failed: %s", where, lease.attempt, first_line(exc))
            else:
                lease.renewed(sent)
            if lease.lost():
                _units_log.warning(
                    "%s: attempt %d's lease was not renewed for over its ttl (%gs); abandoning the unit to the "
                    "worker that takes it over", where, lease.attempt, lease.ttl,
                )
                return

    # -- the loop ---------------------------------------------------------------------------------
    def ensure_plan(self) -> Plan:
        plan = self.records.plan()
        if plan is None:
            units, inputs = self.job.plan()
            if not units:
                raise GndpoError(f"stage {self.records.stage} of round {self.records.round} has no work units")
            plan = self.records.create_plan(units, inputs)
        return plan

    def run(self, wait_for_others: bool = True) -> Manifest | None:
        """Work until every unit is committed; then write (or read) the manifest and return it.

        With ``wait_for_others`` False the worker returns None once nothing is left for it to claim
        while other workers still hold live leases.
        """
        try:
            return self._run(wait_for_others)
        finally:
            if self._bell is not None:
                self._bell.close()
                self._bell = None

    def _run(self, wait_for_others: bool) -> Manifest | None:
        manifest = self.records.manifest()
        if manifest is not None:
            return manifest
        plan = self.ensure_plan()
        units = {u.id: u for u in plan.units}
        # A unit is claimed only once what it reads is committed: at once, but for a stage that streams
        # behind another (:mod:`gndpo.pipeline.exec.inputs`, per-unit reads), whose input units commit
        # while it runs.
        ready = self.job.inputs.unit_ready
        done = self.records.done_units() & units.keys()
        pending = {u: None for u in units if u not in done}  # in plan order; a dict: O(1) removal
        listed_at = time.monotonic()
        with progress.task(f"{self.records.stage} r{self.records.round}", total=len(units), unit="units") as bar:
            bar.advance(len(done))
            while pending:
                claimed = next(((u, a) for u in pending if ready(u) and (a := self.try_claim(u)) is not None), None)
                if claimed is not None:
                    numbers = self.compute(units[claimed[0]], claimed[1])
                    if numbers is not None or self.records.done(claimed[0]) is not None:  # not an abandoned lease
                        pending.pop(claimed[0])
                        done.add(claimed[0])
                        bar.advance(1, **progress_counts(numbers))
                # Other workers' commits: listed when nothing could be claimed, else at most every
                # LIST_EVERY_S. A listing is a request on object stores and grows with the units; one
                # after every unit made a stage of N units cost N listings of up to N records.
                if claimed is None or time.monotonic() - listed_at > LIST_EVERY_S:
                    others = (self.records.done_units() & units.keys()) - done
                    for unit in others:
                        pending.pop(unit, None)
                    done |= others
                    bar.advance(len(others))
                    listed_at = time.monotonic()
                if claimed is None and pending:  # what is left is held by other workers, or not yet readable
                    if not wait_for_others and all(ready(u) for u in pending):
                        self.note_wait()
                        return None
                    self.wait_for_a_commit(waiting_for_input=not all(ready(u) for u in pending))
        self.note_wait()
        return self.finish(plan)

    def wait_for_a_commit(self, waiting_for_input: bool) -> None:
        """Until another worker commits (on this machine: at once, by the run's bell) or ``poll`` seconds
        pass; what the stage reads is looked at again after. ``waiting_for_input``: a unit it could
        take waits for its input unit (the time counts as the stage waiting for its input)."""
        if self._bell is None:
            self._bell = CommitBell(self.records.run)
        start = time.monotonic()
        try:
            self._bell.wait(self.poll)
        finally:
            self.job.inputs.look_again()
            if waiting_for_input:
                self.waited += time.monotonic() - start

    def note_wait(self) -> None:
        """Record the seconds this worker waited for its input inside the stage, where it did."""
        if self.waited > 0:
            self.records.note_wait(self.worker_id, {WAIT_INPUT: round(self.waited, 3)})
            self.waited = 0.0

    def compute(self, unit: Unit, attempt: int) -> UnitNumbers | None:
        """Compute and commit one claimed unit; returns its committed numbers, or None if another attempt
        committed first or the lease expired (the unit is abandoned). Stopped by an error or a signal at
        any point, the worker releases the lease on its way out. Everything logged meanwhile names the
        unit."""
        with unit_context(unit.id):
            try:
                return self._compute(unit, attempt)
            except BaseException:  # an error, or a signal (KeyboardInterrupt, Stopped): the unit goes back
                self._release(unit.id, attempt)
                raise

    def _compute(self, unit: Unit, attempt: int) -> UnitNumbers | None:
        uid = unit.id
        out_dir = self.records.attempt_dir(uid, attempt)
        lease = Lease(uid, attempt, self.ttl)
        stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat_loop, args=(lease, stop), daemon=True)
        beat.start()
        try:
            with unit_clock() as clock:
                if not self._is_set_up:  # under the lease: starting engines can take longer than the ttl
                    with phase("setup"):
                        self.job.setup()
                    self._is_set_up = True
                t0 = time.time()
                files, numbers = self.job.run_unit(unit, out_dir)
        finally:
            stop.set()
            beat.join()
        numbers = numbers.with_cost(round(time.time() - t0, 3), self.worker_id, clock.breakdown())
        if lease.lost():
            # Another worker may hold the unit now; ours was never visible, so removing it is safe.
            self.records.run.rm(out_dir)
            self.log(f"{self.records.stage} r{self.records.round} {uid}: attempt {attempt} abandoned, its lease expired")
            return None
        crash_point("units.before_commit")
        if self.records.commit(unit, attempt, files, numbers):
            # Per unit: for the worker's log file; the terminal shows the stage's progress instead.
            _units_log.info("%s r%d %s: committed attempt %d", self.records.stage, self.records.round, uid, attempt, extra=FILE_ONLY)
            return numbers
        # Another attempt committed first; ours was never visible, so removing it is safe.
        self.records.run.rm(out_dir)
        self.log(f"{self.records.stage} r{self.records.round} {uid}: attempt {attempt} lost the commit race")
        return None

    def _release(self, uid: str, attempt: int) -> None:
        """Give back a unit this worker stops computing, so that a rerun or another worker takes it now
        instead of after the ttl. The attempt's folder stays: it was never visible, and what it holds
        may be resumed from (train's in-round checkpoints); ``gndpo gc`` removes the rest. Best effort:
        the storage failing here must not hide why the worker stopped."""
        try:
            self.records.release(uid, attempt)
        except Exception as exc:  # noqa: BLE001 - the ttl still frees the unit
            _units_log.warning("%s r%d %s: could not release attempt %d (%s); it frees after its ttl",
                               self.records.stage, self.records.round, uid, attempt, exc)

    def finish(self, plan: Plan) -> Manifest:
        manifest = self.records.manifest()
        if manifest is not None:
            return manifest
        commits = [self.records.done(u) for u in plan.ids()]
        body = {
            "inputs": plan.inputs,
            "units": [c.to_json() for c in commits],
            "rows": sum(c.rows for c in commits),
            "bytes": sum(c.bytes for c in commits),
            "metrics": {**self.job.summarize(commits), **phase_totals(commits), **wait_totals(self.records.waits())},
            "finished_at": time.time(),
        }
        manifest, created = self.records.create_manifest(body)
        if created and self.on_manifest is not None:
            self.on_manifest(manifest)
        return manifest


def wait_totals(waits: list[dict]) -> dict[str, float]:
    """A stage's ``wait_input_seconds`` and ``wait_held_seconds`` metrics: its workers' waits summed, where
    any waited (workers that stay, a stage streaming behind another)."""
    return {f"wait_{cause}_seconds": round(sum(w.get(key, 0.0) for w in waits), 3)
            for cause, key in (("input", WAIT_INPUT), ("held", WAIT_HELD)) if any(key in w for w in waits)}


def progress_counts(numbers: UnitNumbers | None) -> dict[str, int]:
    """The counts of a unit's numbers that progress sums and shows with their rate (:data:`PROGRESS_COUNTS`)."""
    return {k: getattr(numbers, k) for k in PROGRESS_COUNTS if getattr(numbers, k, None) is not None}


def sum_phases(commits: list[Commit]) -> Phases:
    """``{phase: {"seconds": s, "bytes": b}}`` over ``commits``' units (seconds of work: units that ran
    side by side on several workers add up)."""
    totals: Phases = {}
    for commit in commits:
        for name, spent in commit.numbers.phases.items():
            total = totals.setdefault(name, {"seconds": 0.0, "bytes": 0})
            total["seconds"] += spent["seconds"]
            total["bytes"] += spent["bytes"]
    return totals


def phase_totals(commits: list[Commit]) -> dict:
    """A stage's ``phase_<name>_seconds`` and ``phase_<name>_bytes`` metrics (:func:`sum_phases`)."""
    return {f"phase_{name}_{measure}": round(value, 3) if measure == "seconds" else value
            for name, spent in sorted(sum_phases(commits).items()) for measure, value in sorted(spent.items())}


def run_collective(records: StageRecords, job: StageJob, ttl: float = 120.0, log=info, on_manifest=None) -> Manifest | None:
    """Run a one-unit stage that every rank of a torch.distributed group computes together (train
    under torchrun/deepspeed): rank 0 alone plans, holds the lease and commits; the others follow its
    decision, broadcast to them, and compute the same unit in lockstep."""
    import torch.distributed as dist

    job.setup()  # joins the process group
    rank = dist.get_rank()
    worker = Worker(records, job, ttl=ttl, log=log, set_up=True, on_manifest=on_manifest)
    decision: list = [None]
    if rank == 0 and records.manifest() is None:
        plan = worker.ensure_plan()
        (unit,) = plan.units
        if records.done(unit.id) is None:
            decision = [(unit, worker.try_claim(unit.id))]
    dist.broadcast_object_list(decision, src=0)
    if decision[0] is not None:
        unit, attempt = decision[0]
        if attempt is None:
            raise GndpoError(f"{records.stage} of round {records.round} is held by another live worker")
        if rank == 0:
            worker.compute(unit, attempt)
        else:
            job.run_unit(unit, records.attempt_dir(unit.id, attempt))
    if rank == 0 and records.manifest() is None:
        worker.finish(records.plan())
    dist.barrier()
    return records.manifest()
