"""This process's place in a data-parallel job: its rank, the world size and its local rank.

A launcher puts them in the environment: torchrun (train with several ranks) sets RANK, WORLD_SIZE and
LOCAL_RANK, and ``gndpo run``'s per-GPU rollout and score workers get LOCAL_RANK=0 beside the one GPU
CUDA_VISIBLE_DEVICES leaves them. Any other process is rank 0 of 1. They are read here and nowhere
else, and passed on as a :class:`Dist`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Dist:
    """This process's place in a distributed launch (rank, world size, local GPU), read from the
    launcher's environment; one rank of one when nothing launched it."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0  # the GPU index on this node (modulo the visible GPUs)
    launched: bool = False  # a launcher set RANK, and with it the rendezvous (MASTER_ADDR, MASTER_PORT)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Dist:
        """The values a launcher put in ``env`` (default: this process's environment); rank 0 of 1 without one."""
        env = os.environ if env is None else env
        return cls(
            rank=int(env.get("RANK", "0")),
            world=int(env.get("WORLD_SIZE", "1")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            launched="RANK" in env,
        )

    @property
    def main(self) -> bool:
        """Rank 0: the one rank that writes what the ranks computed together (records, exports, metrics)."""
        return self.rank == 0


def usable_cpus() -> int:
    """The CPUs this process may run on: its CPU affinity (``taskset``, Slurm's CPU binding, a container's
    cpuset), which ``os.cpu_count()`` ignores. More torch threads than these cores make every thread wait
    for the others' turn on a core: on one core, two threads train the toy about 15 times slower than one."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity call on this platform (macOS)
        return os.cpu_count() or 1


@contextmanager
def scoped_environ(values: dict[str, str | None]):
    """``os.environ`` with ``values`` set (None: removed) while the block runs, as it was after: for
    settings a child process must start with (it copies the environment when it starts)."""
    saved = {name: os.environ.get(name) for name in values}

    def apply(settings: dict[str, str | None]) -> None:
        for name, value in settings.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    apply(values)
    try:
        yield
    finally:
        apply(saved)
