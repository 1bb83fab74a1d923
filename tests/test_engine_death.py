"""A kept vLLM engine that dies under a running `gndpo run` is replaced, not reused.

A user's script started `gndpo run` in the background (`setsid gndpo run R &`: the shell makes the
background job ignore SIGINT) and a Ctrl-C later went to the whole process group during round 0's
score. gndpo, ignoring SIGINT, finished score and train; vLLM's engine process, which installs its own
handler, exited. Round 1's rollout then reused the dead engine and ended in a 60-line EngineDeadError
traceback. Here the same happens to a real engine under a real `gndpo run`.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gndpo.pipeline.exec.signals import process_running
from gndpo.pipeline.run.run import open_run
from tests.conftest import invoke_ok, tiny_config_dict, write_config

pytestmark = pytest.mark.slow


def ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what `&` in a non-interactive shell does to the job


def group_processes(pgid: int) -> set[int]:
    """The pids of process group ``pgid``, from /proc."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat[stat.rindex(")") + 2 :].split()[2]) == pgid:
            pids.add(int(entry.name))
    return pids


def wait_for(path, text: str, proc, timeout: float = 300.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in path.read_text():
            return
        assert proc.poll() is None, path.read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"{text!r} did not appear in {timeout:.0f} s:\n{path.read_text()[-3000:]}")


def test_a_kept_engine_killed_by_a_process_group_sigint_is_replaced(tmp_path, tiny_assets):
    config = write_config(tmp_path, tiny_config_dict(tiny_assets, engine={"in_process": False}))
    run = tmp_path / "run"
    invoke_ok("init", run, "--config", config)
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gndpo.cli", "run", str(run), "--rounds", "2"], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=ignore_sigint)
        try:
            wait_for(log, "round 0: score", proc)
            # gndpo is held still while the Ctrl-C reaches its group, until an engine process has exited:
            # on a real model score and train take minutes, here a second, less than the engine takes to die.
            engine = group_processes(proc.pid) - {proc.pid}
            os.kill(proc.pid, signal.SIGSTOP)
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C to the process group: gndpo and its engine processes
            deadline = time.time() + 60
            while all(process_running(pid) for pid in engine) and time.time() < deadline:
                time.sleep(0.2)
            os.kill(proc.pid, signal.SIGCONT)
            code = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "kept from an earlier stage has stopped" in text and "Traceback" not in text, text[-3000:]
    # Round 1 sampled from a fresh engine: nothing reloaded into the dead one, every stage committed.
    rollout = open_run(str(run)).records(1, "rollout").manifest()
    assert rollout is not None and rollout.metrics["engine_reloaded"] == 0
    assert open_run(str(run)).records(1, "train").manifest() is not None
