"""Torch threads follow the CPUs a process may run on (its affinity: taskset, Slurm's CPU binding, a
pytest-xdist worker's core), not the machine's core count: more threads than cores wait for each other."""

import os
import subprocess
import sys

PROBE = """
import torch
from gndpo.apps.demos.build import use_build_threads
from gndpo.stages.models.device import set_cpu_threads
set_cpu_threads()
stage = torch.get_num_threads()
use_build_threads()
print(stage, torch.get_num_threads())
"""


def threads(cores: set[int] | None = None, **env) -> tuple[int, int]:
    """(stage threads, toy-build threads) in a fresh process limited to ``cores``."""
    clean = {k: v for k, v in os.environ.items() if k not in ("GNDPO_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, check=True, timeout=120,
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
    ).stdout.split()
    return int(out[0]), int(out[1])


def test_a_process_pinned_to_one_core_uses_one_thread():
    assert threads({sorted(os.sched_getaffinity(0))[0]}) == (1, 1)


def test_an_unpinned_process_uses_its_cores_and_gndpo_threads_wins():
    usable = len(os.sched_getaffinity(0))
    assert threads() == (usable, min(2, usable))  # toy builds: 2 threads, the demo's figures
    assert threads(GNDPO_THREADS="3")[0] == 3
