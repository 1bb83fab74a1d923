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
from functools import partial
from pathlib import Path

from gndpo.dist import Dist, usable_cpus
from gndpo.errors import GndpoError
from gndpo.pipeline.exec.inputs import StageInputs
from gndpo.pipeline.exec.signals import STAGE_OF_RUN_ENV, die_with_parent
from gndpo.pipeline.exec.stage import StageContext, StageJob, collective_ranks
from gndpo.pipeline.exec.units import Worker, run_collective
from gndpo.pipeline.observe import progress
from gndpo.pipeline.observe.logs import info, worker_file
from gndpo.pipeline.observe.metrics import publish_metrics, write_metrics_jsonl
from gndpo.pipeline.run.products import ROLLOUTS, SCORES
from gndpo.pipeline.run.run import Run, open_run
from gndpo.pipeline.settings.schema import Config
from gndpo.stages.registry import job_class, stage_names
from gndpo.storage.cache import cache_root
from gndpo.storage.products import Manifest
from gndpo.storage.runfs import RunFS


def check_round(run, round_idx: int, stage: str, follow: bool = False) -> None:
    """A stage runs once what it reads (its class's ``reads``) is committed; with ``follow``, a stage
    that reads another unit by unit (score) may start while that one runs."""
    if round_idx < 0:
        raise GndpoError(f"round must be >= 0, got {round_idx}")
    job = job_class(stage)
    if follow and not job.streams():
        streaming = ", ".join(s for s in stage_names() if job_class(s).streams())
        raise GndpoError(f"--follow streams a stage behind the one it reads unit by unit; {stage} reads none that way ({streaming} does)")
    StageInputs(run, round_idx, job.reads, follow=follow).require(stage)


def run_stage(
    url: str, stage: str, round_idx: int, worker: bool = False, lease_ttl: float = 120.0, log=info, live=None, follow: bool = False,
    run: Run | None = None, final: bool = False,
) -> Manifest | None:
    """Run (or join, with ``worker``) one stage; returns its manifest, or None if other workers still
    hold units when this worker runs out of work. ``live``: the engines and models to compute with
    (:class:`gndpo.stages.models.live.LiveModels`; default: built for this stage alone and released
    when it returns, as a user's process calling it would want). ``follow``: stream behind the stage
    it reads unit by unit, taking each unit once its input unit commits. ``run``: the run at ``url``
    where the caller has it open (the round loop), else opened here. ``final``: ``round_idx`` is the last
    round the caller runs (:class:`gndpo.pipeline.exec.stage.StageContext`)."""
    if live is None:
        # Imported here: it imports torch, which registering the commands must not (cli/stages.py imports this module).
        from gndpo.stages.models.live import LiveModels

        own = LiveModels(log=log)
        try:
            return run_stage(url, stage, round_idx, worker, lease_ttl, log, own, follow, run, final)
        finally:
            own.close()
    run = run or open_run(url)
    check_round(run, round_idx, stage, follow)
    if lease_ttl <= 0:
        raise GndpoError("--lease-ttl must be positive")
    # The log file first: the stage's modules import vLLM, which sets up its logging when imported.
    with worker_log(url, f"r{round_idx:04d}-{stage}"):
        dist = Dist.from_env()
        job: StageJob = job_class(stage)(run, round_idx, StageContext(log=log, live=live, follow=follow, dist=dist, final=final))
        records = run.records(round_idx, job.makes)

        def committed(manifest: Manifest) -> None:  # by the one worker whose manifest write succeeded
            publish_metrics(run, manifest, worker_log_dir(url))

        if job.launch.collective and dist.world > 1:
            manifest = run_collective(records, job, ttl=lease_ttl, log=log, on_manifest=committed)
        else:
            worker_of = Worker(records, job, ttl=lease_ttl, poll=run.cfg.run.poll_seconds, log=log, on_manifest=committed)
            manifest = worker_of.run(wait_for_others=not worker)
        if manifest is not None and dist.main:
            write_metrics_jsonl(run)
        if manifest is not None:
            job.committed(manifest)
    return manifest


@dataclass(frozen=True)
class Stay:
    """A worker that stays: it works its stage in every round up to ``rounds``, the actor at most
    ``ahead`` rounds before the learner (:func:`gndpo.apps.workers.work_rounds`)."""

    rounds: int
    ahead: int = 0


