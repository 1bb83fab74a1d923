"""Building and caching the toys' assets: a cache folder per build, and pinned arithmetic for training.

A toy trained from scratch is a long chain of float operations, and the CPU picks the kernels: torch's
own kernels follow the instruction set (``ATEN_CPU_CAPABILITY``: default, avx2, avx512) and MKL's
matrix products and vector math choose a code path by processor. Each of the two changes the weights'
bits on its own, while 1 or 2 threads do not. :func:`pinned_build` runs a build in a fresh process with
both fixed to the paths every x86-64 machine has (torch's portable kernels, MKL's SSE2-compatible
branch), so that a build does not depend on the caller's environment or thread count. It does not make
two CPU types agree: an AMD EPYC (AVX2) and an Intel Xeon (AVX-512) build different pinned toys, and
do so even when both are forced onto the same named paths (``bench/toy_determinism.py``); machines that
must share one toy share its cache folder (``$GNDPO_CACHE``) or pass ``--assets``. The pins cost 1.3x
(AMD) to 2.4x (Intel) the unpinned build's time.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from pathlib import Path

from gndpo.dist import scoped_environ, usable_cpus
from gndpo.pipeline.observe.logs import info

# Read by torch and MKL when they load, hence set for a fresh process. OMP/MKL thread counts follow
# torch.set_num_threads in use_build_threads.
PINNED_ARITHMETIC = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}


def use_build_threads() -> None:
    """Train toys on 2 torch threads where this process may use 2 CPUs, else on 1 (the same bits either
    way under the pinned arithmetic: bench/toy_determinism.py checks both). Two threads on one core (a
    pytest-xdist worker pinned to its core, ``taskset -c 0``) build the same toy about 15 times slower."""
    import torch

    torch.set_num_threads(min(2, usable_cpus()))


def pinned_build(build, *args, log=info, environment: dict | None = None):
    """A ``folder -> result`` function for :func:`cached_build` that runs ``build(*args, folder)`` in a
    fresh process with :data:`PINNED_ARITHMETIC` (or ``environment``, for the determinism bench; None removes a variable) and
    passes the child's log lines to ``log``. ``build`` must be a module-level function; a failure in the
    child is raised here with the child's traceback."""

    def run(folder: Path):
        ctx = multiprocessing.get_context("spawn")
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_build_child, args=(send, build, folder, args), daemon=True)
        with scoped_environ(PINNED_ARITHMETIC if environment is None else environment):
            child.start()  # spawn copies os.environ now: torch and MKL load in the child under it
        send.close()
        try:
            while True:
                try:
                    kind, payload = receive.recv()
                except EOFError:
                    raise RuntimeError(f"the toy build process died (exit code {child.exitcode})") from None
                if kind == "log":
                    log(payload)
                elif kind == "error":
                    raise RuntimeError(f"the toy build failed:\n{payload}")
                else:
                    return payload
        finally:
            if child.is_alive():
                child.terminate()
            child.join()

    return run


def _build_child(send, build, folder: Path, args: tuple) -> None:
    """The build process: run ``build``, sending its log lines, then its result or the traceback."""
    # The toys train on the CPU. transformers imports DeepSpeed when it loads a model, and DeepSpeed
    # with no accelerator named prints its guess ("Setting accelerator to CPU") past `gndpo -q`.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        result = build(*args, folder, log=lambda message: send.send(("log", message)))
        send.send(("done", result))
    except BaseException:
        send.send(("error", traceback.format_exc()))
    finally:
        send.close()
