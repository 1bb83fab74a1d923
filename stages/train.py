"""Train: one DeepSpeed update of the student from the round's rollouts, scores and statistics.

Reads top to bottom as the round's recipe:

1. join rollouts and scores by rollout_id; ask the run's method (gndpo.pipeline.methods) for each
   response's targets, using the statistics normalize committed: the policy-gradient advantage and
   its tokens, the weight of a divergence term on the teacher's top-k per token, the loss mask and a
   response weight. The token loss is L_t = pg_mask L_pg(A_t) + div_t D_t, times the response weight;
2. start a DeepSpeed engine on the round's policy (ZeRO stage from the config; gloo on CPU);
3. split the responses into ``train.optimizer_steps`` mini-batches (one step per rollout batch by
   default, so pi_theta = pi_old at loss time) and each mini-batch into micro-batches; every micro-batch
   contributes its share of the step loss, normalised by the step's GLOBAL sequence or token count;
4. export the updated student in Hugging Face format; it rolls out the next round.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import random
import socket
import sys
import tempfile

import numpy as np
import torch

from gndpo.errors import GndpoError
from gndpo.faults import crash_point
from gndpo.pipeline.losses import aggregate, combined_token_losses
from gndpo.pipeline.methods import Response, divergence_of, get_method, policy_settings, response_targets, score_needs
from gndpo.pipeline.methods.base import TOPK
from gndpo.pipeline.runs import Run
from gndpo.stages.modeling import load_causal_lm, load_tokenizer, response_distributions, set_cpu_threads
from gndpo.stages.normalize import round_stats
from gndpo.stages.rollout import rollout_shards
from gndpo.storage.records import manifest_files
from gndpo.storage.shards import read_shards, verified_bytes


def isolate_extension_builds() -> None:
    """Give this Python environment its own folder for DeepSpeed's JIT-built ops.

    torch's default folder is shared by every environment of the user; DeepSpeed rebuilds an op when
    its sources' path differs, so two venvs running at once rebuild over each other and one of them
    loads a half-written module. An explicit TORCH_EXTENSIONS_DIR is left alone."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        tag = hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(os.path.expanduser("~/.cache/torch_extensions"), f"gndpo-{tag}")


def ensure_distributed_env() -> None:
    """Let a plain ``gndpo train`` run as a one-process DeepSpeed job without a launcher."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def load_batch(run: Run, round_idx: int) -> list[dict]:
    """One dict per response: token ids, old log-probs, the teacher's top-k where the method needs it,
    and the method's targets (advantage, policy-gradient mask, divergence weight, loss mask, weight)."""
    cfg = run.cfg
    mc = cfg.method
    method = get_method(mc.name)
    needs_topk = TOPK in score_needs(mc)
    rollouts = read_shards(run.fs, rollout_shards(run.records(round_idx, "rollout").require_manifest()))
    scores = read_shards(run.fs, manifest_files(run.records(round_idx, "score").require_manifest()))
    stats = round_stats(run, round_idx)
    score_cols = ["rollout_id", "teacher_logprobs", "student_logprobs", "teacher_entropy", "student_entropy", "token_kl"]
    if needs_topk:
        score_cols += ["teacher_topk_ids", "teacher_topk_logprobs"]
    by_id = {r["rollout_id"]: r for r in scores.select(score_cols).to_pylist()}
    batch = []
    cols = ["rollout_id", "prompt_id", "prompt_token_ids", "response_token_ids", "loss_mask", "sampler_logprobs",
            "reward", "rewards", "teacher_prefix_len"]
    for r in rollouts.select(cols).to_pylist():
        s = by_id.get(r["rollout_id"])
        if s is None:
            raise GndpoError(f"rollout {r['rollout_id']} of round {round_idx} has no score row")
        if needs_topk and s["teacher_topk_ids"] is None:
            raise GndpoError(f"score row of {r['rollout_id']} has no teacher top-k, which method {mc.name} needs")
        n = len(r["response_token_ids"])
        prefix = np.zeros(n)
        prefix[: r["teacher_prefix_len"] or 0] = 1.0
        arr = lambda v: None if v is None else np.asarray(v, dtype=np.float64)  # noqa: E731
        resp = Response(
            rollout_id=r["rollout_id"], prompt_id=r["prompt_id"], mask=arr(r["loss_mask"]),
            teacher_lp=arr(s["teacher_logprobs"]), student_lp=arr(s["student_logprobs"]),
            sampler_lp=arr(r["sampler_logprobs"]), rewards=dict(r["rewards"] or {}), reward=r["reward"], prefix=prefix,
            teacher_entropy=arr(s["teacher_entropy"]), student_entropy=arr(s["student_entropy"]), token_kl=arr(s["token_kl"]),
        )
        t = response_targets(resp, stats, mc, round_idx)
        batch.append(
            {
                "rollout_id": r["rollout_id"],
                "prompt": r["prompt_token_ids"],
                "response": r["response_token_ids"],
                "old_logp": resp.sampler_lp if method.old_logprobs == "sampler" else resp.student_lp,
                "adv": t.adv, "pg_mask": t.pg_mask, "div": t.div, "mask": t.mask, "weight": t.weight,
                "topk_ids": s.get("teacher_topk_ids"), "topk_logp": s.get("teacher_topk_logprobs"),
            }
        )
    if len(batch) != len(by_id):
        raise GndpoError(f"round {round_idx}: {len(by_id)} score rows but {len(batch)} rollouts")
    return batch


