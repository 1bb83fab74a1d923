"""The run's metrics: every committed manifest's metrics, one line per round and stage.

Manifests are the source of truth; ``metrics.jsonl`` is rebuilt from them after each stage (appending
is not atomic on object stores, rebuilding is idempotent).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass

from gndpo.errors import first_line
from gndpo.pipeline.run.products import POLICY, ROLLOUTS, ROUND, SCORES, STATISTICS
from gndpo.storage.products import Manifest


@dataclass(frozen=True)
class Metric:
    """One key of a stage manifest's ``metrics`` (what ``metrics.jsonl``, ``gndpo sql``'s ``metrics``
    view, the report and the logging backends show): the ``stage`` that writes it (``every``: all four),
    its ``name`` (``<phase>`` stands for one of :data:`PHASES`), what it means, and ``when`` it is there
    (empty: every round)."""

    stage: str
    name: str
    meaning: str
    when: str = ""


# The phases a unit's clock charges time and bytes to (gndpo.storage.meter: ``with phase(...)`` in the stages).
PHASES = ("setup", "engine", "load", "replay", "compute", "write", "checkpoint", "export", "state")  # in the order a stage runs them

# Every metric a stage commits, documented (docs/reference/metrics.md is generated from this table; the
# docs tests check that a toy round's manifests, every stage's summarize and every method's normalize
# statistics write only these keys, and that each of these keys is written by one of them).
METRICS: tuple[Metric, ...] = (
    Metric("every", "phase_<phase>_seconds", "Seconds of the stage's work spent in the phase, summed over its units (units that ran side by "
           "side on several workers add up): setup (a stage's own preparation), engine (starting vLLM engines), load (loading models, "
           "building train's DeepSpeed engine), compute (the time no other phase took), write (writing the shards), checkpoint, "
           "export, replay, state (train's in-round checkpoints, exported policy, replayed steps, optimizer state).", "the phases the stage went through"),
    Metric("every", "phase_<phase>_bytes", "Bytes of data files the stage wrote to the run folder in the phase.", "as the seconds"),
    Metric("every", "wait_input_seconds", "Seconds the stage's workers waited for what it reads to be committed, summed over them: "
           "before a round (workers that stay) and for input units (a stage streaming behind another).", "where a worker waited"),
    Metric("every", "wait_held_seconds", "Seconds the actor's workers, their reads there, waited for the learner to take their work: "
           "rollout at its bound of run.max_staleness rounds ahead of train (backpressure).", "where a worker waited"),
    # rollout
    Metric("rollout", "policy_version", "The policy that sampled: k is the student after k trained rounds (the round's index, "
           "or max(round - run.max_staleness, 0))."),
    Metric("rollout", "staleness", "Rounds the sampling policy is behind the round (0 on-policy; run.max_staleness once the run is that far)."),
    Metric("rollout", "responses", "Responses sampled for training (held-out ones are not counted)."),
    Metric("rollout", "tokens", "Response tokens sampled for training (tool turns and teacher prefixes included)."),
    Metric("rollout", "reward_mean", "Mean of the run's reward over the training responses; null where the prompts have no answers."),
    Metric("rollout", "seconds", "Seconds of work of the stage's units, summed (the held-out unit included)."),
    Metric("rollout", "tokens_per_s", "tokens / the seconds of the units that sampled them."),
    Metric("rollout", "tool_mask/llm_tokens", "Tokens the student wrote, per response (verl's name)."),
    Metric("rollout", "tool_mask/tool_tokens", "Tokens of tool turns (and the template around them), per response."),
    Metric("rollout", "tool_mask/tool_ratio", "The tool turns' share of all response tokens."),
    Metric("rollout", "num_turns/mean", "Student turns per response (1 without tools)."),
    Metric("rollout", "num_turns/min", "The fewest student turns of any response."),
    Metric("rollout", "num_turns/max", "The most student turns of any response."),
    Metric("rollout", "tool_calls/per_response", "Tool calls per response."),
    Metric("rollout", "tool_calls/errors", "Tool calls that failed (unreadable call, unknown tool, the tool raised)."),
    Metric("rollout", "engine_dtype_bits", "Bits of the rollout engine's precision (the least precise worker's): 32, 16."),
    Metric("rollout", "engine_probe_gap_max", "Largest |log-prob| gap between the engine and train's forward on the probe batch "
           "(gndpo.stages.models.probe): does the engine sample from the weights train exported.", "the policy has a probe (rounds after the first)"),
    Metric("rollout", "engine_probe_gap_mean", "Mean of that gap.", "as engine_probe_gap_max"),
    Metric("rollout", "engine_reloaded", "1 where the new policy was loaded into a kept engine instead of a fresh one.", "as engine_probe_gap_max"),
    Metric("rollout", "engine_restarted", "1 where a kept engine failed the probe and a fresh one replaced it.", "as engine_probe_gap_max"),
    Metric("rollout", "engine_adapters", "1 where the engine served the round's LoRA adapters (model.lora.serve adapters).",
           "a LoRA student served as adapters, with a probe"),
    Metric("rollout", "heldout_accuracy", "Greedy accuracy on the held-out prompts (data.heldout, or those held out of data.train) of the policy "
           "that sampled (the run's reward).",
           "rollout.eval_heldout and held-out prompts with answers"),
    # score
    Metric("score", "tokens", "Response tokens scored."),
    Metric("score", "seconds", "Seconds of work of the scoring units, summed."),
    Metric("score", "tokens_per_s", "tokens / seconds."),
    Metric("score", "student_logprobs_from_engine", "1 where the student's log-probs are the rollout engine's (score.student_logprobs), "
           "0 where score recomputed them."),
    Metric("score", "student_entropy_mean", "The student's mean entropy (nats) over the tokens it sampled (verl's actor/entropy).",
           "the student's forward ran and logging.entropy_metrics (or the method needs it)"),
    Metric("score", "teacher_entropy_mean", "The teacher's mean entropy (nats) over the same tokens.", "logging.entropy_metrics (or the method needs it)"),
    Metric("score", "rollout_logprob_diff_max", "Largest |student log-prob recomputed by score - the sampler's|: engine and trainer "
           "disagreeing on the same policy (verl's training/rollout_probs_diff_max).", "rollout.temperature 1 and recomputed student log-probs"),
    Metric("score", "rollout_logprob_diff_mean", "Mean of that difference over the sampled tokens.", "as rollout_logprob_diff_max"),
    Metric("score", "cross_tokenizer/unaligned_tokens", "Student tokens the teacher's tokens did not cover exactly (no signal there).",
           "score.cross_tokenizer"),
    Metric("score", "cross_tokenizer/unaligned_fraction", "Their share of the response tokens.", "score.cross_tokenizer"),
    Metric("score", "cross_tokenizer/split_span_fraction", "Share of tokens whose teacher value is a share of a span of several student tokens.",
           "score.cross_tokenizer"),
    Metric("score", "server_retries", "Requests to the teacher's servers sent again after a failure (a connection, a timeout, a 5xx "
           "or 429), summed over the round's units.", "score.backend server"),
    Metric("score", "server_cooldowns", "Times a teacher server was taken out of the pool for a cooldown after a failure.", "score.backend server"),
    Metric("score", "heldout_reverse_kl", "Label-free held-out figure: the reverse-KL estimate mean(lpS - lpT) on one sampled response "
           "per held-out prompt.", "rollout.eval_heldout, held-out prompts without answers, and a teacher that reads them as the student does (no teacher "
           "context, routing or pictures; the same tokenizer)"),
    Metric("score", "heldout_teacher_logprob", "The teacher's mean log-prob of the greedy held-out responses' tokens.", "as heldout_reverse_kl"),
    # normalize
    Metric("normalize", "token_count", "Valid tokens of the round (loss mask 1; truncated responses left out under rollout.truncated drop)."),
    Metric("normalize", "c_mean", "Mean of the clamped score c_t = clamp(lpT - lpS, -method.clamp, method.clamp) over the valid tokens."),
    Metric("normalize", "c_var", "Its unbiased variance (GNDPO's normalization uses c_mean and c_var)."),
    Metric("normalize", "c_std", "Its standard deviation."),
    Metric("normalize", "c_min", "Smallest c_t."),
    Metric("normalize", "c_max", "Largest c_t."),
    Metric("normalize", "responses", "Responses in the statistics."),
    Metric("normalize", "reverse_kl_estimate", "-c_mean: the round's KL(student || teacher) estimate (k1, clamped)."),
    Metric("normalize", "reward_mean", "Mean reward over every response (dropped ones included); null without answers."),
    Metric("normalize", "response_length_mean", "Mean response length in tokens."),
    Metric("normalize", "response_length_max", "Longest response in tokens."),
    Metric("normalize", "truncated_fraction", "Share of responses cut at rollout.max_tokens."),
    Metric("normalize", "seconds", "Seconds the statistics took."),
    Metric("normalize", "tokens_per_s", "token_count / seconds."),
    Metric("normalize", "minillm_mean", "Mean of MiniLLM's discounted per-token returns (whitening).", "method minillm"),
    Metric("normalize", "minillm_var", "Their unbiased variance.", "method minillm"),
    Metric("normalize", "gdpo_mean", "Mean of GDPO's pre-advantage A_pre over responses (or tokens).", "method gdpo"),
    Metric("normalize", "gdpo_std", "Its standard deviation over responses.", "method gdpo, method.outcome.gdpo_batch_norm sequence"),
    Metric("normalize", "gdpo_var", "Its variance over tokens.", "method gdpo, method.outcome.gdpo_batch_norm token"),
    Metric("normalize", "tip_h_cap", "TIP: the student-entropy cap (method.tip.entropy_quantile of the batch).", "method.tip.enabled"),
    Metric("normalize", "tip_h_min", "TIP: smallest capped student entropy (min-max scaling).", "method.tip.enabled"),
    Metric("normalize", "tip_h_max", "TIP: largest capped student entropy.", "method.tip.enabled"),
    Metric("normalize", "tip_d_min", "TIP: smallest per-token KL.", "method.tip.enabled"),
    Metric("normalize", "tip_d_max", "TIP: largest per-token KL.", "method.tip.enabled"),
    Metric("normalize", "tropd_tau", "TrOPD's trust threshold on P = min(pi_T / pi_S, 1) (method.tropd.tau, or its batch quantile).", "method tropd"),
    Metric("normalize", "responses_weighted", "Responses B in the reward weights w_i = B softmax(r_i / method.reward_beta).", "method.reward_beta > 0"),
    Metric("normalize", "reward_logsumexp", "logsumexp of r_i / method.reward_beta over the responses.", "method.reward_beta > 0"),
    # train
    Metric("train", "policy_version", "The policy the update produced: round + 1."),
    Metric("train", "staleness", "Rounds between the policy that sampled the round's rows and the policy this update started from."),
    Metric("train", "model_dir", "Run-relative folder of the exported student (Hugging Face format)."),
    Metric("train", "ema_dir", "Run-relative folder of the exported EMA teacher.", "teacher: self with self_teacher.weights ema"),
    Metric("train", "loss_mean", "Mean loss over the optimizer steps."),
    Metric("train", "grad_norm_mean", "Mean gradient norm (before clipping) over the steps."),
    Metric("train", "grad_norm_max", "Largest gradient norm of any step."),
    Metric("train", "grad_norm_std", "Standard deviation of the steps' gradient norms."),
    Metric("train", "clip_fraction", "Share of loss tokens whose ratio the policy loss clipped (verl's actor/pg_clipfrac)."),
    Metric("train", "ratio_mean", "Mean importance ratio pi_theta / pi_old over the loss tokens."),
    Metric("train", "optimizer_steps", "Optimizer steps taken."),
    Metric("train", "adv_min", "Smallest advantage over the tokens with a policy-gradient term; null for pure divergence methods."),
    Metric("train", "adv_max", "Largest advantage."),
    Metric("train", "adv_mean", "Mean advantage."),
    Metric("train", "adv_std", "Standard deviation of the advantages."),
    Metric("train", "divergence", "The divergence of the round's divergence term (forward_kl, reverse_kl, jsd, ...)."),
    Metric("train", "tokens", "Response tokens in the update."),
    Metric("train", "seconds", "Seconds of the update (export and state included)."),
    Metric("train", "tokens_per_s", "tokens / seconds."),
)


def metric_doc(stage: str, key: str) -> Metric | None:
    """The :data:`METRICS` entry that documents ``key`` of ``stage``'s manifest, or None."""
    for m in METRICS:
        if m.stage not in (stage, "every"):
            continue
        pattern = re.escape(m.name).replace(re.escape("<phase>"), "(" + "|".join(PHASES) + ")")
        if re.fullmatch(pattern, key):
            return m
    return None


