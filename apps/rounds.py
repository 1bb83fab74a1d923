"""The round loop, and running one stage as a resumable job.

``run_stage`` runs one stage of one round in this process through the work-unit executor
(:mod:`gndpo.pipeline.exec.units`). ``run_rounds`` loops rollout -> score -> normalize -> train for each round,
skipping every stage whose manifest is already committed, so rerunning it after a crash resumes at the
first uncommitted stage. Each stage runs in its own process(es): vLLM and DeepSpeed each own the process
they start in, memory is returned between stages, and train can be launched with several ranks.

On a node with G GPUs (every visible one, or ``gndpo run --gpus G``) rollout and
score start one ``--worker`` process per GPU (per ``engine.tensor_parallel_size`` GPUs for rollout), each
pinned with ``CUDA_VISIBLE_DEVICES`` and writing to its own log file (:func:`worker_log_dir`); they share
the stage's units through leases, and the last one to finish commits the stage. normalize runs once,
train runs under torchrun with ``train.num_processes`` ranks (0: one per GPU). Without GPUs (and without
``--gpus``) every stage is one process whose output goes to the terminal. :func:`stage_processes` is the
plan; :func:`run_stage_processes` runs it.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gndpo.dist import Dist, usable_cpus
from gndpo.errors import GndpoError
from gndpo.pipeline.exec.inputs import StageInputs
from gndpo.pipeline.exec.signals import STAGE_OF_RUN_ENV, die_with_parent
from gndpo.pipeline.exec.units import Worker, run_collective
from gndpo.pipeline.observe import progress
from gndpo.pipeline.observe.logs import info, worker_file
from gndpo.pipeline.observe.metrics import publish_metrics, write_metrics_jsonl
from gndpo.pipeline.run.run import open_run
from gndpo.pipeline.settings.schema import Config
from gndpo.stages import job_class
from gndpo.storage.cache import cache_root
from gndpo.storage.records import STAGES, Manifest
from gndpo.storage.runfs import RunFS


def check_round(run, round_idx: int, stage: str) -> None:
    """A stage runs once what it reads (its class's ``reads``) is committed."""
    if round_idx < 0:
        raise GndpoError(f"round must be >= 0, got {round_idx}")
    StageInputs(run, round_idx, job_class(stage).reads).require(stage)


def run_stage(
    url: str, stage: str, round_idx: int, worker: bool = False, lease_ttl: float = 120.0, log=info, live=None
) -> Manifest | None:
    """Run (or join, with ``worker``) one stage; returns its manifest, or None if other workers still
    hold units when this worker runs out of work. ``live``: the engines and models to compute with
    (:class:`gndpo.stages.models.live.LiveModels`; default: built for this stage alone)."""
    run = open_run(url)
    check_round(run, round_idx, stage)
    if lease_ttl <= 0:
        raise GndpoError("--lease-ttl must be positive")
    records = run.records(round_idx, stage)
    # The log file first: the stage's modules import vLLM, which sets up its logging when imported.
    with worker_log(url, f"r{round_idx:04d}-{stage}"):
        job = job_class(stage)(run, round_idx, log=log, live=live)

        def committed(manifest: Manifest) -> None:  # by the one worker whose manifest write succeeded
            publish_metrics(run, manifest, worker_log_dir(url))

        dist = Dist.from_env()
        if stage == "train" and dist.world > 1:
            manifest = run_collective(records, job, ttl=lease_ttl, log=log, on_manifest=committed)
        else:
            manifest = Worker(records, job, ttl=lease_ttl, log=log, on_manifest=committed).run(wait_for_others=not worker)
        if manifest is not None and dist.main:
            write_metrics_jsonl(run)
        if manifest is not None and stage == "train" and live is not None:
            live.train_committed()
    return manifest


def stage_command(url: str, stage: str, round_idx: int, num_processes: int = 1) -> list[str]:
    """The command line that runs one stage in a fresh process (train under torchrun for >1 rank)."""
    tail = ["-m", "gndpo", stage, url, "--round", str(round_idx)]
    if stage == "train" and num_processes > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_processes}", *tail]
    return [sys.executable, *tail]