def round_args(rounds: int | Stay, final: bool = False) -> list[str]:
    """A stage command's options for one round (``final``: the run's last), or for a worker that stays."""
    if isinstance(rounds, Stay):
        return ["--rounds", str(rounds.rounds), "--ahead", str(rounds.ahead)]
    return ["--round", str(rounds), *(["--final"] if final else [])]


def stage_command(url: str, stage: str, rounds: int | Stay, num_processes: int = 1, follow: bool = False, final: bool = False) -> list[str]:
    """The command line that runs one stage in a fresh process, for one round (``final``: the run's
    last) or staying for all (:class:`Stay`) (train under torchrun for >1 rank; ``follow``: streaming
    behind the stage it reads unit by unit)."""
    tail = ["-m", "gndpo", stage, url, *round_args(rounds, final), *(["--follow"] if follow else [])]
    if job_class(stage).launch.collective and num_processes > 1:
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
    """One process of a stage: its command line, the environment it adds, the file its output goes
    to (None: inherited from ``gndpo run``), and the CPUs it is pinned to (empty: not pinned)."""

    argv: list
    env: dict
    log_path: str | None
    name: str = "main"  # "gpu3" for a per-GPU worker
    cpus: tuple[int, ...] = ()


def _device_ids(count: int) -> list[str]:
    """The ids to put in CUDA_VISIBLE_DEVICES for GPUs 0..count-1 of this process's view: the entries of
    an inherited CUDA_VISIBLE_DEVICES when there is one (e.g. the GPUs a scheduler gave this job)."""
    inherited = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if inherited:
        if len(inherited) < count:
            raise GndpoError(f"--gpus {count} but CUDA_VISIBLE_DEVICES names only {len(inherited)}: {','.join(inherited)}")
        return inherited[:count]
    return [str(i) for i in range(count)]


@dataclass(frozen=True)
class DeviceSets:
    """Which GPUs each stage's processes use: every GPU for every stage, or with ``--learner-gpus K`` the
    last K for score and train (the learner) and the others for rollout (the actor), so that rollout can
    run beside them (:mod:`gndpo.apps.schedule`)."""

    rollout: list[str]
    learner: list[str]

    @classmethod
    def of(cls, gpus: int, learner_gpus: int = 0) -> DeviceSets:
        if learner_gpus < 0:
            raise GndpoError(f"--learner-gpus must be >= 0, got {learner_gpus}")
        ids = _device_ids(gpus) if gpus > 0 else []
        if learner_gpus == 0:
            return cls(ids, ids)
        if gpus == 0:
            raise GndpoError(f"--learner-gpus {learner_gpus} splits GPUs between rollout and the learner, and this run uses none "
                             "(no GPU visible, or --gpus 0); leave it out on the CPU")
        if learner_gpus >= gpus:
            raise GndpoError(f"--learner-gpus {learner_gpus} leaves rollout no GPU of the {gpus} this run uses (--gpus); give it at most {gpus - 1}")
        return cls(ids[: gpus - learner_gpus], ids[gpus - learner_gpus :])

    @property
    def split(self) -> bool:
        return self.rollout != self.learner

    def of_stage(self, stage: str) -> list[str]:
        return self.rollout if job_class(stage).launch.actor else self.learner


def stage_cpus(spec: str | None = None) -> dict[str, tuple[int, ...]]:
    """{stage: CPUs} from ``GNDPO_STAGE_CPUS`` (or ``spec``), e.g. ``rollout=0 score=1 normalize=1
    train=1``: each stage's processes are pinned to those cores, as each would own its devices; a stage
    not named is not pinned. A one-line GndpoError for a malformed entry."""
    spec = os.environ.get("GNDPO_STAGE_CPUS", "") if spec is None else spec
    pinned = {}
    for entry in spec.split():
        stage, _, cpus = entry.partition("=")
        try:
            pinned[stage] = tuple(int(c) for c in cpus.split(","))
        except ValueError:
            pinned[stage] = ()
        if stage not in stage_names() or not pinned[stage]:
            raise GndpoError(f"GNDPO_STAGE_CPUS entry {entry!r} is not STAGE=CPU[,CPU...] with STAGE one of {', '.join(stage_names())}")
    return pinned


