"""``gndpo run``'s loop on this machine: how many GPUs, in which order the stages run, and whether they
share kept engines."""

from __future__ import annotations

from gndpo.apps.rounds import DeviceSets, keeps_models, run_rounds, stage_cpus
from gndpo.apps.schedule import choose_order, run_scheduled
from gndpo.apps.workers import run_with_workers
from gndpo.pipeline.observe.logs import info
from gndpo.pipeline.run.run import Run, open_run
from gndpo.stages.models.device import visible_gpus
from gndpo.stages.models.live import LiveModels


def run_loop(url: str, rounds: int, gpus: int | None = None, keep_alive: bool = True, log=info, live=None, learner_gpus: int = 0,
             overlap: str | None = None) -> Run:
    """Run rounds 0..rounds-1 of ``url``.

    ``gpus``: GPUs of this node to use (None: every visible one); ``learner_gpus``: how many of them run
    score and train, the others rollout; ``overlap``: in place of ``run.overlap``
    (:func:`gndpo.apps.schedule.choose_order`). The order is chosen and said in one line.
    Sequentially, where ``keep_alive`` and :func:`keeps_models` allow (at most one GPU, one train rank,
    one rollout worker), every stage runs in this process on kept engines: ``live``
    (a caller's set, left open, e.g. for a final evaluation on the same engine) or one made and closed
    here (:func:`gndpo.apps.rounds.run_rounds`). Overlapped on the CPU or on GPUs split between rollout
    and the learner, each stage runs in workers that stay for the whole run
    (:func:`gndpo.apps.workers.run_with_workers`). Otherwise (or with ``keep_alive`` off) each stage of
    each round runs in processes of its own (:func:`gndpo.apps.schedule.run_scheduled`).
    Returns the run, opened once."""
    gpus = visible_gpus() if gpus is None else gpus
    run = open_run(url)
    # Refused in one line before anything is said or started, whichever order runs.
    devices = DeviceSets.of(gpus, learner_gpus)
    stage_cpus()
    # Once rounds of this run have run one stage at a time, their seconds, not the config's FLOPs, are the model's.
    order = choose_order(run.cfg, gpus, learner_gpus, overlap, run=run)
    log(order.line())
    learner_gpus = learner_gpus if not order.sequential else 0  # one stage at a time: each on every GPU
    # Workers that stay keep their models for the whole run: where stages share a GPU, what one keeps
    # would hold memory the next needs, so there each stage of each round still gets a process.
    if not order.sequential and keep_alive and (gpus == 0 or devices.split):
        run_with_workers(url, rounds, gpus, order, learner_gpus, log=log)
        return run
    if not (order.sequential and keep_alive and keeps_models(run.cfg, gpus)):
        run_scheduled(url, rounds, gpus, order, learner_gpus, log=log)
        return run
    own = live is None
    live = LiveModels(keep=True, log=log) if own else live
    try:
        run_rounds(url, rounds, live, log=log, run=run, let_go=own)
    finally:
        if own:
            live.close()
    return run
