"""Train's DeepSpeed engine: joining the process group, and building the engine on the round's policy.

* The process group: the one a launcher (torchrun) set up, or a one-rank group of a plain ``gndpo
  train``'s own (:func:`init_distributed`).
* Build: the DeepSpeed config carries a bf16 (or fp16) block when ``model.dtype`` resolves to it, with
  fp32 master weights in the optimizer. Under ZeRO-3 the model is constructed partitioned (transformers'
  DeepSpeed integration wraps ``from_pretrained`` in ``zero.Init``), so no rank ever holds a full copy.

The engine's checkpoints are in :mod:`gndpo.stages.training.checkpoint`, its export in
:mod:`gndpo.stages.training.export`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import shutil
import socket
import sys

import torch

from gndpo.dist import Dist
from gndpo.pipeline.settings.schema import Config
from gndpo.stages.models.device import gpu_memory, local_device, resolve_dtype
from gndpo.stages.models.fused_output import sparse_tied_lookup
from gndpo.stages.models.gpu_memory import uses_checkpointing
from gndpo.stages.models.loading import is_vision_model, load_causal_lm
from gndpo.stages.models.lora import adapted_student
from gndpo.stages.models.vision import freeze_all_but_language_model
from gndpo.storage.meter import phase


def isolate_extension_builds() -> None:
    """Give this Python environment its own folder for DeepSpeed's JIT-built ops.

    torch's default folder is shared by every environment of the user; DeepSpeed rebuilds an op when
    its sources' path differs, so two venvs running at once rebuild over each other and one of them
    loads a half-written module. An explicit TORCH_EXTENSIONS_DIR is left alone.

    The builds also run the environment's own ninja (installed with DeepSpeed) wherever one is found
    on PATH first: torch runs whichever ``ninja`` PATH names, and two ninja versions (a system 1.11 and
    the environment's 1.13) read each other's build log as stale, so processes with and without the
    environment on PATH rebuilt the op over each other, a minute of compiling each time."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        tag = hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(os.path.expanduser("~/.cache/torch_extensions"), f"gndpo-{tag}")
    own_ninja = os.path.join(os.path.dirname(sys.executable), "ninja")
    if os.path.isfile(own_ninja) and shutil.which("ninja") != own_ninja:
        os.environ["PATH"] = os.pathsep.join([os.path.dirname(own_ninja), os.environ.get("PATH", "")])


def build_cpu_ops() -> None:
    """Build, on a machine without a GPU, the DeepSpeed op every train process loads there (its
    shared-memory all-reduce for CPU ranks) into this environment's folder: `make setup` calls it, so
    the first train (the demo's, a test's) does not spend a minute compiling it. Elsewhere, nothing."""
    if torch.cuda.is_available():
        return
    quiet_deepspeed_import()
    isolate_extension_builds()
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()


def init_distributed(dist: Dist) -> None:
    """Join this process's DeepSpeed process group: the one the launcher set up (its env:// rendezvous),
    or, for a plain ``gndpo train``, a one-rank group on a free local port.

    DeepSpeed reads the local rank from the environment and from nowhere else (DeepSpeedEngine refuses
    to start without LOCAL_RANK; ZeRO-3 puts each partition on that device), so a process without a
    launcher gets LOCAL_RANK written here, the one variable gndpo sets for it. Its rendezvous is passed
    as arguments instead, so no RANK, WORLD_SIZE or MASTER_PORT is left behind for child processes to
    inherit (a later torchrun would try to bind that port)."""
    import deepspeed

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs = {} if dist.launched else dict(auto_mpi_discovery=False, init_method=f"tcp://127.0.0.1:{free_port()}", rank=dist.rank,
                                           world_size=dist.world)
    if not dist.launched:
        os.environ.setdefault("LOCAL_RANK", str(dist.local_rank))
    # This rank's GPU first: NCCL ties a rank's communicator to the current CUDA device when the group is
    # made (DeepSpeed passes it as device_id), and run_collective's first broadcast follows at once; on
    # the default device every rank would sit on cuda:0.
    local_device()
    forget_destroyed_world_group()
    # On CPU DeepSpeed builds its shared-memory communication extension here and print()s "... built
    # successfully" on stdout: that line goes to the log at DEBUG instead.
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        deepspeed.init_distributed(dist_backend=backend, **kwargs)
    if printed.getvalue().strip():
        logging.getLogger("gndpo").debug("deepspeed: %s", printed.getvalue().strip())


def forget_destroyed_world_group() -> None:
    """Let DeepSpeed clone the world group again if the one it cloned has been destroyed.

    DeepSpeed clones torch's world group once per process and keeps the clone in a module global
    (``deepspeed.utils.groups._WORLD_GROUP``); ZeRO-2/3 look their ranks up in it. An in-process vLLM
    engine (``engine.in_process``) destroys every process group of the process when it shuts down
    (vLLM's ``cleanup_dist_env_and_memory``), the clone among them, so a later ZeRO engine in the same
    process failed with "Group ... is not registered". The group is re-created on the next
    :func:`deepspeed.init_distributed`; this makes DeepSpeed clone that one."""
    from deepspeed.utils import groups

    clone = groups._WORLD_GROUP
    if clone is None:
        return
    try:
        torch.distributed.get_process_group_ranks(clone)
    except (KeyError, ValueError, RuntimeError):  # torch no longer knows the group
        groups._WORLD_GROUP = None


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_deepspeed_import() -> None:
    """Import DeepSpeed without its "Setting accelerator to CPU" warning: where torch sees no CUDA device
    the accelerator is named (``DS_ACCELERATOR=cpu``, unless the user set it), so DeepSpeed need not
    guess and announce it."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401


def deepspeed_config(cfg: Config, world: int, dtype: torch.dtype) -> dict:
    """DeepSpeed settings for one update. Micro-batches are token-budgeted and vary in number per step,
    so train marks accumulation boundaries itself and DeepSpeed's own batch arithmetic is left at 1."""
    train_cfg = cfg.train
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "gradient_clipping": train_cfg.grad_clip,
        "optimizer": {
            "type": "AdamW",
            # torch's fused AdamW (CPU and GPU): one pass over each parameter. The default single-tensor
            # update allocates a parameter-sized denominator per tensor: at a 262k vocabulary that is the
            # tied embedding's size again (0.67 GB), the step's memory peak, and it is 6x slower on the CPU.
            "params": {"lr": train_cfg.lr, "weight_decay": train_cfg.weight_decay, "betas": [0.9, 0.999], "eps": 1e-8, "torch_adam": True,
                       "fused": True},
        },
        "zero_optimization": {"stage": train_cfg.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if train_cfg.zero_stage == 3:
        # The export gathers 16-bit (training-dtype) weights; without this DeepSpeed refuses to.
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}  # bf16 module, fp32 master weights in the optimizer
    elif dtype == torch.float16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return config


def enable_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them.

    transformers checkpoints a layer only while that layer is in training mode, and ``from_pretrained``
    returns the model in eval mode, which train keeps: a training-mode forward would turn the model's
    dropout on, and the round's first importance ratio against score's eval-mode log-probs would no
    longer be 1. So only the checkpointed layers themselves are marked as training (``Module.train``
    would recurse into their attention and MLP, whose dropout reads their own mode)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
            module.training = True


@phase("load")  # `gndpo status --phases`: the model load and the engine's set-up
def build_engine(cfg: Config, policy: str, world: int, base: str | None = None):
    """A DeepSpeed engine on the round's policy; returns (engine, config dict). With ``model.lora`` the
    model is ``base`` (the initial student) with the adapters ``policy`` carries (fresh ones in round 0)."""
    import deepspeed

    device = local_device()
    dtype = resolve_dtype(cfg.model.dtype, device)
    config = deepspeed_config(cfg, world, dtype)
    zero3 = None
    if cfg.train.zero_stage == 3:
        from transformers.integrations import HfDeepSpeedConfig

        # While this object is set, from_pretrained builds the model inside zero.Init, one partition a rank.
        zero3 = HfDeepSpeedConfig(config)
    torch.manual_seed(cfg.train.seed)
    # Built in the training dtype and left where it was built: DeepSpeed moves it to the device, or
    # under ZeRO-3 zero.Init already put each rank's partition there.
    if cfg.model.lora.enabled:  # seeded above: the same fresh adapters in every process
        model = adapted_student(policy, base, cfg.model, device=device, dtype=dtype)
    else:
        model = load_causal_lm(policy, cfg.model, device=device, dtype=dtype, place=False)
    model.config.use_cache = False
    if cfg.model.freeze_vision and is_vision_model(policy):
        freeze_all_but_language_model(model)
    if uses_checkpointing(cfg, base or policy, gpu_memory(), ranks=world):  # as init estimated it for this many ranks
        enable_checkpointing(model)
    if cfg.train.fused_output and cfg.train.zero_stage != 3:  # the fused loss's memory (fused_output's docstring)
        sparse_tied_lookup(model)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config
    )
    if world == 1 and cfg.train.zero_stage == 0 and dtype == torch.float32:
        # One rank has nothing to all-reduce, yet DeepSpeed's fallback would flatten every gradient into
        # one buffer at each step's end to do it: a transient copy of the model (0.5 GB at 135M) on the
        # step's memory peak. (Dividing by a world of 1 and copying back change no bit of the gradients.)
        engine.enable_backward_allreduce = False
    if zero3 is not None:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        # Its work is done once the model is partitioned. Left set, every later from_pretrained in this
        # process (score's modules in `gndpo run`, which keeps this engine across rounds) would build a
        # partitioned module that only this engine's hooks can gather, and fail in its first forward.
        unset_hf_deepspeed_config()
    return engine, config
