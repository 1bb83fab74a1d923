"""Train: one DeepSpeed update of the student from the round's rollouts, scores and statistics.

:meth:`TrainJob.run_unit` is the round's recipe, set up first and then run (torchtune's setup / train):

1. :meth:`TrainJob.prepare_update` builds the round's :class:`Update`: this rank's share of the round,
   joined with its scores and the method's targets (:mod:`gndpo.stages.training.batch`: the
   policy-gradient advantage and its tokens, the weight of a divergence term on the teacher's top-k per
   token, the loss mask and a response weight); a DeepSpeed engine on the round's policy
   (:mod:`gndpo.stages.training.deepspeed_engine`); the schedule of ``train.optimizer_steps``
   mini-batches (one step per rollout batch by default, so pi_theta = pi_old at loss time), each cut
   into token-budgeted micro-batches; and where the update starts
   (:mod:`gndpo.stages.training.checkpoint`): after an earlier attempt's checkpoint, continuing the
   previous round's optimizer state, or fresh;
2. :meth:`TrainJob.train` takes the steps. The token loss is L_t = pg_mask L_pg(A_t) + div_t D_t, times
   the response weight (:class:`gndpo.stages.training.objective.Objective`); every micro-batch contributes its share of the step loss,
   normalised by the step's GLOBAL sequence or token count, so the step is the same for any number of
   ranks and micro-batches. Log-probs come chunked from :mod:`gndpo.stages.models.logprobs`;
3. :meth:`TrainJob.finish` exports the updated student in Hugging Face format
   (:mod:`gndpo.stages.training.export`), which rolls out the next round, and carries the optimizer
   state over to it.
"""

from __future__ import annotations

import filecmp
import logging
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gndpo.dist import Dist
from gndpo.faults import crash_point
from gndpo.pipeline.exec.inputs import Read, StageInputs
from gndpo.pipeline.exec.stage import Launch, StageContext, StageJob
from gndpo.pipeline.methods import score_needs
from gndpo.pipeline.methods.base import TOPK
from gndpo.pipeline.observe import progress
from gndpo.pipeline.observe.logs import adopt_library_loggers
from gndpo.pipeline.run.products import POLICY, ROLLOUTS, SCORES, STATISTICS, CarriedState, TrainNumbers
from gndpo.pipeline.run.run import Run
from gndpo.pipeline.settings.schema import SELF_TEACHER
from gndpo.stages.models.batches import token_budget_batches
from gndpo.stages.models.device import local_device, set_cpu_threads
from gndpo.stages.models.fused_output import OutputLayer
from gndpo.stages.models.live import LiveModels
from gndpo.stages.models.loading import load_tokenizer
from gndpo.stages.models.logprobs import logits_chunk
from gndpo.stages.models.vision import BatchImages
from gndpo.stages.text.vocabulary import match_vocabularies
from gndpo.stages.training.batch import RoundShare, TrainRow, load_share
from gndpo.stages.training.checkpoint import (
    UNIT,
    DeferredState,
    ResumePoint,
    Start,
    carry_state,
    load_state,
    resume_point,
    save_checkpoint,
    start_at,
)
from gndpo.stages.training.deepspeed_engine import build_engine, init_distributed, isolate_extension_builds, quiet_deepspeed_import
from gndpo.stages.training.ema import EmaWeights
from gndpo.stages.training.export import export_ema, export_student, save_hf_folder
from gndpo.stages.training.objective import Objective
from gndpo.storage.meter import phase
from gndpo.storage.products import Commit, FileRecord, Manifest, Unit


def all_reduce(values: np.ndarray, op: str = "sum") -> np.ndarray:
    """Element-wise sum / max / min of ``values`` over ranks (identity on one rank), on this rank's
    device: NCCL, the group's backend on GPUs, reduces CUDA tensors only."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.as_tensor(values, dtype=torch.float64, device=local_device())
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return t.cpu().numpy()


def start_forward(engine) -> None:
    """The bookkeeping ``DeepSpeedEngine.forward`` does before a forward. Train calls the backbone and
    the output layer itself (chunked), so it must do it: without it ZeRO optimizers count no micro-step
    and each micro-batch's gradients replace the previous ones instead of accumulating (ZeRO-3)."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    if isinstance(engine.optimizer, ZeROOptimizer):
        engine.optimizer.clear_backward_seen_flag()


