"""The single-GPU device check of issue 53 (item 3): the GPU paths a review found defects in, through the
project's own code, each in its own process so that one failure (an OOM, a hang, a crash) stops no other.

* ``collectives``: two ranks on one GPU (two processes sharing it, LOCAL_RANK 0 both, since torchrun's 1
  names a GPU one machine lacks): train's real set-up (``TrainJob.setup``) inside ``run_collective``
  (its ``broadcast_object_list`` comes before the first ``set_device``), then ``local_device()``,
  ``schedule_steps`` (its ``all_reduce`` of a CPU tensor) and a CUDA all-reduce. Where the DeepSpeed group
  cannot form, the same steps again on a plain torch group without DeepSpeed's device binding;
* ``handover``: ``gndpo run``'s kept models (``LiveModels(keep=True)``) with a 1.07B realistic-shape
  student (:mod:`tests.realistic`): score, train (one ``take_step``), the kept engine before round 1's
  rollout (no vLLM here: what its 0.85 wake-up would find free is computed, before and after
  ``LiveModels.free_device_for_engine``, which rollout's ``student_engine`` calls before it wakes the
  engine), score and train of round 1; memory printed at each step;
* ``train_1p7b``: one optimizer step of a random Qwen3-1.7B-shape student with the config's defaults, a
  full 16,384-token micro-batch, its memory split into phases (the student's log-probs, the rest of the
  loss, backward, the optimizer step: the engine's ``backward``/``step`` and the objective's
  ``student_logprobs``/``micro_batch_loss`` wrapped by this script, torch's peak reset between them).
  Variants: ``train_1p7b_ckpt`` (train.gradient_checkpointing on, as train runs it), ``train_1p7b_ckpt_pkg``
  (the same; named for the run on the package whose ``enable_checkpointing`` marks the layers as training),
  ``train_1p7b_ckpt_live`` (the same, the engine put in training mode by this script, which
  transformers' checkpointing needs), ``train_1p7b_8k`` and ``train_1p7b_8k_ckpt_live`` (the same rows
  at train.max_tokens_per_batch 8,192: two micro-batches);
* ``qwen_vl``: a tiny random Qwen2.5-VL (:mod:`tests.vision_models`), train's log-probs with shared
  prompts against whole sequences and the model's own forward, fp32 and bf16.

In ``collectives``, a rank's step that ran with no process group (past a failed ``run_collective``) is
reported ``skipped`` (ok null), not ok: without a group its collectives return early or cannot run.

Each check reports ok, the error's first line, wall time, torch's peak allocated memory and the GPU's
used memory sampled by nvidia-smi every 0.2 s, into ``--out`` (rewritten after every check). No vLLM.

    python3 bench/gpu_check.py --out $OUT/gpu_check.json                 # on the GPU machine, ~5 min
    .venv/bin/python bench/gpu_check.py --tiny --out /tmp/gpu_check.json  # a CPU dry run: tiny shapes, gloo
    python3 bench/gpu_check.py --code /tmp/head --commit 53455fe ...     # another checkout's code (a baseline)
    python3 bench/gpu_check.py --only train_1p7b --only train_1p7b_8k ...  # some checks (repeatable)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu_round import MemorySampler, gpu_query, version  # noqa: E402

CHECKS = {"collectives": 75, "qwen_vl": 90, "handover": 200, "train_1p7b": 150, "train_1p7b_ckpt": 120,  # name: cap (s)
          "train_1p7b_ckpt_pkg": 120, "train_1p7b_ckpt_live": 120, "train_1p7b_8k": 120, "train_1p7b_8k_ckpt_live": 120}
TRAIN_VARIANTS = {"train_1p7b": {}, "train_1p7b_ckpt": {"checkpointing": True}, "train_1p7b_ckpt_pkg": {"checkpointing": True},
                  "train_1p7b_ckpt_live": {"checkpointing": True, "live": True},
                  "train_1p7b_8k": {"max_tokens": 8192}, "train_1p7b_8k_ckpt_live": {"checkpointing": True, "live": True, "max_tokens": 8192}}
GROUP_STEPS = ("run_collective", "init_process_group")  # a rank's steps that form the group (the others need one)
WORK = Path(tempfile.gettempdir()) / "gndpo-gpu-check"
GIB = 2**30


def use_code(root: Path) -> None:
    """``import gndpo`` (and ``tests``) from ``root``, here and in child processes: a folder holding a
    ``gndpo`` link to it goes first on sys.path and PYTHONPATH."""
    links = WORK / "path"
    links.mkdir(parents=True, exist_ok=True)
    link = links / "gndpo"
    if not (link.is_symlink() and link.resolve() == root):
        tmp = links / f".gndpo-{os.getpid()}"
        tmp.symlink_to(root)
        os.replace(tmp, link)
    sys.path[:0] = [str(links), str(root)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(links), str(root), *filter(None, [os.environ.get("PYTHONPATH")])])


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    if "Last error:" in text:  # NCCL's reason comes after its generic first line
        line += " | " + text.split("Last error:", 1)[1].strip().splitlines()[0]
    return line[:400]


class Recorder:
    def __init__(self, path: str, device, needs_group: bool = False):
        self.path, self.device, self.cuda, self.out = path, device, device.type == "cuda", {"steps": [], "ok": None}
        self.needs_group = needs_group  # a rank of several: a step (but one forming the group) with no group is skipped
        self.save()

    def save(self) -> None:
        Path(self.path).write_text(json.dumps(self.out, indent=1, default=str))  # after each step: a crash keeps what ran

    def memory(self) -> dict:
        """Allocated, reserved, peak allocated since the last step (torch), the GPU's used memory (nvidia-smi)."""
        if not self.cuda:
            return {}
        torch.cuda.synchronize()
        out = {"alloc_gib": round(torch.cuda.memory_allocated() / GIB, 2), "reserved_gib": round(torch.cuda.memory_reserved() / GIB, 2),
               "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / GIB, 2), "smi_used_mib": int(float((gpu_query("memory.used", "0") or ["0"])[0]))}
        self.out["peak_alloc_gib"] = max(self.out.get("peak_alloc_gib", 0), out["peak_alloc_gib"])
        torch.cuda.reset_peak_memory_stats()
        return out

    def step(self, name: str, fn, **extra) -> object:
        """Run ``fn``; record its time, memory and result or error. Returns its value (None on error)."""
        t0, entry, value = time.time(), {"step": name, **extra}, None
        try:
            value = fn()
            entry.update(value if isinstance(value, dict) else {})
            entry["ok"] = not entry.get("error")
        except Exception as exc:  # noqa: BLE001 - the check records every failure and goes on
            entry.update(ok=False, error=first_line(exc))
            traceback.print_exc()
        entry["seconds"] = round(time.time() - t0, 2)
        entry["group"] = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
        entry["status"] = "ok" if entry["ok"] else "FAIL"
        if self.needs_group and entry["group"] is None and not name.endswith(GROUP_STEPS):
            # It ran without a process group: its collectives returned early or could not run, so it says nothing.
            entry.update(ok=None, status="skipped", reason="no process group")
            if "error" in entry:
                entry["error_without_group"] = entry.pop("error")
        entry.update(self.memory())
        self.out["steps"].append(entry)
        print(f"[{self.out.get('name', '')}] {json.dumps(entry)}", flush=True)
        self.save()
        return value if entry["ok"] else None

    def finish(self, ok: bool | None = None, error: str | None = None, **extra) -> None:
        ran = [s for s in self.out["steps"] if s.get("status") != "skipped"]
        failed = [s for s in ran if not s["ok"]]
        where = f"rank {failed[0]['rank']} " if failed and "rank" in failed[0] else ""
        self.out["skipped_steps"] = len(self.out["steps"]) - len(ran)
        self.out.update(extra, ok=all(s["ok"] for s in ran) if ok is None else ok,
                        error=error or (f"{where}{failed[0]['step']}: {failed[0]['error']}" if failed else None))
        self.save()


# -- shared pieces: config, models, rows ----------------------------------------------------------------
def config(student: str, **train):
    from gndpo.pipeline.config.load import config_from_dict

    return config_from_dict({"student": student, "teacher": student, "train": train})


def save_model(model, folder: Path, cuda: bool) -> str:
    """Saved in bf16 on a GPU (fp32 on the CPU), the GPU's memory given back."""
    if cuda:
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return str(folder)


def student_1b(tiny: bool, device) -> str:
    """tests.realistic's Llama at the 1.07B shape of bench/results/gpu_stages_1b.json (random weights),
    built on ``device`` and saved in bf16 on a GPU; the tokenizer is not needed (ids are drawn)."""
    from tests.realistic import ShapeSpec, new_model

    folder = WORK / ("student1b-tiny" if tiny else "student1b")
    if (folder / "config.json").exists():
        return str(folder)
    spec = (ShapeSpec(vocab_size=1024, hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, max_position_embeddings=2048) if tiny else
            ShapeSpec(hidden=2048, layers=10, heads=16, kv_heads=4, intermediate=5632, max_position_embeddings=4096))
    with torch.device(device):
        model = new_model(spec, SimpleNamespace(eos_token_id=2, pad_token_id=0), seed=0)
    return save_model(model, folder, device.type == "cuda")


def student_1p7b(tiny: bool, device) -> str:
    """A random model of Qwen3-1.7B's shapes (28 layers, 2048 wide, tied 151,936-token embeddings)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = WORK / ("qwen3-1p7b-tiny" if tiny else "qwen3-1p7b")
    if (folder / "config.json").exists():
        return str(folder)
    dims = (dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
            if tiny else dict(vocab_size=151_936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                              num_key_value_heads=8, head_dim=128))
    cfg = Qwen3Config(**dims, max_position_embeddings=40960, tie_word_embeddings=True, rope_theta=1e6, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return save_model(model, folder, device.type == "cuda")


def token_rows(n_prompts: int, samples: int, prompt_len: int, response_len: int, vocab: int, topk: int, seed: int = 0) -> list:
    """TrainRows of ``n_prompts`` x ``samples`` drawn responses, with old log-probs near a random model's
    (-log V), normal advantages and a teacher top-k, as train reads them from score and normalize."""
    from gndpo.stages.training.batch import TrainRow

    rng, rows = np.random.default_rng(seed), []
    for p in range(n_prompts):
        prompt = rng.integers(10, min(vocab, 4000), prompt_len)
        for s in range(samples):
            n = response_len - s % 3  # a few lengths, as sampled responses have
            logits = rng.normal(size=(n, topk + 1))
            logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            rows.append(TrainRow(rollout_id=f"p{p}-{s}", prompt=prompt, response=rng.integers(10, min(vocab, 4000), n),
                                 old_logp=np.full(n, -np.log(vocab), np.float32), adv=rng.normal(size=n).astype(np.float32), pg_mask=np.ones(n, np.float32),
                                 div=np.full(n, 0.1, np.float32), mask=np.ones(n, np.float32), weight=1.0, topk_ids=rng.integers(0, vocab, (n, topk)),
                                 topk_logp=logp[:, :topk].astype(np.float32), topk_rest=logp[:, topk].astype(np.float32), prompt_id=f"p{p}"))
    return rows


def train_step(engine, cfg, rows, device, round_idx: int = 0) -> dict:
    """One optimizer step through train's own schedule, objective and step (stages/train.py, training/objective.py)."""
    from gndpo.stages.models.logprobs import logits_chunk
    from gndpo.stages.train import schedule_steps, take_step
    from gndpo.stages.training.batch import RoundShare
    from gndpo.stages.training.objective import Objective

    share = RoundShare.of_rows([rows])
    steps = schedule_steps(share, cfg.train, logits_chunk(engine.module, cfg.model))
    numbers = take_step(engine, Objective.of(cfg, round_idx, 0, device), share, steps, 0, cfg.train, round_idx, 1)
    return {"micro_batches": steps[0].n_micro, "tokens": sum(r.tokens for r in rows), "loss": numbers["loss"], "grad_norm": numbers["grad_norm"]}


def set_up_train() -> None:
    """Train's process set-up as ``TrainJob.setup`` does it (DeepSpeed import, threads, process group)."""
    from gndpo.dist import Dist
    from gndpo.stages.train import TrainJob

    TrainJob.setup(SimpleNamespace(dist=Dist.from_env()))


# -- the checks (each runs in its own process) -----------------------------------------------------------
def check_handover(rec: Recorder, tiny: bool) -> None:
    from gndpo.stages.models.batches import make_batch
    from gndpo.stages.models.live import LiveModels
    from gndpo.stages.models.logprobs import logits_chunk, pair_token_stats
    from gndpo.stages.training.deepspeed_engine import build_engine

    device = rec.device
    rec.step("setup", set_up_train)
    path = rec.step("build_student", lambda: student_1b(tiny, device))
    if path is None:
        return rec.finish()
    cfg = config(path)
    live, params = LiveModels(keep=True, log=print), {}
    rows = token_rows(4 if tiny else 16, 4, 32, 16 if tiny else 128, 1024 if tiny else 151_936, cfg.score.teacher_topk)

    def score(round_idx: int) -> dict:
        live.release_engine()
        student = live.causal_lm(path, cfg.model, device, fixed=False)
        teacher = live.causal_lm(path, cfg.model, device, fixed=True)  # the kept teacher: the student's folder, to save a build
        params["n"] = sum(p.numel() for p in student.parameters())
        batch = make_batch([r.prompt for r in rows], [r.response for r in rows], 0, device, cfg.model.shared_prompts)
        out = pair_token_stats(teacher, student, batch, logits_chunk(student, cfg.model), 1.0, topk=cfg.score.teacher_topk, entropies=(True, True))
        del student
        gc.collect()
        return {"round": round_idx, "tokens": int(out["student_logprobs"].numel())}

    def train(round_idx: int, policy_dir) -> dict:
        live.release_engine()
        live.release_modules()
        engine, reused = live.train_engine(cfg, path, policy_dir, 1, build=build_engine)
        out = {"round": round_idx, "engine_reused": reused, **train_step(engine, cfg, rows, device, round_idx)}
        live.trained(engine, cfg, 1, f"run/models/r{round_idx + 1}")
        del engine
        gc.collect()
        return out

    def before_rollout() -> dict:
        # What rollout's wake_up of the sleeping vLLM engine would find: student_engine frees the device first
        # (where the package has free_device_for_engine); the free memory is read before and after.
        live.release_engine()
        out = {"kept_trainer_before": live._trainer is not None}
        if device.type == "cuda":
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            out.update(free_before_gib=round(free / GIB, 2), reserved_before_gib=round(torch.cuda.memory_reserved() / GIB, 2))
        freer = getattr(live, "free_device_for_engine", None)
        out["free_device_for_engine"] = freer is not None
        if freer is not None:
            freer()
        out["kept_trainer_after"] = live._trainer is not None
        if device.type != "cuda":
            return out
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        want = cfg.engine.gpu_memory_utilization * total
        return {**out, "free_gib": round(free / GIB, 2), "total_gib": round(total / GIB, 2), "vllm_wants_gib": round(want / GIB, 2),
                "vllm_wake_fits": free >= want, "held_bytes_per_parameter": round((total - free) / params["n"], 1)}

    for name, fn in (("r0_score", lambda: score(0)), ("r0_train", lambda: train(0, None)), ("r1_before_rollout", before_rollout),
                     ("r1_score", lambda: score(1)), ("r1_train", lambda: train(1, "run/models/r1"))):
        if rec.step(name, fn) is None and name != "r1_before_rollout":
            break
    fits = [s.get("vllm_wake_fits") for s in rec.out["steps"] if s["step"] == "r1_before_rollout"]
    rec.finish(parameters=params.get("n"), ok=all(s["ok"] for s in rec.out["steps"]) and fits != [False],
               error=None if fits != [False] else "r1_before_rollout: the kept engine leaves less free than vLLM's wake-up asks")


class Phases:
    """Memory at the ends of one step's phases: each phase's torch peak (reset at its start) and what is
    allocated and reserved at its end. ``mark(name)`` closes the phase ``name`` that ran since the last mark."""

    def __init__(self, rec: Recorder):
        self.rec, self.rows, self.micro, self.t = rec, [], -1, time.time()

    def reset(self) -> None:
        if self.rec.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.t = time.time()

    def mark(self, name: str, **extra) -> None:
        row = {"phase": name, "micro": self.micro, **extra}
        if self.rec.cuda:
            torch.cuda.synchronize()
            row.update(peak_alloc_gib=round(torch.cuda.max_memory_allocated() / GIB, 2), alloc_gib=round(torch.cuda.memory_allocated() / GIB, 2),
                       reserved_gib=round(torch.cuda.memory_reserved() / GIB, 2))
            self.rec.out["peak_alloc_gib"] = max(self.rec.out.get("peak_alloc_gib", 0), row["peak_alloc_gib"])
            torch.cuda.reset_peak_memory_stats()
        row["seconds"] = round(time.time() - self.t, 2)
        self.t = time.time()
        self.rows.append(row)
        print(f"  phase {json.dumps(row)}", flush=True)

    def watch(self, engine) -> None:
        """Wrap the objective's micro_batch_loss and student_logprobs (its class: a frozen dataclass) and the
        engine's backward and step, so each marks its phase's end."""
        from gndpo.stages.training.objective import Objective

        loss_fn, logprobs_fn, backward_fn, step_fn = Objective.micro_batch_loss, Objective.student_logprobs, engine.backward, engine.step

        def micro_batch_loss(obj, model, micro, *args, **kwargs):
            self.micro += 1
            self.mark("before_forward")  # since the last mark: the learning rate set, the accumulation boundary
            out = loss_fn(obj, model, micro, *args, **kwargs)
            self.mark("loss", tokens=sum(r.tokens for r in micro), rows=len(micro))  # the rest of the loss on the log-probs
            return out

        def student_logprobs(obj, *args, **kwargs):
            self.mark("batch")  # the token batch built on the device
            out = logprobs_fn(obj, *args, **kwargs)
            self.mark("logprobs")  # the student's forward: backbone + chunked lm_head/log-softmax, kept for backward
            return out

        def backward(*args, **kwargs):
            out = backward_fn(*args, **kwargs)
            self.mark("backward")
            return out

        def step(*args, **kwargs):
            out = step_fn(*args, **kwargs)
            self.mark("step")  # the optimizer step (on the accumulation boundary), gradients zeroed
            return out

        Objective.micro_batch_loss, Objective.student_logprobs = micro_batch_loss, student_logprobs
        engine.backward, engine.step = backward, step


def check_train_1p7b(rec: Recorder, tiny: bool, checkpointing: bool = False, live: bool = False, max_tokens: int | None = None) -> None:
    """One optimizer step at the defaults (and ``checkpointing``; ``live``: the engine put in training
    mode by this script; ``max_tokens``: train.max_tokens_per_batch), its memory by phase."""
    from gndpo.stages.models.live import LiveModels
    from gndpo.stages.training.deepspeed_engine import build_engine

    device = rec.device
    rec.step("setup", set_up_train)
    path = rec.step("build_student", lambda: student_1p7b(tiny, device))
    if path is None:
        return rec.finish()
    train = {"gradient_checkpointing": True} if checkpointing else {}
    if max_tokens:  # tiny: 100 tokens, two micro-batches of its rows as 8,192 makes of the full ones
        train["max_tokens_per_batch"] = 100 if tiny else max_tokens
    cfg = config(path, **train)
    rec.out["settings"] = {k: getattr(cfg.train, k) for k in ("zero_stage", "gradient_checkpointing", "max_tokens_per_batch", "micro_batch_size")}
    rec.out["settings"].update(shared_prompts=cfg.model.shared_prompts, attn_implementation=cfg.model.attn_implementation, dtype=cfg.model.dtype,
                               training_mode_set_by_check=live)
    # One full micro-batch at the default budget: 2 prompts x 8 samples of 128 + 896 tokens = 16,384.
    rows = token_rows(1 if tiny else 2, 4 if tiny else 8, 16 if tiny else 128, 32 if tiny else 896, 1024 if tiny else 151_936, cfg.score.teacher_topk)
    holder = {}

    def build() -> dict:
        engine, _ = LiveModels().train_engine(cfg, path, None, 1, build=build_engine)
        module = engine.module
        out = {"parameters": sum(p.numel() for p in module.parameters()), "module_training_as_built": module.training,
               "checkpointing_layers": sum(1 for m in module.modules() if getattr(m, "gradient_checkpointing", False) is True),
               "training_modules": sum(1 for m in module.modules() if m.training),  # enable_checkpointing marks its layers only
               "checkpointing_layers_training": sum(1 for m in module.modules() if getattr(m, "gradient_checkpointing", False) is True and m.training)}
        if live:
            engine.train()  # transformers checkpoints a layer only while the module is in training mode
        out["module_training"] = module.training
        holder["engine"] = engine
        return out

    if rec.step("build_engine", build) is not None:
        phases = Phases(rec)
        phases.watch(holder["engine"])
        phases.reset()

        def step() -> dict:
            out = train_step(holder["engine"], cfg, rows, device)
            phases.mark("after_step")  # take_step's own numbers (the loss all-reduced, the norm read)
            peaks = [r["peak_alloc_gib"] for r in phases.rows if "peak_alloc_gib" in r]
            return {**out, "step_peak_alloc_gib": max(peaks, default=None),
                    "peak_phase": max(phases.rows, key=lambda r: r.get("peak_alloc_gib", 0))["phase"] if peaks else None}

        rec.step("train_step", step)
        rec.out["phases"] = phases.rows
    rec.finish()


def check_qwen_vl(rec: Recorder, tiny: bool) -> None:
    from gndpo.stages.models.batches import make_batch
    from gndpo.stages.models.logprobs import policy_token_logprobs
    from gndpo.stages.models.vision import image_inputs
    from tests.vision_models import expanded_prompt, pictures, qwen2_5_vl

    device = rec.device

    def compare(dtype) -> dict:
        model, tok, processor = qwen2_5_vl()
        model = model.to(device=device, dtype=dtype).eval()
        images = pictures(2)
        images[1] = images[1].resize((112, 112))  # another grid: prompts of two lengths, so the shared prefix is left-padded
        grids = processor(images=[[im] for im in images], return_tensors="pt")["image_grid_thw"]
        shows = [0, 0, 0, 1, 1, 1]  # two prompts (one picture each), three responses each
        prompts = [expanded_prompt("qwen2_5_vl", tok, grids[i]) for i in shows]
        rng = np.random.default_rng(0)
        responses = [rng.integers(3, 90, size=5 + 2 * j).tolist() for j in range(len(shows))]
        whole = make_batch(prompts, responses, tok.pad_token_id, device)
        whole.images = image_inputs(processor, [[images[i]] for i in shows], device)
        shared = make_batch(prompts, responses, tok.pad_token_id, device, share_prompts=True, image_keys=shows)
        shared.images = image_inputs(processor, [[images[shows[i]]] for i in shared.prefix_rows], device)
        # The model's own forward as its processor feeds it: transformers 5.x builds the 3-D (M-RoPE)
        # positions only from mm_token_type_ids (1 at image tokens), which the image processor alone never gives.
        typed = "mm_token_type_ids" in inspect.signature(model.model.forward).parameters
        with torch.no_grad():
            lw = policy_token_logprobs(model, whole, 64, 1.0).sampled.float()
            ls = policy_token_logprobs(model, shared, 64, 1.0).sampled.float()
            own, mrope = [], []
            for j, i in enumerate(shows):
                ids = torch.tensor([prompts[j] + responses[j]], device=device)
                inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in image_inputs(processor, [[images[i]]], device).items()}
                start = len(prompts[j])
                for out, extra in ((own, {}), (mrope, {"mm_token_type_ids": (ids == model.config.image_token_id).int()} if typed else {})):
                    full = model(input_ids=ids, **inputs, **extra).logits[0].float().log_softmax(-1)
                    out.append(full[start - 1 : -1].gather(-1, ids[0, start:, None])[:, 0])
            own, mrope = torch.cat(own), torch.cat(mrope)
        gap = {"shared_vs_whole_max": float((ls - lw).abs().max()), "shared_vs_whole_mean": float((ls - lw).abs().mean()),
               "whole_vs_own_max": float((lw - own).abs().max()), "whole_vs_mrope_max": float((lw - mrope).abs().max()),
               "shared_vs_mrope_max": float((ls - mrope).abs().max()), "mrope_from": "mm_token_type_ids" if typed else "the model's default"}
        # fp32: the 1e-5 (1e-4 for a GPU's kernels); bf16: twice the rounding the whole-sequence path shows against
        # the same model's own forward, plus 1e-2.
        limit = 1e-4 if dtype == torch.float32 else 2 * gap["whole_vs_own_max"] + 1e-2
        bad = [f"{k} {gap[k]:.3g}" for k in ("shared_vs_whole_max", "whole_vs_mrope_max") if gap[k] > limit]
        return {**gap, "limit": limit, **({"error": f"above {limit:.3g}: {', '.join(bad)}"} if bad else {})}

    for dtype in (torch.float32, torch.bfloat16):
        rec.step(str(dtype).removeprefix("torch."), lambda: compare(dtype))
    rec.finish()


