"""Train: one DeepSpeed update of the student from the round's rollouts, scores and statistics.

Reads top to bottom as the round's recipe:

1. this rank's share of the round, joined with its scores and the method's targets
   (:mod:`gndpo.stages.training.batch`): the policy-gradient advantage and its tokens, the weight of a
   divergence term on the teacher's top-k per token, the loss mask and a response weight. The token
   loss is L_t = pg_mask L_pg(A_t) + div_t D_t, times the response weight;
2. a DeepSpeed engine on the round's policy (:mod:`gndpo.stages.training.deepspeed_engine`: dtype, ZeRO stage,
   checkpoints), continuing the previous round's optimizer state, or an earlier attempt's checkpoint;
3. ``train.optimizer_steps`` mini-batches (one step per rollout batch by default, so pi_theta = pi_old
   at loss time), each cut into token-budgeted micro-batches; every micro-batch contributes its share of
   the step loss, normalised by the step's GLOBAL sequence or token count, so the step is the same for
   any number of ranks and micro-batches. Log-probs come chunked from :mod:`gndpo.stages.models.logprobs`;
4. export the updated student in Hugging Face format; it rolls out the next round.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile

import numpy as np
import torch

from gndpo.faults import crash_point
from gndpo.pipeline.methods.losses import aggregate, combined_token_losses
from gndpo.pipeline.methods import divergence_of, policy_settings, score_needs
from gndpo.pipeline.methods.base import TOPK
from gndpo.pipeline.config.schema import SELF_TEACHER
from gndpo.pipeline.run.run import Run
from gndpo.stages.models.device import local_device, set_cpu_threads
from gndpo.stages.models.logprobs import logits_chunk, make_batch, policy_token_logprobs, token_budget_batches
from gndpo.stages.models.loading import load_tokenizer
from gndpo.stages.training.ema import EMA_FILE, EmaWeights
from gndpo.stages.models.probe import probe_logprobs, write_probe
from gndpo.stages.training.batch import TrainRow, load_share
from gndpo.stages.models.live import LiveModels
from gndpo.stages.training.deepspeed_engine import export_model, isolate_extension_builds, load_state, save_state
from gndpo.storage.shards import verified_bytes
from gndpo.pipeline.observe import progress
from gndpo.pipeline.observe.logs import adopt_library_loggers, info


def ensure_distributed_env() -> None:
    """Let a plain ``gndpo train`` run as a one-process DeepSpeed job without a launcher."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def all_reduce(values: np.ndarray, op: str = "sum") -> np.ndarray:
    """Element-wise sum / max / min of ``values`` over ranks (identity on one rank)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.as_tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return t.numpy()


def start_forward(engine) -> None:
    """The bookkeeping ``DeepSpeedEngine.forward`` does before a forward. Train calls the backbone and
    the output layer itself (chunked), so it must do it: without it ZeRO optimizers count no micro-step
    and each micro-batch's gradients replace the previous ones instead of accumulating (ZeRO-3)."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    if isinstance(engine.optimizer, ZeROOptimizer):
        engine.optimizer.clear_backward_seen_flag()


def padded(rows: list[TrainRow], key: str, width: int, device, dtype=torch.float32) -> torch.Tensor:
    """Per-token fields of ``rows`` as a right-padded [B, width(, k)] tensor on ``device``."""
    first = getattr(rows[0], key)
    out = np.zeros((len(rows), width, *first.shape[1:]), dtype=np.float64 if dtype.is_floating_point else np.int64)
    for i, r in enumerate(rows):
        values = getattr(r, key)
        out[i, : len(values)] = values
    return torch.from_numpy(out).to(device=device, dtype=dtype)


