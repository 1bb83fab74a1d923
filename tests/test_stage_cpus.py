"""``GNDPO_STAGE_CPUS``: each stage process `gndpo run` starts runs on the cores named for its stage, as
the process itself reads them (``os.sched_getaffinity`` inside it), and a stage not named on the cores
`gndpo run` has. The stage processes here are stand-ins that report their cores and commit their stage
(no engine, no model), started by the real loop and launcher: the plan, the scheduler, the process start."""

from __future__ import annotations

import json
import os
import sys

import pytest

from gndpo.apps import rounds, schedule
from gndpo.apps.loop import run_loop

from .conftest import invoke_ok

# A stage process's stand-in: writes the cores it runs on to OUT/<stage>.json, then commits its stage
# (an empty manifest), so that the loop starts the next.
REPORTER = """
import json, os, sys
from gndpo.storage.records import StageRecords
from gndpo.storage.runfs import RunFS
url, stage, round_idx, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with open(os.path.join(out, stage + ".json"), "w") as f:
    json.dump(sorted(os.sched_getaffinity(0)), f)
StageRecords(RunFS(url), round_idx, stage).create_manifest({"units": []})
"""


def pinnable_cpus() -> list[int]:
    """Every CPU a process here may be pinned to: the kernel keeps, of a mask naming every CPU, those the
    machine (its cgroup) allows, whatever this process is pinned to (a pytest-xdist worker to one core)."""
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, range(os.cpu_count()))
        return sorted(os.sched_getaffinity(0))
    finally:
        os.sched_setaffinity(0, mine)


def test_each_stage_process_runs_on_the_cores_named_for_its_stage(tmp_path, tiny_config, monkeypatch):
    cpus = pinnable_cpus()
    if len(cpus) < 2:
        pytest.skip("one CPU: no two stages can be pinned apart")
    a, b = cpus[:2]
    run = tmp_path / "run"
    invoke_ok("init", run, "--config", tiny_config)
    out = tmp_path / "cores"
    out.mkdir()

    def reporter(url, stage, round_idx, num_processes=1, follow=False, final=False):
        return [sys.executable, "-c", REPORTER, url, stage, str(round_idx), str(out)]

    monkeypatch.setattr(rounds, "stage_command", reporter)  # what stage_processes plans
    monkeypatch.setattr(schedule, "stage_command", reporter)  # a finishing process's
    monkeypatch.setattr(schedule, "POLL_S", 0.02)
    # Rollout and normalize on one core, score on the other (one of the two differs from whatever this
    # process runs on), train not named: it runs where `gndpo run` does.
    monkeypatch.setenv("GNDPO_STAGE_CPUS", f"rollout={b} score={a} normalize={b}")
    mine = os.sched_getaffinity(0)
    run_loop(str(run), 1, gpus=0, keep_alive=False, log=lambda *_: None)  # `gndpo run --no-keep-alive`

    seen = {stage: json.loads((out / f"{stage}.json").read_text()) for stage in ("rollout", "score", "normalize", "train")}
    assert seen == {"rollout": [b], "score": [a], "normalize": [b], "train": sorted(mine)}
    assert os.sched_getaffinity(0) == mine  # the loop's own cores are untouched