# -- the schedule of optimizer steps ------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One optimizer step as this rank takes it: its token-budgeted micro-batches (positions in the
    step's rows, read when the step comes), and the numbers every rank must agree on: the step's
    global response count, loss-token count and response-weight sum (the loss normalisers), and how
    many micro-batches and output chunks to run, the maximum over ranks. Equal counts keep collective
    calls aligned (gradient all-reduce, and ZeRO-3's per-call parameter gathers)."""

    micros: list[list[int]]
    n_micro: int
    chunks: list[int]  # output-layer chunks per micro-batch
    n_seqs: int
    n_tokens: int
    weight_sum: float


def schedule_steps(share: RoundShare, train_cfg, chunk: int) -> list[Step]:
    """The round's optimizer steps from this rank's share (``train_cfg``: the train settings; ``chunk``:
    positions per output-layer chunk), made from the share's light index alone; collective, every
    rank calls it."""
    micros = [
        [list(idx) for idx in token_budget_batches(step.tokens, train_cfg.max_tokens_per_batch, train_cfg.micro_batch_size, step.prompt_ids)]
        for step in share.index
    ]
    n_tokens = all_reduce(np.array([step.loss_tokens for step in share.index]))
    weight_sum = all_reduce(np.array([step.weight_sum for step in share.index], dtype=np.float64))
    n_micro = all_reduce(np.array([max(len(m), 1) for m in micros]), "max").astype(int)
    chunks = np.zeros((len(micros), int(n_micro.max(initial=1))))
    for i, step in enumerate(micros):
        for j, micro in enumerate(step):
            chunks[i, j] = -(-int(share.index[i].response_tokens[micro].sum()) // chunk)
    chunks = all_reduce(chunks, "max").astype(int)
    return [
        Step(micros=micros[i], n_micro=int(n_micro[i]), chunks=chunks[i].tolist(),
             n_seqs=share.step_sizes[i], n_tokens=int(n_tokens[i]), weight_sum=float(weight_sum[i]))
        for i in range(len(micros))
    ]


def optimizer_step(engine, objective: Objective, step: Step, rows: list[TrainRow], world: int, zero_stage: int) -> dict:
    """One optimizer step: this rank's micro-batches of the step's ``rows`` each add their share of
    the step loss."""
    step_loss, clipped, ratio_sum, grad_norm = 0.0, 0.0, 0.0, None
    for j in range(step.n_micro):
        boundary = j == step.n_micro - 1
        engine.set_gradient_accumulation_boundary(boundary)
        micro = [rows[k] for k in step.micros[j]] if j < len(step.micros) else []
        start_forward(engine)
        loss, stats = objective.micro_batch_loss(engine.module, micro, step.chunks[j], step.n_seqs, step.n_tokens, step.weight_sum)
        # DeepSpeed averages gradients over ranks; the shares already sum to the step loss.
        engine.backward(loss * world, scale_wrt_gas=False)
        if boundary and zero_stage == 0 and "bf16" not in engine.config and "fp16" not in engine.config:
            # DeepSpeed's fp32 ZeRO-0 path clips without keeping the norm; grads are already
            # all-reduced here (accumulation boundary), so this is the global pre-clip norm.
            norms = [torch.linalg.vector_norm(p.grad) for p in engine.module.parameters() if p.grad is not None]
            grad_norm = float(torch.linalg.vector_norm(torch.stack(norms)))
        engine.step()
        step_loss += stats[0]
        clipped += stats[1]
        ratio_sum += stats[2]
    if grad_norm is None:
        grad_norm = engine.get_global_grad_norm()
    step_loss, clipped, ratio_sum = all_reduce(np.array([step_loss, clipped, ratio_sum])).tolist()
    return {
        "loss": step_loss,
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "clip_fraction": clipped / max(step.n_tokens, 1),
        "ratio_mean": ratio_sum / max(step.n_tokens, 1),
    }


def round_lr(train_cfg, round_idx: int, step: int, n_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``n_steps`` in round ``round_idx``. The
    round's peak is ``train_cfg.lr * train_cfg.lr_round_decay ** round_idx``; with ``train_cfg.lr_schedule`` cosine the round
    falls by half a cosine from its peak at the first step to ``peak * train_cfg.lr_min_ratio`` at the last. A
    function of the round and the step alone, so a resumed round continues on the same schedule."""
    peak = train_cfg.lr * train_cfg.lr_round_decay**round_idx
    if train_cfg.lr_schedule == "constant" or n_steps < 2:
        return peak
    floor = peak * train_cfg.lr_min_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * step / (n_steps - 1)))


def take_step(engine, objective: Objective, share: RoundShare, steps: list[Step], i: int, train_cfg, round_idx: int, world: int) -> dict:
    """Optimizer step ``i`` of round ``round_idx`` (its rows read from ``share``) at its scheduled
    learning rate; its numbers."""
    lr = round_lr(train_cfg, round_idx, i, len(steps))
    set_learning_rate(engine, lr)
    return {**optimizer_step(engine, objective, steps[i], share.rows(i), world, train_cfg.zero_stage), "lr": lr}


def set_learning_rate(engine, lr: float) -> None:
    """Every parameter group of the engine's optimizer steps at ``lr`` from now on (DeepSpeed's own
    schedulers set ``param_groups`` the same way; its ZeRO optimizers pass them to the wrapped one)."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


def advantage_range(share: RoundShare) -> dict:
    """Advantage min/max/mean/std over the tokens with a policy-gradient term, over all ranks (None
    for pure divergence methods); collective."""
    advs = share.advantages
    total, squares, count = all_reduce(np.array([advs.total, advs.squares, advs.count]))
    lo = all_reduce(np.array([advs.low]), "min")[0]
    hi = all_reduce(np.array([advs.high]), "max")[0]
    if not count:
        return {"adv_min": None, "adv_max": None, "adv_mean": None, "adv_std": None}
    mean = total / count
    return {"adv_min": float(lo), "adv_max": float(hi), "adv_mean": float(mean), "adv_std": float(np.sqrt(max(squares / count - mean**2, 0.0)))}


# -- the job ------------------------------------------------------------------------------------------
@dataclass
class Update:
    """What a round's update runs on, built by :meth:`TrainJob.prepare_update`; the loop only reads it."""

    policy: str  # the local folder of the round's policy
    share: RoundShare  # this rank's rows of each mini-batch
    engine: object  # the DeepSpeed engine on the policy
    steps: list[Step]  # the round's optimizer steps, in order
    objective: Objective  # the loss each micro-batch adds its share of
    ema: EmaWeights | None  # the EMA self-teacher's average, updated after every step
    start: Start  # what resume found: the steps already taken, whether optimizer state continues


class TrainJob(StageJob):
    """The train stage: one unit (or one per rank, collectively) that joins the round's rollouts,
    scores and statistics, takes the round's optimizer steps with DeepSpeed (checkpointed within the
    round for resume) and exports the next round's policy."""

    makes = POLICY
    # The policy it updates (round k-1's train exported it), then the round's data and statistics.
    reads = (Read(POLICY, previous_round=True), Read(ROLLOUTS), Read(SCORES), Read(STATISTICS))
    # Every rank of the process group (train.num_processes, under torchrun) computes the one unit.
    launch = Launch(collective=True)

    def __init__(self, run: Run, round_idx: int, context: StageContext | None = None):
        super().__init__(run, round_idx, context)
        self.live = self.context.live or LiveModels()
        self.dist = self.context.dist or Dist.from_env()

    @property
    def base(self) -> str:
        """The initial student: with model.lora, the weights under the adapters in every round."""
        return self.run.policy_path(0)

    def plan(self):
        """One unit, "update", after the round's committed normalize."""
        normalize = self.inputs.manifest(STATISTICS)
        return [Unit(UNIT)], {"normalize_manifest_finished_at": normalize.finished_at, "method": self.cfg.method.name}

    def setup(self):
        """Join the process group this process trains in (once per process)."""
        quiet_deepspeed_import()  # before adopt_library_loggers: importing it installs its own stdout handler
        set_cpu_threads()
        isolate_extension_builds()
        adopt_library_loggers()
        init_distributed(self.dist)

    def run_unit(self, unit, out_dir):
        """The round's optimizer steps (resumed from an in-round checkpoint), then the export of the next
        round's policy (and its optimizer state and probe)."""
        with phase("setup"):
            update = self.prepare_update()
        try:
            history = self.train(update, out_dir)
            return self.finish(update, history, out_dir)
        finally:
            update.share.close()  # its step files

    def prepare_update(self) -> Update:
        """Everything the round's update runs on, built in the order it needs: the engine, resumed
        where :func:`resume_point` says (the one place that decides) by :meth:`resume` (the one place
        that carries it out), then the round's schedule, whose output-layer chunk depends on the model."""
        cfg, dist = self.cfg, self.dist
        policy = self.run.policy_path(self.round)
        self.live.release_engine()
        self.live.release_modules()
        # By URL, not run-relative: an engine kept across runs (`gndpo compare`) must not pass for this run's.
        exported = self.inputs.policy_export()
        engine, kept = self.live.train_engine(cfg, policy, exported and self.run.fs.uri(exported.model_dir), dist.world, self.base,
                                              build=build_engine)
        engine, ema, start = self.resume(resume_point(self.run, self.round, dist, kept), engine, policy)
        share, steps, objective = self.round_work(self.inputs, engine, policy)
        return Update(policy, share, engine, steps, objective, ema, start)

    def resume(self, point: ResumePoint, engine, policy: str) -> tuple[object, EmaWeights | None, Start]:
        """(engine, EMA average, start) of the update from ``point``: the engine the round was given,
        or for ``replay`` the one the replay ends on (:meth:`replayed_engine`); with an EMA self-teacher
        the average the previous round exported (the initial student in round 0); and ``point``'s
        state loaded into both (:func:`start_at`). A retried attempt continues after the newest
        checkpoint of an earlier one, so optimizer steps already taken are not repeated (the mini-batch
        order is seeded by round, not attempt)."""
        if point.source == "replay":
            del engine  # freed before the replay builds its own
            engine, continues = self.replayed_engine(point, policy)
            return engine, self._start_ema(engine.module), Start([], 0, continues)
        ema = self._start_ema(engine.module)
        return engine, ema, start_at(point, engine, self.run, self.round, self.dist.world, ema, self.log)

    def round_work(self, inputs: StageInputs, engine, policy: str) -> tuple[RoundShare, list[Step], Objective]:
        """The rows for this rank of the round ``inputs`` reads, its optimizer steps and its loss, for
        ``engine`` on ``policy`` (the round's starting weights)."""
        cfg, dist, round_idx = self.cfg, self.dist, inputs.round
        share = load_share(inputs, dist.rank, dist.world)
        # Positions per output-layer chunk: model.logits_budget_mib over the vocabulary.
        steps = schedule_steps(share, cfg.train, logits_chunk(engine.module, cfg.model))
        torch.manual_seed(cfg.train.seed)
        pad_id = load_tokenizer(policy).pad_token_id or 0
        unmatched = self.student_unmatched(round_idx, policy, engine.module.get_output_embeddings().out_features)
        # The model says whether it checkpoints (train.gradient_checkpointing, or auto's choice for this GPU).
        checkpointing = bool(getattr(engine.module, "is_gradient_checkpointing", False))
        return share, steps, Objective.of(cfg, round_idx, pad_id, local_device(), BatchImages.of_run(self.run, policy), unmatched,
                                          checkpointing, OutputLayer.fits(engine.module))

    def student_unmatched(self, round_idx: int, policy: str, vocabulary: int) -> dict[str, np.ndarray] | None:
        """With a top-k divergence against teachers of another vocabulary: {teacher name: [vocabulary]
        True at the student's tokens that have no token of the same text in that teacher's vocabulary
        (the ones the divergence compares by sorted probabilities)}; None otherwise."""
        cfg = self.cfg
        if not (cfg.score.cross_tokenizer and TOPK in score_needs(cfg.method)):
            return None
        student_tok = load_tokenizer(policy)
        out = {}
        for name, path in self.run.teacher_models(round_idx).items():
            matched = match_vocabularies(student_tok, load_tokenizer(path), cfg.data, cfg.score.teacher_end_text).student_matched
            out[name] = ~np.pad(matched[:vocabulary], (0, max(0, vocabulary - len(matched))))
        return out

    def replayed_engine(self, point: ResumePoint, policy: str) -> tuple[object, bool]:
        """(the engine this round starts from, whether its optimizer state continues), rebuilt where the
        previous round did not write its state: from the newest written state (``point``; or round 0's
        start), the train stages since then run again from their committed rows, as they ran. The replay
        must end on the weights the previous round exported, byte for byte; otherwise (or where the
        state was written by another number of ranks) the round starts a fresh optimizer on ``policy``."""
        cfg, dist = self.cfg, self.dist
        base, state = point.replay_from, point.state
        start = self.run.policy_path(base + 1)
        engine, _ = self.live.train_engine(cfg, start, None, dist.world, self.base, build=build_engine)
        if state is None or load_state(engine, self.run.fs, state, dist.world):
            with phase("replay"):
                for round_idx in range(base + 1, self.round):
                    share, steps, objective = self.round_work(StageInputs(self.run, round_idx, self.reads), engine, start)
                    try:
                        for i in range(len(steps)):
                            take_step(engine, objective, share, steps, i, cfg.train, round_idx, dist.world)
                    finally:
                        share.close()
                    start = self.run.policy_path(round_idx + 1)
            if self.exports_equal(engine, start):
                self.log(f"train r{self.round}: optimizer state replayed from round {base + 1} to round {self.round - 1}")
                return engine, True
            self.log(f"train r{self.round}: the replayed rounds did not end on round {self.round - 1}'s export; starting a fresh optimizer")
        else:
            self.log(f"train r{self.round}: round {base}'s optimizer state was written by {state.world} ranks; starting a fresh optimizer")
        del engine
        return self.live.train_engine(cfg, policy, None, dist.world, self.base, build=build_engine)[0], False

    def exports_equal(self, engine, policy: str) -> bool:
        """Whether ``engine``'s weights, exported as train exports them, are byte for byte the weight
        files of ``policy`` (a committed export); collective."""
        with tempfile.TemporaryDirectory() as tmp:
            save_hf_folder(engine, policy, tmp, self.cfg.train.zero_stage, self.dist.rank)  # rank 0 writes
            weights = sorted(Path(tmp).glob("*.safetensors"))
            same = not self.dist.main or (bool(weights) and all(filecmp.cmp(f, Path(policy) / f.name, shallow=False) for f in weights))
        return bool(all_reduce(np.array([0.0 if same else 1.0]), "max")[0] == 0.0)

    def _start_ema(self, module) -> EmaWeights | None:
        if not (self.cfg.teacher == SELF_TEACHER and self.cfg.self_teacher.weights == "ema"):
            return None
        return EmaWeights.start(module, self.run.teacher_models(self.round)["self/ema"], self.cfg.self_teacher.ema_decay)

    def train(self, update: Update, out_dir: str) -> list[dict]:
        """Take the round's optimizer steps after those already taken; returns every step's numbers.
        Every ``train.checkpoint_every`` steps but the last, the engine state goes to a checkpoint."""
        every = self.cfg.train.checkpoint_every
        history = list(update.start.history)
        with progress.task(f"train r{self.round}", total=len(update.steps), unit="steps") as bar:
            bar.advance(len(history))
            for i in range(len(history), len(update.steps)):
                step = take_step(update.engine, update.objective, update.share, update.steps, i, self.cfg.train, self.round, self.dist.world)
                history.append(step)
                if update.ema is not None:
                    update.ema.update(update.engine.module)
                logging.getLogger(__name__).debug(
                    "train r%d step %d/%d: loss %+.5f grad_norm %.4f", self.round, i + 1, len(update.steps), step["loss"], step["grad_norm"]
                )
                bar.advance(1, tokens=update.steps[i].n_tokens)
                bar.show(loss=step["loss"], grad_norm=step["grad_norm"], clip_fraction=step["clip_fraction"])
                crash_point("train.step")
                if every and (i + 1) % every == 0 and i + 1 < len(update.steps):
                    with phase("checkpoint"):
                        save_checkpoint(update.engine, self.run.fs, out_dir, history, self.dist, update.ema)
        return history

    def finish(self, update: Update, history: list[dict], out_dir: str) -> tuple[list[FileRecord], TrainNumbers]:
        """(files, the update's numbers): the updated student exported (and the EMA teacher), the
        optimizer state carried to the next round."""
        train_cfg, dist = self.cfg.train, self.dist
        numbers = TrainNumbers(
            steps=history, responses=int(sum(update.share.step_sizes)), tokens=int(sum(s.n_tokens for s in update.steps)),
            **advantage_range(update.share), divergence=update.objective.divergence, model_dir=f"{out_dir}/model",
            optimizer_state_resumed=update.start.optimizer_state, resumed_after_step=update.start.after_step,
        )
        with phase("export"):
            files = export_student(update.engine, update.policy, self.run.fs, out_dir, train_cfg.zero_stage, dist, update.objective.pad_id)
            if update.ema is not None and dist.main:  # the next round's EMA teacher
                files += export_ema(update.ema, update.engine.module, update.policy, self.run.fs, out_dir)
                numbers.ema_dir = f"{out_dir}/ema"
        pending = None
        if train_cfg.carry_optimizer_state:
            # Not due: kept in memory only, and a train that starts without it replays. After the run's
            # last round nothing reads it unless the run is extended, which replays this round instead.
            due = (self.round + 1) % train_cfg.state_every == 0 and (train_cfg.final_state or not self.context.final)
            if due and train_cfg.state_async and self.live.keeps_trainer(dist.world):
                pending = DeferredState(update.engine, self.run.fs, out_dir, self.log)
                numbers.optimizer_state = CarriedState(pending=pending.record)
            elif due:
                with phase("state"):
                    state = carry_state(update.engine, self.run.fs, out_dir, dist)
                if dist.main:
                    files += state.file_records()
                    numbers.optimizer_state = state
            # Without the carry the next round starts a fresh optimizer, so the engine is not kept.
            self.live.trained(update.engine, self.cfg, dist.world, self.run.fs.uri(numbers.model_dir), pending)
        return files, numbers

    def committed(self, manifest: Manifest) -> None:
        """The round's policy is committed: the kept engine may now carry it into the next round."""
        self.live.train_committed()

    def summarize(self, commits: list[Commit[TrainNumbers]]) -> dict:
        """The manifest's metrics: the new policy version and folder, the steps' losses and gradient norms."""
        (update,) = commits
        c = update.numbers
        norms = np.array([s["grad_norm"] for s in c.steps])
        return {
            "policy_version": self.round + 1,
            # Rounds between the policy that sampled the data (its rows' policy_version) and the one updated.
            "staleness": self.round - self.run.sampling_version(self.round),
            "model_dir": c.model_dir,
            **({"ema_dir": c.ema_dir} if c.ema_dir else {}),
            "loss_mean": float(np.mean([s["loss"] for s in c.steps])),
            "grad_norm_mean": float(norms.mean()),
            "grad_norm_max": float(norms.max()),
            "grad_norm_std": float(norms.std()),
            # Fraction of loss tokens whose ratio the policy loss clipped (verl's actor/pg_clipfrac).
            "clip_fraction": float(np.mean([s["clip_fraction"] for s in c.steps])),
            "ratio_mean": float(np.mean([s["ratio_mean"] for s in c.steps])),
            "optimizer_steps": len(c.steps),
            "adv_min": c.adv_min,
            "adv_max": c.adv_max,
            "adv_mean": c.adv_mean,
            "adv_std": c.adv_std,
            "divergence": c.divergence,
            "tokens": c.tokens,
            "seconds": c.seconds,
            "tokens_per_s": c.tokens / max(c.seconds, 1e-9),
        }
