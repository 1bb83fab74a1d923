"""The run's metrics: every committed manifest's metrics, one line per round and stage.

Manifests are the source of truth; ``metrics.jsonl`` is rebuilt from them after each stage (appending
is not atomic on object stores, rebuilding is idempotent).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

from gndpo.errors import first_line
from gndpo.storage.records import STAGES


def committed_rounds(run) -> int:
    """How many rounds have at least one committed stage."""
    r = 0
    while any(run.records(r, s).manifest() is not None for s in STAGES):
        r += 1
    return r


def collect_metrics(run) -> list[dict]:
    """One row of metrics per committed stage of every round (round, stage and its manifest's metrics)."""
    rows = []
    for r in range(committed_rounds(run)):
        for stage in STAGES:
            m = run.records(r, stage).manifest()
            if m is not None:
                rows.append({"round": r, "stage": stage, **m["metrics"]})
    return rows


def round_summary(run) -> str:
    """One line on the newest trained round: the held-out score of the policy it started from, what it
    sampled (reward, KL(student||teacher) estimate) and how its update went (loss, largest gradient
    norm), and the policy it produced: what `gndpo run` prints when it ends."""
    by = {(m["round"], m["stage"]): m for m in collect_metrics(run)}
    trained = [r for r, stage in by if stage == "train"]
    if not trained:
        return "no round trained yet"
    r = max(trained)
    figures = [("held-out", by.get((r, "rollout"), {}).get("heldout_accuracy"), ".3f"),
               ("held-out KL", by.get((r, "score"), {}).get("heldout_reverse_kl"), ".3f"),
               ("reward", by.get((r, "normalize"), {}).get("reward_mean"), ".3f"),
               ("KL estimate", by.get((r, "normalize"), {}).get("reverse_kl_estimate"), ".3f"),
               ("loss", by[(r, "train")].get("loss_mean"), ".4g"), ("grad-norm max", by[(r, "train")].get("grad_norm_max"), ".3g")]
    shown = ", ".join(f"{name} {value:{fmt}}" for name, value, fmt in figures if isinstance(value, (int, float)))
    return f"round {r}: {shown}; policy v{r + 1} committed ({r + 1} round{'s' if r else ''} trained)"


def write_metrics_jsonl(run) -> None:
    """Rewrite the run's metrics.jsonl from the committed manifests (one sorted JSON object a line)."""
    lines = "".join(json.dumps(row, sort_keys=True) + "\n" for row in collect_metrics(run))
    run.fs.write_new("metrics.jsonl", lines.encode())


def numeric_metrics(row: dict) -> dict[str, float]:
    """The plottable values of a metrics row (numbers; not round, stage, paths or booleans)."""
    return {
        k: float(v) for k, v in row.items()
        if k not in ("round", "stage") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def publish_metrics(run, manifest: dict, log_dir: str) -> None:
    """Send a just-committed stage's metrics to ``logging.backends`` (called once per stage, by the
    worker that wrote its manifest). TensorBoard: the event file under ``RUN/tensorboard/`` is rebuilt
    whole from every manifest under one fixed name, so a concurrent or repeated rebuild replaces it
    rather than adding points. W&B: this stage's row, logged to the run's W&B run. A backend that fails
    (not installed, no network, no credentials) is a warning: the stage is committed either way."""
    for backend in run.cfg.logging.backends:
        try:
            if backend == "tensorboard":
                write_tensorboard(run, collect_metrics(run))
            elif backend == "wandb":
                log_wandb(run, {"round": manifest["round"], "stage": manifest["stage"], **manifest["metrics"]}, log_dir)
        except Exception as exc:  # noqa: BLE001 - reporting must never fail a committed stage
            logging.getLogger(__name__).warning("metrics backend %s failed: %s", backend, first_line(exc))


# TensorBoard reads every file whose name holds "tfevents"; one fixed name makes a rebuild a replacement.
TENSORBOARD_FILE = "events.out.tfevents.gndpo"


def write_tensorboard(run, rows: list[dict]) -> None:
    """``RUN/tensorboard/events.out.tfevents.gndpo``: every row's ``<stage>/<metric>`` scalars at step =
    round, written whole and moved into place (replacing the previous file)."""
    import tempfile
    from pathlib import Path

    from torch.utils.tensorboard import SummaryWriter

    with tempfile.TemporaryDirectory() as tmp:
        writer = SummaryWriter(log_dir=tmp)
        for row in rows:
            for name, value in numeric_metrics(row).items():
                writer.add_scalar(f"{row['stage']}/{name}", value, global_step=row["round"])
        writer.close()
        (written,) = Path(tmp).glob("*tfevents*")
        run.fs.write_new(f"tensorboard/{TENSORBOARD_FILE}", written.read_bytes())


# This process's open W&B runs, keyed by everything wandb.init is given that picks or places the run
# (its id, from the run's URL and config fingerprint; project, entity, mode, folder): a second run in the
# same process, or the same folder re-initialised with another config, gets a W&B run of its own.
_WANDB: dict[tuple, object] = {}


def log_wandb(run, row: dict, log_dir: str) -> None:
    """Log one (round, stage) row to the run's W&B run: one per run folder and config (its id is derived
    from both, so a resumed or relaunched process continues it), x axis ``round``. Offline mode writes
    under ``log_dir`` and needs no network."""
    import atexit

    os.environ.setdefault("WANDB_SILENT", "true")  # no banners or integration hints on the terminal
    import wandb

    lc = run.cfg.logging
    run_id = f"gndpo-{hashlib.sha256(f'{run.fs.url} {run.cfg.fingerprint()}'.encode()).hexdigest()[:12]}"
    key = (run_id, lc.wandb_project, lc.wandb_entity, lc.wandb_mode, os.path.abspath(log_dir))
    if key not in _WANDB:
        os.makedirs(log_dir, exist_ok=True)
        wb = wandb.init(
            project=lc.wandb_project, entity=lc.wandb_entity or None, mode=lc.wandb_mode, dir=log_dir,
            id=run_id, resume="allow", name="/".join(run.fs.url.rstrip("/").rsplit("/", 2)[-2:]), config=run.cfg.to_dict(),
            # create_new: wandb's default outside notebooks hands back the process's first run instead
            reinit="create_new", settings=wandb.Settings(silent=True, console="off"),
        )
        wb.define_metric("round")
        wb.define_metric("*", step_metric="round")
        _WANDB[key] = wb
        atexit.register(wb.finish)
    _WANDB[key].log({"round": row["round"], **{f"{row['stage']}/{k}": v for k, v in numeric_metrics(row).items()}})