def committed_rounds(run) -> int:
    """How many rounds have at least one committed stage."""
    r = 0
    while any(run.records(r, product).manifest() is not None for product in ROUND):
        r += 1
    return r


def collect_metrics(run) -> list[dict]:
    """One row of metrics per committed stage of every round (round, stage and its manifest's metrics)."""
    rows = []
    for r in range(committed_rounds(run)):
        for stage in run.round_stages(r):
            m = run.records(r, stage).manifest()
            if m is not None:
                rows.append({"round": r, "stage": stage, **m.metrics})
    return rows


@dataclass(frozen=True)
class RoundMetrics:
    """One round's metrics, by what its stages committed: each a manifest's metrics by name ({} where
    that stage has not committed)."""

    round: int
    rollouts: dict
    scores: dict
    statistics: dict
    policy: dict  # train's: the update and the policy it exported

    @property
    def trained(self) -> bool:
        return bool(self.policy)


def round_metrics(rows: list[dict]) -> list[RoundMetrics]:
    """The rounds of :func:`collect_metrics`' rows, in order, while their rollouts are committed."""
    by = {(m["round"], m["stage"]): m for m in rows}
    out = []
    while (len(out), ROLLOUTS.stage) in by:
        r = len(out)
        out.append(RoundMetrics(r, *(by.get((r, product.stage), {}) for product in (ROLLOUTS, SCORES, STATISTICS, POLICY))))
    return out


def round_summary(run) -> str:
    """One line on the newest trained round: the held-out score of the policy it started from, what it
    sampled (reward, KL(student||teacher) estimate) and how its update went (loss, largest gradient
    norm), and the policy it produced: what `gndpo run` prints when it ends."""
    trained = [m for m in round_metrics(collect_metrics(run)) if m.trained]
    if not trained:
        return "no round trained yet"
    m = trained[-1]
    r = m.round
    figures = [("held-out", m.rollouts.get("heldout_accuracy"), ".3f"), ("held-out KL", m.scores.get("heldout_reverse_kl"), ".3f"),
               ("reward", m.statistics.get("reward_mean"), ".3f"), ("KL estimate", m.statistics.get("reverse_kl_estimate"), ".3f"),
               ("loss", m.policy.get("loss_mean"), ".4g"), ("grad-norm max", m.policy.get("grad_norm_max"), ".3g")]
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


def publish_metrics(run, manifest: Manifest, log_dir: str) -> None:
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
                log_wandb(run, {"round": manifest.round, "stage": manifest.stage, **manifest.metrics}, log_dir)
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