class TrainJob:
    stage = "train"

    def __init__(self, run: Run, round_idx: int, log=info, live: LiveModels | None = None):
        self.run, self.round, self.cfg, self.log = run, round_idx, run.cfg, log
        self.live = live or LiveModels()

    def plan(self):
        normalize = self.run.records(self.round, "normalize").require_manifest()
        return [{"unit": "update"}], {"normalize_manifest_finished_at": normalize["finished_at"], "method": self.cfg.method.name}

    def setup(self):
        import deepspeed

        set_cpu_threads()
        isolate_extension_builds()
        ensure_distributed_env()
        adopt_library_loggers()  # DeepSpeed installs its own stdout handler when imported
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")

    def run_unit(self, unit, out_dir):
        cfg, tc = self.cfg, self.cfg.train
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.device, self.world = local_device(), world
        share = load_share(self.run, self.round, rank, world)
        self.policy_loss, self.loss_agg = policy_settings(cfg.method)
        # A div term is computed only where the method stored the teacher top-k for one.
        self.divergence = divergence_of(cfg.method, self.round) if TOPK in score_needs(cfg.method) else None
        policy = self.run.policy_path(self.round)
        self.live.release_engine()
        self.live.release_modules()
        engine, continued = self.live.train_engine(cfg, policy, self.run.policy_dir(self.round), world)
        # Positions per output-layer chunk (model.logits_budget_mib over the vocabulary); every rank
        # plans its chunk counts with it, so the model must exist first.
        self.chunk = logits_chunk(engine.module, cfg.model)
        steps = self.plan_steps(share)
        torch.manual_seed(cfg.train.seed)
        self.pad_id = load_tokenizer(policy).pad_token_id or 0
        # A retried attempt continues from the newest checkpoint of an earlier attempt, so optimizer
        # steps already taken are not repeated (the mini-batch order is seeded by round, not attempt).
        # With an EMA self-teacher, the average the previous round exported (the initial student in
        # round 0), continued from a checkpoint below when the update resumes.
        self.ema = self._start_ema(engine.module)
        history = self._resume(engine, rank)
        resumed = bool(history) or continued or self._continue_optimizer(engine)
        with progress.task(f"train r{self.round}", total=len(steps), unit="steps") as bar:
            bar.advance(len(history))
            for i in range(len(history), len(steps)):
                history.append(self.optimizer_step(engine, **steps[i]))
                if self.ema is not None:
                    self.ema.update(engine.module)
                step = history[-1]
                logging.getLogger(__name__).debug("train r%d step %d/%d: loss %+.5f grad_norm %.4f", self.round, i + 1, len(steps), step["loss"], step["grad_norm"])
                bar.advance(1, tokens=steps[i]["n_tokens"])
                bar.show(loss=step["loss"], grad_norm=step["grad_norm"], clip_fraction=step["clip_fraction"])
                crash_point("train.step")
                every = tc.checkpoint_every
                if every and (i + 1) % every == 0 and i + 1 < len(steps):
                    self._save_checkpoint(engine, out_dir, history, rank)

        summary = {
            "steps": history,
            "responses": int(sum(share.step_sizes)),
            "tokens": int(sum(s["n_tokens"] for s in steps)),
            **self._advantage_range(share),
            "divergence": self.divergence,
            "model_dir": f"{out_dir}/model",
            "optimizer_state_resumed": resumed,
            "resumed_after_step": self._resumed_after,
        }
        files = []
        with tempfile.TemporaryDirectory() as tmp:
            export_model(engine, policy, tmp, tc.zero_stage, rank)
            # What the next round's rollout engine must reproduce (gndpo.stages.models.probe); every rank
            # runs the forward, as ZeRO-3 gathers weights collectively.
            probe = self._probe(engine, policy)
            if rank == 0:
                write_probe(tmp, probe)
                files = self.run.fs.upload_dir(tmp, f"{out_dir}/model")
        if self.ema is not None and rank == 0:  # the next round's EMA teacher
            with tempfile.TemporaryDirectory() as tmp:
                self.ema.export(engine.module, tmp)
                load_tokenizer(policy).save_pretrained(tmp)
                files += self.run.fs.upload_dir(tmp, f"{out_dir}/ema")
            summary["ema_dir"] = f"{out_dir}/ema"
        if tc.carry_optimizer_state:
            records = save_state(engine, self.run.fs, f"{out_dir}/optimizer", rank, world)
            if rank == 0:
                files += records
                summary["optimizer_state"] = {"world": world, "files": records}
            # Without the carry the next round starts a fresh optimizer, so the engine is not kept.
            self.live.trained(engine, cfg, world, summary["model_dir"])
        return files, summary

    def _start_ema(self, module) -> EmaWeights | None:
        if not (self.cfg.teacher == SELF_TEACHER and self.cfg.self_teacher.weights == "ema"):
            return None
        return EmaWeights.start(module, self.run.teacher_models(self.round)["self/ema"], self.cfg.self_teacher.ema_decay)

    def _probe(self, engine, policy: str) -> dict:
        model = engine.module
        was_training = model.training
        model.eval()
        try:
            return probe_logprobs(model, min(len(load_tokenizer(policy)), model.config.vocab_size), self.pad_id)
        finally:
            model.train(was_training)

    def plan_steps(self, share) -> list[dict]:
        """Per optimizer step: this rank's token-budgeted micro-batches and the numbers every rank must
        agree on: the step's global response count, loss-token count and response-weight sum (the loss
        normalisers), and how many micro-batches and output chunks to run, the maximum over ranks.
        Equal counts keep collective calls aligned (gradient all-reduce, and ZeRO-3's per-call parameter
        gathers)."""
        tc, chunk = self.cfg.train, self.chunk
        micros = [
            [[rows[i] for i in idx] for idx in token_budget_batches(np.array([r.tokens for r in rows]), tc.max_tokens_per_batch, tc.micro_batch_size)]
            for rows in share.steps
        ]
        n_tokens = all_reduce(np.array([sum(float(r.mask.sum()) for r in rows) for rows in share.steps]))
        weight_sum = all_reduce(np.array([sum(r.weight for r in rows) for rows in share.steps], dtype=np.float64))
        n_micro = all_reduce(np.array([max(len(m), 1) for m in micros]), "max").astype(int)
        chunks = np.zeros((len(micros), int(n_micro.max(initial=1))))
        for i, step in enumerate(micros):
            for j, micro in enumerate(step):
                chunks[i, j] = -(-sum(len(r.response) for r in micro) // chunk)
        chunks = all_reduce(chunks, "max").astype(int)
        return [
            {"micros": micros[i], "n_micro": int(n_micro[i]), "chunks": chunks[i].tolist(),
             "n_seqs": share.step_sizes[i], "n_tokens": int(n_tokens[i]), "weight_sum": float(weight_sum[i])}
            for i in range(len(micros))
        ]

    def optimizer_step(self, engine, micros: list[list[TrainRow]], n_micro: int, chunks: list[int], n_seqs: int, n_tokens: int, weight_sum: float) -> dict:
        """One optimizer step: this rank's micro-batches each add their share of the step loss."""
        tc = self.cfg.train
        step_loss, clipped, ratio_sum, grad_norm = 0.0, 0.0, 0.0, None
        for j in range(n_micro):
            boundary = j == n_micro - 1
            engine.set_gradient_accumulation_boundary(boundary)
            micro = micros[j] if j < len(micros) else []
            start_forward(engine)
            loss, stats = self.micro_batch_loss(engine.module, micro, chunks[j], n_seqs, n_tokens, weight_sum)
            # DeepSpeed averages gradients over ranks; the shares already sum to the step loss.
            engine.backward(loss * self.world, scale_wrt_gas=False)
            if boundary and tc.zero_stage == 0 and "bf16" not in engine.config and "fp16" not in engine.config:
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
            "clip_fraction": clipped / max(n_tokens, 1),
            "ratio_mean": ratio_sum / max(n_tokens, 1),
        }

    def micro_batch_loss(self, model, micro: list[TrainRow], min_chunks: int, n_seqs: int, n_tokens: int, weight_sum: float):
        """(this micro-batch's share of the step loss, [loss, clipped tokens, sum of ratios]).

        A rank with fewer micro-batches than another runs an empty one: a forward on one pad token times
        zero, so every rank calls every module (and ZeRO-3 gathers) the same number of times."""
        cfg, device = self.cfg, self.device
        if not micro:
            batch = make_batch([[self.pad_id]], [[self.pad_id]], self.pad_id, device)
            logp, _, pad_term = policy_token_logprobs(model, batch, logits_chunk(model, cfg.model), cfg.rollout.temperature, None, min_chunks)
            return logp.sum() * 0.0 + pad_term, (0.0, 0.0, 0.0)
        batch = make_batch([r.prompt for r in micro], [r.response for r in micro], self.pad_id, device)
        topk_ids = None
        if self.divergence is not None:
            topk_ids = torch.from_numpy(np.concatenate([r.topk_ids for r in micro])).to(device)
        flat_logp, flat_topk, pad_term = policy_token_logprobs(
            model, batch, logits_chunk(model, cfg.model), cfg.rollout.temperature, topk_ids, min_chunks
        )
        logp = batch.padded(flat_logp)
        width = logp.shape[1]
        resp_mask = batch.mask()
        mask = resp_mask * padded(micro, "mask", width, device)
        pg_mask = resp_mask * padded(micro, "pg_mask", width, device)
        old = padded(micro, "old_logp", width, device)
        student_topk = teacher_topk = teacher_rest = None
        if self.divergence is not None:
            # Padding positions get a uniform (k+1)-bucket distribution for both models, so every
            # divergence form is finite there (then masked out): a NaN times 0 would still be NaN.
            k = flat_topk.shape[-1]
            fill = -float(np.log(k + 1))
            student_topk = batch.padded(flat_topk, fill)
            teacher_topk = padded(micro, "topk_logp", width, device)
            teacher_topk[resp_mask == 0] = fill
            if all(r.topk_rest is not None for r in micro):  # else (older shards) the loss recomputes it
                teacher_rest = padded(micro, "topk_rest", width, device)
                teacher_rest[resp_mask == 0] = fill
        losses, was_clipped = combined_token_losses(
            self.policy_loss, self.divergence, logp, old, padded(micro, "adv", width, device), pg_mask,
            padded(micro, "div", width, device), student_topk, teacher_topk,
            cfg.method.clip_low, cfg.method.clip_high, cfg.method.jsd_beta, topk_form=cfg.method.topk_form,
            teacher_rest_logp=teacher_rest, pointwise_clip=cfg.method.pointwise_clip,
        )
        weights = torch.tensor([r.weight for r in micro], dtype=torch.float32, device=device).unsqueeze(-1)
        loss = aggregate(losses * weights, mask, self.loss_agg, n_seqs, n_tokens, weight_sum)
        ratio = float((torch.exp(logp.detach() - old) * mask).sum())
        return loss + pad_term, (loss.item(), float(was_clipped.sum()), ratio)

    def _advantage_range(self, share) -> dict:
        """Advantage min/max/mean/std over the tokens with a policy-gradient term, over all ranks (None
        for pure divergence methods)."""
        advs = np.concatenate([r.adv[r.pg_mask > 0] for rows in share.steps for r in rows] + [np.zeros(0)]).astype(np.float64)
        total, squares, count = all_reduce(np.array([advs.sum(), (advs**2).sum(), advs.size]))
        lo = all_reduce(np.array([advs.min() if advs.size else np.inf]), "min")[0]
        hi = all_reduce(np.array([advs.max() if advs.size else -np.inf]), "max")[0]
        if not count:
            return {"adv_min": None, "adv_max": None, "adv_mean": None, "adv_std": None}
        mean = total / count
        return {"adv_min": float(lo), "adv_max": float(hi), "adv_mean": float(mean), "adv_std": float(np.sqrt(max(squares / count - mean**2, 0.0)))}

    # -- optimizer state within and across rounds ---------------------------------------------------
    def _save_checkpoint(self, engine, out_dir: str, history: list[dict], rank: int) -> None:
        """Full engine state after ``len(history)`` steps (collective); rank 0's JSON record, written
        last and exclusively, is what makes the checkpoint visible to a later attempt."""
        step = len(history)
        base = f"{out_dir}/ckpt/step-{step:05d}"
        files = save_state(engine, self.run.fs, base, rank, self.world)
        if rank == 0:
            record = {"step": step, "history": history, "world": self.world, "files": files}
            if self.ema is not None:
                record["ema"] = self.run.fs.write_new(f"{base}/{EMA_FILE}", self.ema.to_bytes())
            self.run.fs.create_json(f"{base}.json", record)

    def _resume(self, engine, rank: int) -> list[dict]:
        """Load the newest checkpoint an earlier attempt of this round left; returns its step history.
        Rank 0 chooses it and tells the others, so every rank loads the same one."""
        import torch.distributed as dist

        best = [None]
        if rank == 0:
            records = self.run.records(self.round, self.stage)
            for attempt in records.attempts("update"):
                ckpt = f"{records.attempt_dir('update', attempt)}/ckpt"
                for name in self.run.fs.listdir(ckpt):
                    if name.endswith(".json"):
                        meta = self.run.fs.read_json(f"{ckpt}/{name}")
                        if best[0] is None or meta["step"] > best[0]["step"]:
                            best[0] = meta
        if self.world > 1:
            dist.broadcast_object_list(best, src=0)
        self._resumed_after = 0
        if best[0] is None or not load_state(engine, self.run.fs, best[0], self.world):
            return []
        if self.ema is not None:
            self.ema.load_bytes(verified_bytes(self.run.fs, best[0]["ema"]))
        self._resumed_after = best[0]["step"]
        self.log(f"train r{self.round}: resuming after step {best[0]['step']} from a checkpoint")
        return list(best[0]["history"])

    def _continue_optimizer(self, engine) -> bool:
        """Continue AdamW's moments (and, in bf16, the fp32 master weights) from the previous round: a
        fresh Adam's first steps are sign-like (size lr in every coordinate), which on a small policy
        undoes much of a round."""
        if self.round == 0 or not self.cfg.train.carry_optimizer_state:
            return False
        records = self.run.records(self.round - 1, "train")  # the parent's, for a forked run's first round
        state = records.require_manifest()["units"][0].get("optimizer_state")
        if not state or "files" not in state:
            return False
        if not load_state(engine, records.run, state, self.world):
            self.log(f"train r{self.round}: optimizer state of round {self.round - 1} was written by {state['world']} ranks; starting a fresh one")
            return False
        return True

    def summarize(self, commits):
        c = commits[0]
        steps = c["steps"]
        norms = np.array([s["grad_norm"] for s in steps])
        return {
            "policy_version": self.round + 1,
            "model_dir": c["model_dir"],
            **({"ema_dir": c["ema_dir"]} if c.get("ema_dir") else {}),
            "loss_mean": float(np.mean([s["loss"] for s in steps])),
            "grad_norm_mean": float(norms.mean()),
            "grad_norm_max": float(norms.max()),
            "grad_norm_std": float(norms.std()),
            # Fraction of loss tokens whose ratio the policy loss clipped (verl's actor/pg_clipfrac).
            "clip_fraction": float(np.mean([s["clip_fraction"] for s in steps])),
            "ratio_mean": float(np.mean([s["ratio_mean"] for s in steps])),
            "optimizer_steps": len(steps),
            "adv_min": c["adv_min"],
            "adv_max": c["adv_max"],
            "adv_mean": c.get("adv_mean"),
            "adv_std": c.get("adv_std"),
            "divergence": c.get("divergence"),
            "tokens": c.get("tokens"),
            "seconds": c["seconds"],
            "tokens_per_s": c.get("tokens", 0) / max(c["seconds"], 1e-9),
        }
