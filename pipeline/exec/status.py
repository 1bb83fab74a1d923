"""What `gndpo status` shows: per round and stage, its state (committed, running, stopped), units planned /
claimed / done / stale, the rows and tokens of its data (the held-out evaluation apart, as rollout's
accuracy or, for prompts without answers, score's label-free reverse-KL estimate), wall time and
throughput, read from plans, claims, commit records and manifests; which stages ran beside which (their
spans from first claim to last commit overlapped: score streamed behind rollout, rollout ahead of train)
and the staleness of the policy that sampled; and with ``--phases``, where each stage's time went (:func:`phase_rows`)."""

from __future__ import annotations

import time

from gndpo.pipeline.exec.units import lease_state, sum_phases, wait_totals
from gndpo.pipeline.observe.metrics import PHASES, committed_rounds
from gndpo.pipeline.run.products import HeldoutFigures
from gndpo.storage.products import Commit


def stage_state(committed: bool, leases: list[str | None]) -> str:
    """committed; running (a live worker holds a unit); or stopped: planned, nobody working on it now
    (stopped by a signal, crashed, or between workers), resumed by rerunning the stage."""
    if committed:
        return "committed"
    return "running" if "claimed" in leases else "stopped"


def stage_rows(run) -> list[dict]:
    """`gndpo status`'s table: per round and stage, units planned / claimed / stale / done, rows,
    tokens, time, the stages it ran beside and the sampling policy's staleness."""
    return stage_table(run)[0]


def round_seconds(run) -> dict[int, float]:
    """Each round's wall time: the length of the union of its stages' spans, so time two stages ran side
    by side counts once."""
    by_round: dict[int, list[tuple[float, float]]] = {}
    for (r, _stage), span in stage_table(run)[1].items():
        if span is not None:
            by_round.setdefault(r, []).append(span)
    return {r: union_length(spans) for r, spans in sorted(by_round.items())}