def worker_log_dir(url: str) -> str:
    """Where ``gndpo run`` writes its workers' logs: ``RUN/logs/`` for a local run folder; for a run on
    object storage (``s3://bucket/exp/run``) a local folder, ``$GNDPO_CACHE/logs/<bucket_exp_run>-<hash>/``
    (``GNDPO_CACHE`` defaults to ``~/.cache/gndpo``), since a log is appended to while it is written."""
    fs = RunFS(url)
    if fs.is_local:
        return fs.path("logs")
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", fs.root).strip("_") or "run"
    digest = hashlib.sha256(fs.url.encode()).hexdigest()[:8]
    return str(cache_root() / "logs" / f"{name}-{digest}")


def worker_log(url: str, name: str):
    """This process's log file for ``name`` (a stage, or the whole loop) in :func:`worker_log_dir`;
    for a run on object storage it is copied into ``RUN/logs/`` when the block ends."""
    fs = RunFS(url)
    return worker_file(worker_log_dir(url), name, copy_to=None if fs.is_local else fs)


@dataclass(frozen=True)
class StageProcess:
    """One process of a stage: its command line, the environment it adds, and the file its output goes
    to (None: inherited from ``gndpo run``)."""

    argv: list
    env: dict
    log_path: str | None
    name: str = "main"  # "gpu3" for a per-GPU worker


def _device_ids(count: int) -> list[str]:
    """The ids to put in CUDA_VISIBLE_DEVICES for GPUs 0..count-1 of this process's view: the entries of
    an inherited CUDA_VISIBLE_DEVICES when there is one (e.g. the GPUs a scheduler gave this job)."""
    inherited = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if inherited:
        if len(inherited) < count:
            raise GndpoError(f"--gpus {count} but CUDA_VISIBLE_DEVICES names only {len(inherited)}: {','.join(inherited)}")
        return inherited[:count]
    return [str(i) for i in range(count)]