def _padded(rows: list[dict], key: str, width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r[key])] = torch.as_tensor(r[key], dtype=torch.float32)
    return out


def _padded_topk(rows: list[dict], key: str, width: int, dtype) -> torch.Tensor:
    k = max((len(r[key][0]) for r in rows if r[key]), default=1)
    out = torch.zeros((len(rows), width, k), dtype=dtype)
    for i, r in enumerate(rows):
        if r[key]:
            out[i, : len(r[key])] = torch.as_tensor(r[key], dtype=dtype)
    return out


def micro_batch_count(responses: int, world: int, micro_batch_size: int) -> int:
    """Micro-batches each rank runs for a step of ``responses`` split over ``world`` ranks."""
    return max(1, math.ceil(math.ceil(responses / world) / micro_batch_size))


def deepspeed_config(cfg, micro_batches: int, world: int) -> dict:
    tc = cfg.train
    return {
        "train_micro_batch_size_per_gpu": tc.micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": tc.micro_batch_size * micro_batches * world,
        "gradient_clipping": tc.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": tc.lr, "weight_decay": tc.weight_decay, "betas": [0.9, 0.999], "eps": 1e-8, "torch_adam": True},
        },
        "zero_optimization": {"stage": tc.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class TrainJob:
    stage = "train"

    def __init__(self, run: Run, round_idx: int, log=print):
        self.run, self.round, self.cfg, self.log = run, round_idx, run.cfg, log

    def plan(self):
        normalize = self.run.records(self.round, "normalize").require_manifest()
        return [{"unit": "update"}], {"normalize_manifest_finished_at": normalize["finished_at"], "method": self.cfg.method.name}

    def setup(self):
        import deepspeed

        set_cpu_threads()
        isolate_extension_builds()
        ensure_distributed_env()
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")

    def run_unit(self, unit, out_dir):
        import deepspeed

        cfg, tc = self.cfg, self.cfg.train
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        batch = load_batch(self.run, self.round)
        self.policy_loss, self.loss_agg = policy_settings(cfg.method)
        # A div term is computed only where the method stored the teacher top-k for one.
        self.divergence = divergence_of(cfg.method, self.round) if TOPK in score_needs(cfg.method) else None
        random.Random(f"{tc.seed}:{self.round}").shuffle(batch)
        steps = max(1, min(tc.optimizer_steps, len(batch)))
        step_size = math.ceil(len(batch) / steps)
        minibatches = [batch[i : i + step_size] for i in range(0, len(batch), step_size)]
        micro_batches = micro_batch_count(step_size, world, tc.micro_batch_size)

        policy = self.run.policy_path(self.round)
        torch.manual_seed(tc.seed)
        model = load_causal_lm(policy)
        model.config.use_cache = False
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=deepspeed_config(cfg, micro_batches, world),
        )
        resumed = self._load_optimizer_state(engine)
        pad_id = load_tokenizer(policy).pad_token_id or 0
        # A retried attempt continues from the newest checkpoint of an earlier attempt, so optimizer
        # steps already taken are not repeated (the mini-batch order is seeded by round, not attempt).
        history = self._resume(engine)
        resumed_after = len(history)
        if history:
            self.log(f"train r{self.round}: resuming after step {len(history)} from a checkpoint")
        for i in range(len(history), len(minibatches)):
            history.append(self.optimizer_step(engine, minibatches[i], pad_id, rank, world))
            self.log(f"train r{self.round} step {i + 1}/{len(minibatches)}: loss {history[-1]['loss']:+.5f} grad_norm {history[-1]['grad_norm']:.4f}")
            crash_point("train.step")
            every = tc.checkpoint_every
            if rank == 0 and self._carries_optimizer_state() and every and (i + 1) % every == 0 and i + 1 < len(minibatches):
                self._save_checkpoint(engine, out_dir, history)

        # Advantage range over the tokens with a policy-gradient term (none for pure divergence methods).
        advs = np.concatenate([r["adv"][r["pg_mask"] > 0] for r in batch] + [np.zeros(0)])
        summary = {
            "steps": history,
            "responses": len(batch),
            "tokens": int(sum(r["mask"].sum() for r in batch)),
            "adv_min": float(advs.min()) if advs.size else None,
            "adv_max": float(advs.max()) if advs.size else None,
            "adv_mean": float(advs.mean()) if advs.size else None,
            "divergence": self.divergence,
            "model_dir": f"{out_dir}/model",
            "optimizer_state_resumed": resumed,
            "resumed_after_step": resumed_after,
        }
        files = []
        if rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                engine.module.save_pretrained(tmp, safe_serialization=True)
                load_tokenizer(policy).save_pretrained(tmp)
                files = self.run.fs.upload_dir(tmp, f"{out_dir}/model")
            if self._carries_optimizer_state():
                record = self._write_optimizer_state(engine, f"{out_dir}/optimizer.pt")
                files.append(record)
                summary["optimizer_state"] = record
        return files, summary

    def optimizer_step(self, engine, minibatch: list[dict], pad_id: int, rank: int, world: int) -> dict:
        """One optimizer step on ``minibatch`` (all ranks' responses); this rank takes every world-th
        response and accumulates its micro-batches' shares of the step loss."""
        cfg, tc = self.cfg, self.cfg.train
        n_seqs = len(minibatch)
        n_tokens = int(sum(r["mask"].sum() for r in minibatch))
        mine = minibatch[rank::world]
        # Every rank runs the same number of micro-batches, so collective calls line up.
        n_micro = micro_batch_count(n_seqs, world, tc.micro_batch_size)
        micros = [mine[j * len(mine) // n_micro : (j + 1) * len(mine) // n_micro] for j in range(n_micro)]
        step_loss, clipped, ratio_sum, grad_norm = 0.0, 0.0, 0.0, None
        for j, micro in enumerate(micros):
            boundary = j == len(micros) - 1
            engine.set_gradient_accumulation_boundary(boundary)
            if not micro:  # this rank has fewer responses than micro-batches: a zero share
                engine.backward(sum(p.sum() for p in engine.module.parameters()) * 0.0, scale_wrt_gas=False)
                engine.step()
                continue
            logp_all, logp, resp_mask = response_distributions(
                engine, [r["prompt"] for r in micro], [r["response"] for r in micro], pad_id, cfg.rollout.temperature
            )
            width = logp.shape[1]
            mask = resp_mask * _padded(micro, "mask", width)
            pg_mask = resp_mask * _padded(micro, "pg_mask", width)
            old = _padded(micro, "old_logp", width)
            student_topk = teacher_topk = None
            if self.divergence is not None:
                # The student's full-softmax log-probs at the teacher's top-k ids of each position.
                student_topk = torch.gather(logp_all, 2, _padded_topk(micro, "topk_ids", width, torch.long))
                teacher_topk = _padded_topk(micro, "topk_logp", width, torch.float32)
            losses, was_clipped = combined_token_losses(
                self.policy_loss, self.divergence, logp, old, _padded(micro, "adv", width), pg_mask,
                _padded(micro, "div", width), student_topk, teacher_topk,
                cfg.method.clip_low, cfg.method.clip_high, cfg.method.jsd_beta,
            )
            weights = torch.tensor([r["weight"] for r in micro], dtype=torch.float32).unsqueeze(-1)
            loss = aggregate(losses * weights, mask, self.loss_agg, n_seqs, n_tokens)
            # DeepSpeed averages gradients over ranks; the shares already sum to the step loss.
            engine.backward(loss * world, scale_wrt_gas=False)
            if boundary and tc.zero_stage == 0:
                # DeepSpeed's fp32 ZeRO-0 path clips without keeping the norm; grads are already
                # all-reduced here (accumulation boundary), so this is the global pre-clip norm.
                norms = [torch.linalg.vector_norm(p.grad) for p in engine.module.parameters() if p.grad is not None]
                grad_norm = float(torch.linalg.vector_norm(torch.stack(norms)))
            engine.step()
            step_loss += loss.item()
            clipped += float(was_clipped.sum())
            ratio_sum += float((torch.exp(logp.detach() - old) * mask).sum())
        if tc.zero_stage > 0:
            grad_norm = engine.get_global_grad_norm()
        if world > 1:
            import torch.distributed as dist

            totals = torch.tensor([step_loss, clipped, ratio_sum], dtype=torch.float64)
            dist.all_reduce(totals)
            step_loss, clipped, ratio_sum = totals.tolist()
        return {
            "loss": step_loss,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "clip_fraction": clipped / max(n_tokens, 1),
            "ratio_mean": ratio_sum / max(n_tokens, 1),
        }

    # -- checkpoints within a round ---------------------------------------------------------------
    def _save_checkpoint(self, engine, out_dir: str, history: list[dict]) -> None:
        """Model and optimizer state after ``len(history)`` steps; the JSON record, written last and
        exclusively, is what makes the checkpoint visible to a later attempt."""
        from safetensors.torch import save as save_safetensors

        step = len(history)
        base = f"{out_dir}/ckpt/step-{step:05d}"
        state = {k: v.contiguous() for k, v in engine.module.state_dict().items()}
        files = {
            "model": self.run.fs.write_new(f"{base}/model.safetensors", save_safetensors(state)),
            "optimizer": self._write_optimizer_state(engine, f"{base}/optimizer.pt"),
        }
        self.run.fs.create_json(f"{base}.json", {"step": step, "history": history, "files": files})

    def _resume(self, engine) -> list[dict]:
        """Load the newest checkpoint any earlier attempt of this round left; returns its step history."""
        from safetensors.torch import load as load_safetensors

        if not self._carries_optimizer_state():
            return []
        records = self.run.records(self.round, self.stage)
        best = None
        for attempt in records.attempts("update"):
            ckpt = f"{records.attempt_dir('update', attempt)}/ckpt"
            for name in self.run.fs.listdir(ckpt):
                if name.endswith(".json"):
                    meta = self.run.fs.read_json(f"{ckpt}/{name}")
                    if best is None or meta["step"] > best["step"]:
                        best = meta
        if best is None:
            return []
        engine.module.load_state_dict(load_safetensors(verified_bytes(self.run.fs, best["files"]["model"])))
        self._read_optimizer_state(engine, best["files"]["optimizer"])
        return list(best["history"])

    def _write_optimizer_state(self, engine, rel: str) -> dict:
        buf = io.BytesIO()
        torch.save(engine.optimizer.state_dict(), buf)
        return self.run.fs.write_new(rel, buf.getvalue())

    def _read_optimizer_state(self, engine, record: dict) -> None:
        state = torch.load(io.BytesIO(verified_bytes(self.run.fs, record)), weights_only=True)
        engine.optimizer.load_state_dict(state)

    def _carries_optimizer_state(self) -> bool:
        # With ZeRO-0 the optimizer is plain torch AdamW, whose state dict is tensors and numbers and
        # so loads with weights_only=True. ZeRO>=1 partitions it into DeepSpeed's own structures.
        return self.cfg.train.carry_optimizer_state and self.cfg.train.zero_stage == 0

    def _load_optimizer_state(self, engine) -> bool:
        """Continue AdamW's moments from the previous round: a fresh Adam's first steps are
        sign-like (size lr in every coordinate), which on a small policy undoes much of a round."""
        if self.round == 0 or not self._carries_optimizer_state():
            return False
        prev = self.run.records(self.round - 1, "train").require_manifest()["units"][0]
        record = prev.get("optimizer_state")
        if record is None:
            return False
        self._read_optimizer_state(engine, record)
        return True

    def summarize(self, commits):
        c = commits[0]
        norms = np.array([s["grad_norm"] for s in c["steps"]])
        return {
            "policy_version": self.round + 1,
            "model_dir": c["model_dir"],
            "loss_mean": float(np.mean([s["loss"] for s in c["steps"]])),
            "grad_norm_max": float(norms.max()),
            "grad_norm_std": float(norms.std()),
            "optimizer_steps": len(c["steps"]),
            "adv_min": c["adv_min"],
            "adv_max": c["adv_max"],
            "divergence": c.get("divergence"),
            "seconds": c["seconds"],
        }
