"""Train's DeepSpeed engine: building it, its checkpoints (within a round and across rounds), the export.

* Build: the DeepSpeed config carries a bf16 (or fp16) block when ``model.dtype`` resolves to it, with
  fp32 master weights in the optimizer. Under ZeRO-3 the model is constructed partitioned (transformers'
  DeepSpeed integration wraps ``from_pretrained`` in ``zero.Init``), so no rank ever holds a full copy.
* Checkpoints: DeepSpeed's own ``save_checkpoint`` (every ZeRO stage: each rank writes its partition),
  copied into the run's storage as immutable files whose sha256 goes into a record. Loading one needs
  ``torch.load(weights_only=False)`` inside DeepSpeed, i.e. unpickling; it is only done after every file
  was read back through the run's storage and matched the sha256 its record holds, so only files this
  run wrote itself are ever unpickled. A record is written last and exclusively; it is what makes a
  checkpoint visible (the in-round one to a retried attempt, the end-of-round one to the next round).
* Export: the updated student in Hugging Face format, in the model's training dtype (bf16 on GPUs).
  Under ZeRO-3 the partitions are gathered layer by layer onto rank 0 first.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

import torch

from gndpo.errors import GndpoError
from gndpo.stages.models.device import local_device, resolve_dtype
from gndpo.stages.models.loading import load_causal_lm, load_tokenizer
from gndpo.storage.shards import verified_bytes

CHECKPOINT_TAG = "state"


def isolate_extension_builds() -> None:
    """Give this Python environment its own folder for DeepSpeed's JIT-built ops.

    torch's default folder is shared by every environment of the user; DeepSpeed rebuilds an op when
    its sources' path differs, so two venvs running at once rebuild over each other and one of them
    loads a half-written module. An explicit TORCH_EXTENSIONS_DIR is left alone."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        tag = hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(os.path.expanduser("~/.cache/torch_extensions"), f"gndpo-{tag}")


def deepspeed_config(cfg, world: int, dtype: torch.dtype) -> dict:
    """DeepSpeed settings for one update. Micro-batches are token-budgeted and vary in number per step,
    so train marks accumulation boundaries itself and DeepSpeed's own batch arithmetic is left at 1."""
    tc = cfg.train
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "gradient_clipping": tc.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": tc.lr, "weight_decay": tc.weight_decay, "betas": [0.9, 0.999], "eps": 1e-8, "torch_adam": True},
        },
        "zero_optimization": {"stage": tc.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if tc.zero_stage == 3:
        # The export gathers 16-bit (training-dtype) weights; without this DeepSpeed refuses to.
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}  # bf16 module, fp32 master weights in the optimizer
    elif dtype == torch.float16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return config


def build_engine(cfg, policy: str, world: int):
    """A DeepSpeed engine on the round's policy; returns (engine, config dict)."""
    import deepspeed

    if not 0 <= cfg.train.zero_stage <= 3:
        raise GndpoError(f"train.zero_stage must be 0, 1, 2 or 3, got {cfg.train.zero_stage}")
    device = local_device()
    dtype = resolve_dtype(cfg.model.dtype, device)
    config = deepspeed_config(cfg, world, dtype)
    zero3 = None
    if cfg.train.zero_stage == 3:
        from transformers.integrations import HfDeepSpeedConfig

        # While this object lives, from_pretrained builds the model inside zero.Init, one partition a rank.
        zero3 = HfDeepSpeedConfig(config)
    torch.manual_seed(cfg.train.seed)
    # Built in the training dtype and left where it was built: DeepSpeed moves it to the device, or
    # under ZeRO-3 zero.Init already put each rank's partition there.
    model = load_causal_lm(policy, cfg.model, device=device, dtype=dtype, place=False)
    model.config.use_cache = False
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config
    )
    engine.hf_zero3_config = zero3  # transformers consults it (weakly referenced) while the engine lives
    return engine, config


# -- checkpoints --------------------------------------------------------------------------------------
def save_state(engine, fs, rel: str, rank: int, world: int) -> list[dict] | None:
    """Write the engine's full state (module, optimizer, its partitions) under ``rel``; collective.
    Returns, on rank 0, the file records of all ranks (None elsewhere)."""
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(tmp, tag=CHECKPOINT_TAG)
        folder = Path(tmp) / CHECKPOINT_TAG
        # Each rank's local folder holds exactly the files that rank wrote (its partitions; rank 0 also
        # the module file below ZeRO-3), and names carry the rank, so uploads never collide.
        records = [fs.write_new(f"{rel}/{p.name}", p.read_bytes()) for p in sorted(folder.iterdir()) if p.is_file()]
    if world > 1:
        import torch.distributed as dist

        gathered = [None] * world
        dist.all_gather_object(gathered, records)
        records = [r for part in gathered for r in part]
    return records if rank == 0 else None


def load_state(engine, fs, state: dict, world: int) -> bool:
    """Load a state written by :func:`save_state` after checking every file against its sha256. A state
    written by another number of ranks is skipped (False): ZeRO partitions are per rank. Every rank
    fetches all files, as DeepSpeed's ZeRO-1/2 loader reads every rank's optimizer partition."""
    if state.get("world", 1) != world:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / CHECKPOINT_TAG
        folder.mkdir()
        for record in state["files"]:
            (folder / Path(record["path"]).name).write_bytes(verified_bytes(fs, record))
        engine.load_checkpoint(tmp, tag=CHECKPOINT_TAG, load_optimizer_states=True, load_lr_scheduler_states=False)
    return True


# -- export -------------------------------------------------------------------------------------------
def export_model(engine, policy: str, folder: str, zero_stage: int, rank: int) -> None:
    """Write the trained student to ``folder`` (on rank 0) in Hugging Face format; collective under
    ZeRO-3, where rank 0 receives the gathered 16-bit weights."""
    if zero_stage == 3:
        state = engine._zero3_consolidated_16bit_state_dict()  # collective: every rank must call it
    else:
        state = engine.module.state_dict() if rank == 0 else None
    if rank == 0:
        state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        engine.module.save_pretrained(folder, state_dict=state, safe_serialization=True)
        load_tokenizer(policy).save_pretrained(folder)