def stage_processes(
    url: str, stage: str, round_idx: int | Stay, gpus: int, num_processes: int = 0, gpus_per_worker: int = 1,
    devices: list[str] | None = None, follow: bool = False, cpus: tuple[int, ...] = (), final: bool = False,
) -> list[StageProcess]:
    """The processes that run ``stage`` of ``round_idx`` (or of every round, staying: :class:`Stay`) on a
    node with ``gpus`` GPUs (``devices``: the ids of those this stage uses, default the first ``gpus``;
    :class:`DeviceSets`).

    * a stage launched per GPU (rollout, score; :class:`gndpo.pipeline.exec.stage.Launch`) with gpus >= 1:
      one ``--worker`` per ``gpus_per_worker`` GPUs (rollout: the engine's tensor-parallel size; score:
      1), pinned with CUDA_VISIBLE_DEVICES, output to ``r0003-score-gpu1.log`` in :func:`worker_log_dir`;
    * a collective stage (train): one process, under torchrun with ``num_processes`` ranks if > 0, else
      one per GPU (pinned to ``devices`` where they are a subset);
    * any other stage (normalize), and every stage with gpus == 0: one process, output inherited.

    Where several processes share the node (workers, train's ranks), each gets its share of the CPUs
    (``GNDPO_THREADS``): each would otherwise start a torch thread per CPU, and 8 workers on a node
    would run 8 times as many threads as it has cores. ``follow``: score streams behind rollout
    (``--follow``). ``cpus``: the cores every process is pinned to. ``final``: ``round_idx`` is the run's
    last round (``--final``).
    """
    if gpus < 0:
        raise GndpoError(f"--gpus must be >= 0, got {gpus}")
    subset = devices is not None and len(devices) < gpus
    gpus, ids = (len(devices), devices) if devices is not None else (gpus, None)
    launch = job_class(stage).launch
    if launch.collective:
        nproc = collective_ranks(num_processes, gpus)
        env = {**(cpu_share(nproc) if nproc > 1 else {}), **({"CUDA_VISIBLE_DEVICES": ",".join(ids)} if subset else {})}
        return [StageProcess(stage_command(url, stage, round_idx, nproc, final=final), env, None, cpus=cpus)]
    if gpus == 0 or not launch.per_gpu:
        return [StageProcess(stage_command(url, stage, round_idx, follow=follow, final=final), {}, None, cpus=cpus)]
    per = max(gpus_per_worker, 1)
    if per > gpus:
        raise GndpoError(f"{stage} needs {per} GPUs per worker (engine.tensor_parallel_size) but this node has {gpus}")
    ids = ids or _device_ids(gpus)
    log_dir = worker_log_dir(url)
    procs = []
    threads = cpu_share(gpus // per)
    for w in range(gpus // per):
        group = ids[w * per : (w + 1) * per]
        name = f"gpu{w * per}" if per == 1 else f"gpu{w * per}-{(w + 1) * per - 1}"
        procs.append(
            StageProcess(
                [*stage_command(url, stage, round_idx, follow=follow, final=final), "--worker"],
                {"CUDA_VISIBLE_DEVICES": ",".join(group), "LOCAL_RANK": "0", **threads},
                f"{log_dir}/{stage if isinstance(round_idx, Stay) else f'r{round_idx:04d}-{stage}'}-{name}.log",
                name,
                cpus,
            )
        )
    return procs


def cpu_share(processes: int) -> dict[str, str]:
    """The environment that gives each of ``processes`` processes on this node its share of the CPUs
    this one may use (at least one): read by :func:`gndpo.stages.models.device.set_cpu_threads`."""
    return {"GNDPO_THREADS": str(max(usable_cpus() // processes, 1))}


def _child_setup(cpus: tuple[int, ...]) -> None:
    """In a stage process before exec: die with ``gndpo run``, and keep to its cores (if pinned)."""
    die_with_parent()
    if cpus:
        os.sched_setaffinity(0, cpus)


class StageGroup:
    """The running processes of one stage of one round, started together (a ``preexec_fn`` makes each
    die with this process and keep to its cores). :meth:`wait` blocks; :meth:`exited` polls."""

    def __init__(self, procs: list[StageProcess], stage: str, round_idx: int, started_at: float | None = None, finishing: bool = False,
                 label: str | None = None):
        """``finishing``: the one process started after the stage's first ones exited without committing
        it (``started_at``: when those started). ``label``: what its errors call it (default: the stage
        and round)."""
        self.procs, self.stage, self.round, self.finishing = procs, stage, round_idx, finishing
        self.label = label or f"{stage} of round {round_idx}"
        self.started_at = time.time() if started_at is None else started_at
        self.running: list[tuple[StageProcess, subprocess.Popen]] = []
        try:
            for p in procs:
                # A stage of this run: on a signal it stops quietly, and this process says how to resume.
                env = {**os.environ, **p.env, STAGE_OF_RUN_ENV: "1"}
                setup = partial(_child_setup, p.cpus)
                if p.log_path is None:
                    self.running.append((p, subprocess.Popen(p.argv, env=env, preexec_fn=setup)))
                    continue
                Path(p.log_path).parent.mkdir(parents=True, exist_ok=True)
                with open(p.log_path, "ab") as out:  # appended: a resumed stage keeps the earlier attempt's log
                    out.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(p.argv)} ({p.env})\n".encode())
                    out.flush()
                    self.running.append((p, subprocess.Popen(p.argv, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=setup)))
        except BaseException:
            self.terminate()
            raise

    def exited(self) -> bool:
        return all(proc.poll() is not None for _, proc in self.running)

    def wait(self) -> None:
        """Wait for every process; then :meth:`raise_if_failed`. Interrupted, the rest are terminated."""
        try:
            for _, proc in self.running:
                proc.wait()
        finally:
            self.terminate()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """A GndpoError naming the first process that failed (with its log file), once all exited."""
        failed = [(p, proc.returncode) for p, proc in self.running if proc.returncode != 0]
        if not failed:
            return
        p, code = failed[0]
        if p.log_path is None:
            raise GndpoError(f"{self.label} failed (exit code {code}); rerun to resume")
        more = f" ({len(failed) - 1} more workers failed)" if len(failed) > 1 else ""
        raise GndpoError(f"{self.label} failed: worker {p.name} exited with code {code}{more}; log: {p.log_path}; rerun to resume")

    def terminate(self) -> None:
        """Stop the processes still running (SIGTERM, then SIGKILL after 30 s)."""
        for _, proc in self.running:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def run_stage_processes(procs: list[StageProcess], stage: str, round_idx: int) -> None:
    """Start every process of the plan, wait for all, and raise naming the first that failed (with its
    log file). Processes still running when this one is interrupted are terminated."""
    StageGroup(procs, stage, round_idx).wait()


def keeps_models(cfg: Config, gpus: int) -> bool:
    """Whether ``gndpo run`` can run every stage in this process, keeping engines and models alive
    between stages and rounds: with at most one GPU, one train rank and one rollout worker."""
    return gpus <= 1 and cfg.train.num_processes <= 1 and cfg.engine.tensor_parallel_size == 1


def let_go_after(live, stage: str) -> None:
    """After the run's last round's ``stage``: free the kept models only it used (rollout's engine,
    score's teachers), so train's peak is not the sum of every stage's models."""
    if job_class(stage).makes is ROLLOUTS:
        live.let_go_of_samplers()
    elif job_class(stage).makes is SCORES:
        live.let_go_of_teachers()


def run_rounds(url: str, rounds: int, live, log=info, run: Run | None = None, let_go: bool = False) -> None:
    """Run rounds 0..rounds-1 one stage at a time in this process, skipping committed stages; a failing
    stage stops the loop. ``live``: kept engines and models (:class:`gndpo.stages.models.live.LiveModels`,
    made by the caller, who decides with :func:`keeps_models`): every stage runs through the work-unit
    executor exactly as a stage process would, on the same vLLM engine, teacher and DeepSpeed engine.
    Stages in processes of their own, one after another or overlapped: :mod:`gndpo.apps.schedule`.
    ``run``: the run at ``url``, where the caller has it open. ``let_go``: ``live`` is this run's alone
    (no caller evaluates on its engine afterwards, no other run reuses it): in the last round each
    stage's models go once no later stage uses them (:func:`let_go_after`)."""
    run = run or open_run(url)
    stages = stage_names()
    with worker_log(url, "run"), progress.task("rounds", total=rounds * len(stages), unit="stages") as bar:
        for r in range(rounds):
            for stage in stages:
                if run.records(r, stage).manifest() is not None:
                    bar.advance(1)
                    continue
                t0 = time.time()
                log(f"round {r}: {stage} ...")
                run_stage(url, stage, r, log=log, live=live, run=run, final=r == rounds - 1)
                if run.records(r, stage).manifest() is None:
                    raise GndpoError(f"{stage} of round {r} finished without committing its manifest; rerun to resume")
                if let_go and r == rounds - 1:
                    let_go_after(live, stage)
                log(f"round {r}: {stage} committed in {time.time() - t0:.1f}s")
                bar.advance(1)
