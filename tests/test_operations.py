"""Operating gndpo on shared machines: a run is readable by other users, a stage stopped by a signal
says how to resume and gives its work back, and no engine process outlives the gndpo that started it.

Each test here starts real `gndpo` processes (and vLLM engines): the signals and the process tree are
what is tested, so nothing runs in process.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

from gndpo.pipeline.exec.units import lease_state
from gndpo.pipeline.run.run import open_run
from tests.conftest import invoke, invoke_ok, run_stages, tiny_config_dict

pytestmark = pytest.mark.slow
NOBODY = 65534


def as_nobody(*args) -> subprocess.CompletedProcess:
    """``gndpo *args`` as uid/gid 65534 (nobody), with no supplementary groups."""
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-m", "gndpo.cli", *map(str, args)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HOME": "/nonexistent"},
    )


@pytest.fixture
def world_readable_tmp():
    """A folder outside pytest's private (0700) base, which another uid can reach."""
    folder = Path(tempfile.mkdtemp(prefix="gndpo-shared-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_another_user_reads_the_run(rolled_out, world_readable_tmp):
    """Every file gndpo wrote (records, claims, manifests, shards) follows the umask: under 022 anyone
    may read it. A copy keeping the modes is read by `gndpo status` and `gndpo sql` as nobody, who
    cannot write there."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c", "import gndpo"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"uid {NOBODY} cannot run this interpreter: {probe.stderr.strip().splitlines()[-1:]}")
    files = [p for p in rolled_out.rglob("*") if p.is_file()]
    private = [str(p.relative_to(rolled_out)) for p in files if stat.S_IMODE(p.stat().st_mode) & 0o044 != 0o044]
    assert files and not private, private  # the fixture's gndpo processes ran under the usual umask 022
    run = world_readable_tmp / "run"
    shutil.copytree(rolled_out, run)  # copy2: the modes gndpo gave the files are kept

    status = as_nobody("status", run)
    assert status.returncode == 0, status.stderr
    assert "rollout" in status.stdout and "committed" in status.stdout
    query = "SELECT count(*) AS n FROM rollouts"
    mine = invoke("sql", run, query, "--format", "csv")
    theirs = as_nobody("sql", run, query, "--format", "csv")
    assert theirs.returncode == 0, theirs.stderr
    assert theirs.stdout == mine.stdout and int(mine.stdout.splitlines()[1]) > 0
    denied = as_nobody("sql", run, query, "--format", "csv", "--out", world_readable_tmp / "n.csv")  # writing is not theirs
    assert denied.returncode == 1, denied.stderr
    assert denied.stderr.strip() == f"error: permission denied: {world_readable_tmp / 'n.csv'} (ask its owner for access, or use a folder you can write)"
    # A run folder they may not write: init checks everything, then fails in one line at its first write.
    assets = world_readable_tmp / "assets"
    shutil.copytree(Path(open_run(str(run)).cfg.student).parent, assets)  # the toy models and prompts
    subprocess.run(["chmod", "-R", "a+rX", str(assets)], check=True)  # the cache builds in private temporary folders
    config = world_readable_tmp / "cfg.yaml"
    config.write_text(yaml.safe_dump(tiny_config_dict(assets)))
    refused = as_nobody("init", world_readable_tmp / "theirs", "-c", config)
    assert refused.returncode == 1, refused.stderr
    assert refused.stderr.strip().startswith("error: permission denied: ") and len(refused.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in world_readable_tmp.iterdir()) == ["assets", "cfg.yaml", "run"]


def fresh_run(folder: Path, assets: Path) -> Path:
    """An initialized toy run (nothing rolled out), created in this process."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cfg.yaml").write_text(yaml.safe_dump(tiny_config_dict(assets, rollout={"eval_heldout": False}, engine={"in_process": False})))
    invoke_ok("init", folder / "run", "-c", folder / "cfg.yaml")
    return folder / "run"


def start(*args, env: dict | None = None) -> subprocess.Popen:
    """``gndpo *args`` through the console script, as a user starts it (the processes vLLM spawns from
    it re-import the script, which is how gndpo's code runs first in an engine process)."""
    return subprocess.Popen([str(Path(sys.executable).with_name("gndpo")), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def stop_and_check(run: Path, stage: str, pause_at: str, signum: int) -> None:
    """``gndpo STAGE RUN --round 0`` held at ``pause_at`` in its first unit, then sent ``signum``: it
    exits 128 + the signal with one line naming the command that resumes, its lease is released (not
    left for the ttl), and status says the stage is stopped."""
    proc = start(stage, run, "--round", 0, env={"GNDPO_PAUSE_AT": pause_at})
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, 300, f"{stage} to reach {pause_at}")
    os.kill(proc.pid, signum)
    os.kill(proc.pid, signal.SIGCONT)
    _, stderr = proc.communicate(timeout=120)

    assert proc.returncode == 128 + signum, stderr
    name = signal.Signals(signum).name
    assert stderr.strip().splitlines()[-1] == (
        f"stopped by {name}: the run is resumable, committed work is kept; to resume, run: gndpo {stage} {run} --round 0"
    )
    records = open_run(str(run)).records(0, stage)
    (unit, attempt), = [(u, a) for u in (x.id for x in records.plan().units) for a in records.attempts(u)]
    assert records.last_beat(unit, attempt)["released"] and lease_state(records, unit) == "stale"
    assert records.manifest() is None and "stopped" in invoke("status", run).stdout


def test_ctrl_c_stops_a_rollout_while_its_engine_runs(tmp_path, tiny_assets):
    """Ctrl-C while the rollout's engine runs (held at a unit's first generation). That a rerun then
    takes the released unit over at once and commits is what the crash tests (test_resilience.py) and
    the lease tests show for any unit left uncommitted."""
    run = fresh_run(tmp_path, tiny_assets)
    stop_and_check(run, "rollout", "rollout.generate", signal.SIGINT)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_schedulers_stop_signal_stops_a_stage_cleanly(rolled_out, tmp_path, signum):
    """SIGTERM (kill, scancel, Slurm's pre-emption) and SIGUSR1 (sbatch --signal=USR1@...) on a normalize
    stage held before its commit: a fork of the shared rolled-out round, scored in this process, so the
    signalled process imports neither torch nor a model (the Ctrl-C test signals one that has both)."""
    run = tmp_path / "run"
    invoke_ok("fork", rolled_out, run, "--from-round", 0)
    run_stages(run, "score")
    stop_and_check(run, "normalize", "units.before_commit", signum)


def engine_descendants(pid: int) -> list[psutil.Process]:
    """The vLLM engine processes under ``pid`` (spawned interpreters: vLLM names them VLLM::...)."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if child.name().startswith("VLLM") or "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("keep_alive", [True, False], ids=["kept-engines", "stage-processes"])
def test_no_engine_outlives_a_killed_gndpo(tmp_path, tiny_assets, keep_alive):
    """SIGKILL of `gndpo run` alone (what an out-of-memory killer does) as soon as its rollout engine's
    process exists, i.e. while the engine starts, the hardest moment: within 10 s no process it started
    is left, whether the engine lives under `gndpo run` itself (kept engines) or under a stage process
    it started."""
    run = fresh_run(tmp_path, tiny_assets)
    proc = start("run", run, "--rounds", 1, *([] if keep_alive else ["--no-keep-alive"]))
    engines = wait_for(lambda: engine_descendants(proc.pid), 300, "the rollout engine to start")
    everything = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10  # all gone within 10 s (they go at once: nothing respawns them)
    while (left := alive(everything + engines)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for p in left:  # leave the machine clean for the next test either way
        p.kill()
    assert not left, [(p.pid, p.name()) for p in left]