def check_collectives(rec: Recorder, tiny: bool) -> None:
    """Two rank processes on the one GPU; each writes its own steps, gathered here."""
    from gndpo.stages.training.deepspeed_engine import free_port

    ports = [free_port(), free_port()]
    procs, files = [], []
    for rank in range(2):
        files.append(f"{rec.path}.rank{rank}")
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank if torch.cuda.device_count() > 1 else 0),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[0]), "GNDPO_CHECK_PORT2": str(ports[1])}
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-child", "--result", files[-1]] + (["--tiny"] if tiny else []), env=env))
    deadline = time.time() + CHECKS["collectives"] - 10
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
    ranks = [json.loads(Path(f).read_text()) if Path(f).exists() else {"steps": []} for f in files]
    for rank, (r, p) in enumerate(zip(ranks, procs)):
        for s in r["steps"]:
            rec.out["steps"].append({"rank": rank, **s})
        rec.out.setdefault("exit_codes", []).append(p.returncode)
    rec.finish(ok=all(r["steps"] and all(s["ok"] for s in r["steps"] if s.get("status") != "skipped") for r in ranks)
               and all(p.returncode == 0 for p in procs))


def rank_child(rec: Recorder, tiny: bool) -> None:
    """One rank: the order train takes (run_collective joins the group and broadcasts, then build_engine's
    local_device, then schedule_steps), then a CUDA all-reduce as a control."""

    from gndpo.pipeline.exec.units import run_collective
    from gndpo.stages.models.device import local_device
    from gndpo.stages.train import schedule_steps
    from gndpo.stages.training.batch import RoundShare

    rows = token_rows(2, 2, 8, 8, 1024, 4, seed=int(os.environ["RANK"]))
    cfg = config("unused")
    records = SimpleNamespace(manifest=lambda: {"rows": 0}, stage="train", round=0)  # committed: every rank just follows rank 0

    def steps(prefix: str, job) -> None:
        rec.step(prefix + "run_collective", lambda: run_collective(records, job) and {"current_device": cuda_now()})
        rec.step(prefix + "local_device", lambda: {"device": str(local_device())})
        rec.step(prefix + "schedule_steps", lambda: {"n_tokens": schedule_steps(RoundShare.of_rows([rows], [8]), cfg.train, 64)[0].n_tokens})
        rec.step(prefix + "cuda_all_reduce", lambda: cuda_all_reduce(local_device()))

    def cuda_now():
        return torch.cuda.current_device() if torch.cuda.is_available() else None

    def cuda_all_reduce(device):
        t = torch.ones(1, device=device)
        dist.all_reduce(t)
        return {"sum": float(t)}

    steps("", SimpleNamespace(setup=set_up_train))
    if not dist.is_initialized():  # DeepSpeed's group did not form: the same steps on a plain torch group
        os.environ["MASTER_PORT"] = os.environ["GNDPO_CHECK_PORT2"]
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if rec.step("fallback:init_process_group", lambda: dist.init_process_group(backend)) is not None or dist.is_initialized():
            steps("fallback:", SimpleNamespace(setup=lambda: None))
    rec.finish()
    if dist.is_initialized():
        dist.destroy_process_group()