def stage_processes(
    url: str, stage: str, round_idx: int, gpus: int, num_processes: int = 0, gpus_per_worker: int = 1, log_dir: str | None = None
) -> list[StageProcess]:
    """The processes that run ``stage`` of ``round_idx`` on a node with ``gpus`` GPUs.

    * rollout, score with gpus >= 1: one ``--worker`` per ``gpus_per_worker`` GPUs (rollout: the engine's
      tensor-parallel size; score: 1), pinned with CUDA_VISIBLE_DEVICES, output to
      ``<log_dir>/r0003-score-gpu1.log``;
    * train: one process, under torchrun with ``num_processes`` ranks if > 0, else one per GPU;
    * normalize, and every stage with gpus == 0: one process, output inherited (as before GPUs counted).

    Where several processes share the node (workers, train's ranks), each gets its share of the CPUs
    (``GNDPO_THREADS``): each would otherwise start a torch thread per CPU, and 8 workers on a node
    would run 8 times as many threads as it has cores.
    """
    if gpus < 0:
        raise GndpoError(f"--gpus must be >= 0, got {gpus}")
    if stage == "train":
        nproc = num_processes if num_processes > 0 else max(gpus, 1)
        return [StageProcess(stage_command(url, stage, round_idx, nproc), cpu_share(nproc) if nproc > 1 else {}, None)]
    if gpus == 0 or stage not in ("rollout", "score"):
        return [StageProcess(stage_command(url, stage, round_idx), {}, None)]
    per = max(gpus_per_worker, 1)
    if per > gpus:
        raise GndpoError(f"{stage} needs {per} GPUs per worker (engine.tensor_parallel_size) but this node has {gpus}")
    ids = _device_ids(gpus)
    log_dir = log_dir or worker_log_dir(url)
    procs = []
    threads = cpu_share(gpus // per)
    for w in range(gpus // per):
        group = ids[w * per : (w + 1) * per]
        name = f"gpu{w * per}" if per == 1 else f"gpu{w * per}-{(w + 1) * per - 1}"
        procs.append(
            StageProcess(
                [*stage_command(url, stage, round_idx), "--worker"],
                {"CUDA_VISIBLE_DEVICES": ",".join(group), "LOCAL_RANK": "0", **threads},
                f"{log_dir}/r{round_idx:04d}-{stage}-{name}.log",
                name,
            )
        )
    return procs


def cpu_share(processes: int) -> dict[str, str]:
    """The environment that gives each of ``processes`` processes on this node its share of the CPUs
    this one may use (at least one): read by :func:`gndpo.stages.models.device.set_cpu_threads`."""
    return {"GNDPO_THREADS": str(max(usable_cpus() // processes, 1))}


def run_stage_processes(procs: list[StageProcess], stage: str, round_idx: int) -> None:
    """Start every process of the plan, wait for all, and raise naming the first that failed (with its
    log file). Processes still running when this one is interrupted are terminated."""
    running = []
    try:
        for p in procs:
            # A stage of this run: on a signal it stops quietly, and this process says how to resume.
            env = {**os.environ, **p.env, STAGE_OF_RUN_ENV: "1"}
            if p.log_path is None:
                running.append((p, subprocess.Popen(p.argv, env=env, preexec_fn=die_with_parent)))
                continue
            Path(p.log_path).parent.mkdir(parents=True, exist_ok=True)
            with open(p.log_path, "ab") as out:  # appended: a resumed stage keeps the earlier attempt's log
                out.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(p.argv)} ({p.env})\n".encode())
                out.flush()
                running.append((p, subprocess.Popen(p.argv, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)))
        codes = [(p, proc.wait()) for p, proc in running]
    finally:
        for _, proc in running:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    failed = [(p, code) for p, code in codes if code != 0]
    if failed:
        p, code = failed[0]
        if p.log_path is None:
            raise GndpoError(f"{stage} of round {round_idx} failed (exit code {code}); rerun to resume")
        more = f" ({len(failed) - 1} more workers failed)" if len(failed) > 1 else ""
        raise GndpoError(
            f"{stage} of round {round_idx} failed: worker {p.name} exited with code {code}{more}; "
            f"log: {p.log_path}; rerun to resume"
        )


def keeps_models(cfg: Config, gpus: int) -> bool:
    """Whether ``gndpo run`` can run every stage in this process, keeping engines and models alive
    between stages and rounds: with at most one GPU, one train rank and one rollout worker."""
    return gpus <= 1 and cfg.train.num_processes <= 1 and cfg.engine.tensor_parallel_size == 1


def run_rounds(url: str, rounds: int, gpus: int = 0, log=info, live=None) -> None:
    """Run rounds 0..rounds-1, skipping committed stages; a failing stage stops the loop.

    ``live``: kept engines and models (:class:`gndpo.stages.models.live.LiveModels`, made by the caller,
    who decides with :func:`keeps_models`): every stage then runs in this process, each through the
    work-unit executor exactly as a stage process would, on the same vLLM engine, teacher and DeepSpeed
    engine. None: each stage runs as the processes :func:`stage_processes` plans for ``gpus`` GPUs."""
    run = open_run(url)
    in_process = live is not None
    with worker_log(url, "run"), progress.task("rounds", total=rounds * len(STAGES), unit="stages", draw=in_process) as bar:
        for r in range(rounds):
            for stage in STAGES:
                if run.records(r, stage).manifest() is not None:
                    bar.advance(1)
                    continue
                t0 = time.time()
                if in_process:
                    log(f"round {r}: {stage} ...")
                    run_stage(url, stage, r, log=log, live=live)
                else:
                    run_stage_in_processes(url, run, stage, r, gpus, log)
                if run.records(r, stage).manifest() is None:
                    raise GndpoError(f"{stage} of round {r} finished without committing its manifest; rerun to resume")
                log(f"round {r}: {stage} committed in {time.time() - t0:.1f}s")
                bar.advance(1)


def run_stage_in_processes(url: str, run, stage: str, round_idx: int, gpus: int, log=info) -> None:
    """Run one stage as the processes :func:`stage_processes` plans, and one more to finish if none of
    them committed."""
    per = run.cfg.engine.tensor_parallel_size if stage == "rollout" else 1
    procs = stage_processes(url, stage, round_idx, gpus, run.cfg.train.num_processes, gpus_per_worker=per)
    workers = [p for p in procs if p.log_path]
    where = f" on {len(workers)} workers (logs: {Path(workers[0].log_path).parent}/)" if workers else ""
    log(f"round {round_idx}: {stage}{where} ...")
    run_stage_processes(procs, stage, round_idx)
    if run.records(round_idx, stage).manifest() is None:
        # Every worker exited and none committed the stage (one lost a race, or all found the
        # last units leased): one more process takes over what is left and commits.
        finish = StageProcess(stage_command(url, stage, round_idx), dict(workers[0].env) if workers else {}, None)
        run_stage_processes([finish], stage, round_idx)
