"""``gndpo run``'s loop on this machine: how many GPUs, and whether the stages share kept engines."""

from __future__ import annotations

from gndpo.apps.rounds import keeps_models, run_rounds
from gndpo.pipeline.observe.logs import info
from gndpo.pipeline.run.run import open_run
from gndpo.stages.models.device import visible_gpus
from gndpo.stages.models.live import LiveModels


def run_loop(url: str, rounds: int, gpus: int | None = None, keep_alive: bool = True, log=info, live=None) -> None:
    """Run rounds 0..rounds-1 of ``url`` (:func:`gndpo.apps.rounds.run_rounds`).

    ``gpus``: GPUs of this node to use (None: every visible one). ``keep_alive``: where
    :func:`keeps_models` allows (at most one GPU, one train rank, one rollout worker), run every stage in
    this process on kept engines: ``live`` (a caller's set, left open, e.g. for a final evaluation on
    the same engine) or one made and closed here."""
    gpus = visible_gpus() if gpus is None else gpus
    if not (keep_alive and keeps_models(open_run(url).cfg, gpus)):
        run_rounds(url, rounds, gpus=gpus, log=log)
        return
    own = live is None
    live = LiveModels(keep=True, log=log) if own else live
    try:
        run_rounds(url, rounds, gpus=gpus, log=log, live=live)
    finally:
        if own:
            live.close()
