"""The run's metrics: every committed manifest's metrics, one line per round and stage.

Manifests are the source of truth; ``metrics.jsonl`` is rebuilt from them after each stage (appending
is not atomic on object stores, rebuilding is idempotent).
"""

from __future__ import annotations

import hashlib
import json
import os

from gndpo.storage.records import STAGES


def committed_rounds(run) -> int:
    """How many rounds have at least one committed stage."""
    r = 0
    while any(run.records(r, s).manifest() is not None for s in STAGES):
        r += 1
    return r


def collect_metrics(run) -> list[dict]:
    rows = []
    for r in range(committed_rounds(run)):
        for stage in STAGES:
            m = run.records(r, stage).manifest()
            if m is not None:
                rows.append({"round": r, "stage": stage, **m["metrics"]})
    return rows


def write_metrics_jsonl(run) -> None:
    lines = "".join(json.dumps(row, sort_keys=True) + "\n" for row in collect_metrics(run))
    run.fs.write_new("metrics.jsonl", lines.encode())


def numeric_metrics(row: dict) -> dict[str, float]:
    """The plottable values of a metrics row (numbers; not round, stage, paths or booleans)."""
    return {
        k: float(v) for k, v in row.items()
        if k not in ("round", "stage") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def publish_metrics(run) -> None:
    """Send the run's metrics to ``logging.backends``: TensorBoard event files rebuilt from the manifests
    under ``RUN/tensorboard/`` (so a rerun or another worker never duplicates a point), and new
    (round, stage) rows to a Weights & Biases run whose id is derived from the run folder."""
    backends = run.cfg.logging.backends
    if not backends:
        return
    rows = collect_metrics(run)
    if "tensorboard" in backends:
        write_tensorboard(run, rows)
    if "wandb" in backends:
        log_wandb(run, rows)


def write_tensorboard(run, rows: list[dict]) -> None:
    """One event file with ``<stage>/<metric>`` scalars at step = round, replacing the previous file."""
    import tempfile

    from torch.utils.tensorboard import SummaryWriter

    with tempfile.TemporaryDirectory() as tmp:
        writer = SummaryWriter(log_dir=tmp)
        for row in rows:
            for name, value in numeric_metrics(row).items():
                writer.add_scalar(f"{row['stage']}/{name}", value, global_step=row["round"])
        writer.close()
        run.fs.replace_dir(tmp, "tensorboard")


_WANDB: dict[str, object] = {}


def log_wandb(run, rows: list[dict]) -> None:
    """Log the rows this process has not logged yet to the run's W&B run (one per run folder, resumed by
    id; x axis ``round``). Offline mode writes under the run's log folder and needs no network."""
    import atexit

    os.environ.setdefault("WANDB_SILENT", "true")  # no banners or integration hints on the terminal
    import wandb

    from gndpo.pipeline.rounds import worker_log_dir

    key = run.fs.url
    state = _WANDB.get(key)
    if state is None:
        lc = run.cfg.logging
        folder = worker_log_dir(run.fs.url)
        os.makedirs(folder, exist_ok=True)
        wb = wandb.init(
            project=lc.wandb_project, entity=lc.wandb_entity or None, mode=lc.wandb_mode, dir=folder,
            id=f"gndpo-{hashlib.sha256(run.fs.url.encode()).hexdigest()[:12]}", resume="allow",
            name=run.fs.url.rstrip("/").rsplit("/", 1)[-1], config=run.cfg.to_dict(),
            settings=wandb.Settings(silent=True, console="off"),
        )
        wb.define_metric("round")
        wb.define_metric("*", step_metric="round")
        state = _WANDB[key] = {"run": wb, "logged": set()}
        atexit.register(wb.finish)
    for row in rows:
        mark = (row["round"], row["stage"])
        if mark in state["logged"]:
            continue
        state["run"].log({"round": row["round"], **{f"{row['stage']}/{k}": v for k, v in numeric_metrics(row).items()}})
        state["logged"].add(mark)