def child(args) -> None:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    rec = Recorder(args.result, device, needs_group=args.rank_child)
    rec.out["name"] = args.child or f"rank{os.environ.get('RANK')}"
    if args.rank_child:
        return rank_child(rec, args.tiny)
    if args.child in TRAIN_VARIANTS:
        return check_train_1p7b(rec, args.tiny, **TRAIN_VARIANTS[args.child])
    {"collectives": check_collectives, "handover": check_handover, "qwen_vl": check_qwen_vl}[args.child](rec, args.tiny)


# -- the parent: one process per check, nvidia-smi sampled, results written as they come ----------------
def environment(args) -> dict:
    gpu = torch.cuda.is_available()
    out = {"date": datetime.date.today().isoformat(), "commit": args.commit, "code": str(args.code), "tiny": args.tiny,
           "gpu": (gpu_query("name", "0") or ["?"])[0] if gpu else None,
           "gpu_memory_total_mib": int(float((gpu_query("memory.total", "0") or ["0"])[0])) if gpu else None,
           "versions": {p: version(p) for p in ("torch", "transformers", "deepspeed", "peft", "polars")},
           "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None}
    import gndpo

    out["gndpo_file"] = str(Path(gndpo.__file__).resolve())
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE / "results" / "gpu_check.json"))
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU dry run of the code paths)")
    ap.add_argument("--only", action="append", choices=list(CHECKS), help="run only these checks (repeatable)")
    ap.add_argument("--budget", type=float, default=420, help="seconds for all checks; a check that cannot get 30 is skipped")
    ap.add_argument("--code", type=Path, default=HERE.parent, help="the checkout whose gndpo is checked (default: this one)")
    ap.add_argument("--commit", default=None, help="the commit --code holds, for the results")
    ap.add_argument("--child", choices=list(CHECKS), help=argparse.SUPPRESS)
    ap.add_argument("--rank-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.code = args.code.resolve()
    if args.child or args.rank_child:
        sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return child(args)
    use_code(args.code)
    if args.commit is None:
        git = subprocess.run(["git", "-C", str(args.code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        args.commit = git.stdout.strip() or None
    result, start = {**environment(args), "checks": {}}, time.time()
    print(json.dumps({k: v for k, v in result.items() if k != "checks"}), flush=True)
    for name in args.only or CHECKS:
        left = args.budget - (time.time() - start)
        if left < 30:
            result["checks"][name] = {"ok": None, "error": f"skipped: {left:.0f} s of the budget left"}
            continue
        cap, file = min(CHECKS[name], left), str(WORK / f"{name}.json")
        WORK.mkdir(parents=True, exist_ok=True)
        Path(file).unlink(missing_ok=True)
        sampler = MemorySampler("0") if result["gpu"] else None
        if sampler:
            sampler.start()
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, __file__, "--child", name, "--result", file] + (["--tiny"] if args.tiny else []), start_new_session=True)
        try:
            code = proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            code = f"killed after {cap:.0f} s"
        entry = json.loads(Path(file).read_text()) if Path(file).exists() else {"ok": False, "steps": []}
        entry.update(wall_s=round(time.time() - t0, 1), exit_code=code, peak_smi_mib=max(sampler.stop(), default=None) if sampler else None)
        if code != 0:
            entry["ok"] = False
            entry["error"] = entry.get("error") or f"the check's process ended with {code} after step {(entry['steps'] or [{}])[-1].get('step')}"
        result["checks"][name] = entry
        print(f"== {name}: {'ok' if entry['ok'] else 'FAILED'} in {entry['wall_s']} s, peak alloc {entry.get('peak_alloc_gib')} GiB, "
              f"nvidia-smi {entry['peak_smi_mib']} MiB; {entry.get('error')}", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out} after {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