def union_length(spans: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals ``spans``."""
    total, end = 0.0, -float("inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def stage_table(run) -> tuple[list[dict], dict[tuple[int, str], tuple[float, float] | None]]:
    """(:func:`stage_rows`, each stage's span from first claim to last commit, by round and stage)."""
    rows, spans, now = [], {}, time.time()
    for r in range(committed_rounds(run) + 1):
        for stage in run.round_stages(r):
            rec = run.records(r, stage)
            plan = rec.plan()
            if plan is None:
                continue
            units = plan.ids()
            done = rec.done_units()
            leases = [lease_state(rec, u, now) for u in units if u not in done]
            commits = [rec.done(u) for u in units if u in done]
            work = [c for c in commits if c.is_work]  # the held-out evaluation is not the stage's data
            evals = [heldout_figures(c) for c in commits if not c.is_work]
            tokens = sum(getattr(c.numbers, "tokens", 0) for c in work)
            # From the first claim (engine start-up and set-up happen under the lease) to the last commit,
            # or to now while units remain (a stage a fork inherited shows its parent's).
            span = spans[(r, stage)] = stage_span(rec, units, commits, finished=len(commits) == len(units), now=now)
            seconds = None if span is None else max(span[1] - span[0], 0.0)
            rows.append(
                {
                    "round": r,
                    "stage": stage,
                    "state": stage_state(rec.manifest() is not None, leases),
                    "planned": len(units),
                    "claimed": leases.count("claimed"),
                    "stale": leases.count("stale"),
                    "done": len(done & set(units)),
                    "rows": sum(c.rows for c in work),
                    "tokens": tokens,
                    "seconds": None if seconds is None else round(seconds, 1),
                    "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
                    # The held-out figure: rollout's accuracy, or without answers score's label-free
                    # reverse-KL estimate of the round's policy on held-out prompts.
                    "heldout": evals[0].accuracy if evals else None,
                    "heldout_kl": evals[0].reverse_kl if evals else None,
                    # Rounds the sampling policy is behind: a plan that samples names the policy version it samples with.
                    "staleness": r - plan.inputs["policy_version"] if "policy_version" in plan.inputs else None,
                }
            )
    for row in rows:
        row["beside"] = ", ".join(f"r{r} {stage}" for r, stage in overlapping(spans, (row["round"], row["stage"]))) or None
    return rows, spans


def heldout_figures(commit: Commit) -> HeldoutFigures:
    """A held-out evaluation unit's figures, whichever stage ran it."""
    return HeldoutFigures.model_validate(getattr(commit.numbers, "eval", None) or {})


def stage_span(rec, units: list[str], commits: list[Commit], finished: bool, now: float) -> tuple[float, float] | None:
    """(start, end) of a stage: its first claim, and its last commit (now while units remain); None before
    anyone claimed a unit."""
    claimed = [float(rec.read_claim(u, a)["claimed_at"]) for u in units for a in rec.attempts(u)[:1]]
    if not claimed:
        return None
    return min(claimed), max(c.committed_at for c in commits) if finished and commits else now


def overlapping(spans: dict[tuple[int, str], tuple[float, float] | None], key: tuple[int, str]) -> list[tuple[int, str]]:
    """The stages whose span overlaps ``key``'s (the stages it ran beside), in round and stage order."""
    mine = spans.get(key)
    if mine is None:
        return []
    return [other for other, span in spans.items() if other != key and span is not None and span[0] < mine[1] and mine[0] < span[1]]


def worker_lines(run) -> list[str]:
    """A line per unit a live worker holds whose heartbeat says something of the worker (a score worker:
    each teacher server's state, ``score.backend: server``), in the stages not yet committed."""
    lines, now = [], time.time()
    for r in range(committed_rounds(run) + 1):
        for stage in run.round_stages(r):
            rec = run.records(r, stage)
            plan = rec.plan()
            if plan is None or rec.manifest() is not None:
                continue
            done = rec.done_units()
            for unit in (u for u in plan.ids() if u not in done):
                attempts = rec.attempts(unit)
                if not attempts or lease_state(rec, unit, now) != "claimed":
                    continue
                beat = rec.last_beat(unit, attempts[-1]) or {}
                servers = beat.get("state", {}).get("servers")
                if servers:
                    said = "; ".join(f"{url} {state}" for url, state in servers.items())
                    lines.append(f"round {r} {stage} {unit}: teacher servers {said} ({now - beat['t']:.0f}s ago)")
    return lines


# The phases in the order a unit goes through them (gndpo.storage.meter), then the waits; others follow by name.
PHASE_ORDER = (*PHASES, "waiting", "held")
WAIT_COLUMNS = {"wait_input_seconds": "waiting", "wait_held_seconds": "held"}


def phase_rows(run) -> list[dict]:
    """Per round and stage with committed units: the seconds of work in each phase (summed over its
    units, so units that ran side by side add up), where its workers waited (for input, or held by
    the stages after it: :func:`gndpo.pipeline.exec.units.wait_totals`) and the MB each phase wrote."""
    rows = []
    for r in range(committed_rounds(run) + 1):
        for stage in run.round_stages(r):
            rec = run.records(r, stage)
            spent = sum_phases([c for c in (rec.done(u) for u in sorted(rec.done_units())) if c is not None])
            if spent:
                waits = {WAIT_COLUMNS[k]: v for k, v in wait_totals(rec.waits()).items()}
                rows.append((r, stage, {**{n: p["seconds"] for n, p in spent.items()}, **waits}, {n: p["bytes"] for n, p in spent.items()}))
    order = lambda n: (PHASE_ORDER.index(n) if n in PHASE_ORDER else len(PHASE_ORDER), n)  # noqa: E731
    timed = sorted({n for *_, seconds, _ in rows for n in seconds}, key=order)
    writing = sorted({n for *_, written in rows for n, b in written.items() if b}, key=order)
    return [{"round": r, "stage": stage, **{f"{n} s": round(seconds.get(n, 0.0), 2) for n in timed},
             **{f"{n} MB": round(written.get(n, 0) / 1e6, 3) for n in writing}} for r, stage, seconds, written in rows]
