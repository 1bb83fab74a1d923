"""Where models run and in what precision: decided here, once, for score, train and vLLM.

A process uses the CUDA device of its local rank (:class:`gndpo.dist.Dist`: LOCAL_RANK, set by
torchrun and by ``gndpo run``'s per-GPU workers, which pin one GPU each with CUDA_VISIBLE_DEVICES) when
CUDA is present, else the CPU.
``model.dtype: auto`` means bf16 on a GPU that supports it and fp32 everywhere else: CPU matmuls in bf16
are slower than fp32 on most CPUs, and fp32 keeps the CPU toy's numbers exact.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from functools import lru_cache

import torch

from gndpo.dist import Dist, usable_cpus

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def available_memory() -> int | None:
    """Memory this machine can give a new process without swapping (Linux's MemAvailable); None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def free_memory(device: torch.device) -> int | None:
    """Bytes a model loaded on ``device`` can take now: the GPU's free memory, or the host's available."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory()


@lru_cache(maxsize=None)
def local_device() -> torch.device:
    """This process's device, chosen once: cuda:<its local rank> (:class:`Dist`, modulo the visible GPUs)
    when CUDA is present, else cpu."""
    if torch.cuda.is_available():
        index = Dist.from_env().local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """The torch dtype for ``model.dtype`` / ``engine.dtype`` on ``device`` (default: the local one)."""
    device = device or local_device()
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return DTYPES[name]  # one of Precision's choices: the config was checked when it was read


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def flash_attn_installed() -> bool:
    """Whether the flash-attn package is importable here (without importing it: it loads CUDA)."""
    return importlib.util.find_spec("flash_attn") is not None


def flash_attention_blocker() -> str:
    """Why flash_attention_2 cannot run in this process ("" where it can): the flash-attn package, which
    the gpu extra does not install (it builds against the local CUDA), or a CUDA GPU is missing."""
    if not flash_attn_installed():
        return "the flash-attn package is not installed (pip install flash-attn)"
    if local_device().type != "cuda":
        return "this machine has no CUDA GPU"
    return ""


def attn_implementation(name: str) -> str:
    """The attention kernel to ask transformers for (one of the schema's choices): ``name``, except
    flash_attention_2 where this process cannot run it (:func:`flash_attention_blocker`), which gets
    sdpa and a one-line warning, once: a config written for GPU nodes with flash-attn still runs where
    it is missing, as the schema's default (sdpa) would."""
    if name == "flash_attention_2" and (reason := flash_attention_blocker()):
        _warn_once(f"model.attn_implementation flash_attention_2: {reason}; using sdpa")
        return "sdpa"
    return name


@lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logging.getLogger("gndpo").warning(message)


def gpu_memory() -> int | None:
    """The memory of this machine's first visible GPU in bytes; None without one."""
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def device_memory() -> int:
    """The memory the models of this process compute in, in bytes: the first visible GPU's, else the
    machine's."""
    return gpu_memory() or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def visible_gpus() -> int:
    """GPUs this process may use (0 on a machine without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# oneDNN's linear is an internal op of torch (the one its CPU inductor backend calls): where a torch
# build lacks it, the logits come from ``mm`` as on any other device.
ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def vocabulary_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden`` [n, H] times an output layer's ``weight`` [V, H] transposed, in float32 at least, for
    the no-autograd computations over a vocabulary (score's log-probs, the fused train loss's logits).

    The kernel is chosen by device: on CUDA in bf16/fp16 the product is accumulated and returned in
    float32 (logits rounded to bf16 first cost 4-23% of the gradient: Liger Kernel issue #1432; not yet
    run on a GPU here); on the CPU in float32, oneDNN's linear, which runs this short-K, very wide
    product (K = H, N = V) at 1.3-1.6x MKL's ``mm`` at a 262k vocabulary (bench/output_layer.py)."""
    if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    if hidden.device.type == "cpu" and hidden.dtype == weight.dtype == torch.float32 and ONEDNN_LINEAR is not None:
        return ONEDNN_LINEAR(hidden.contiguous(), weight, None, "none", [], "")
    z = torch.mm(hidden, weight.t())
    return z.to(torch.promote_types(z.dtype, torch.float32))


def set_cpu_threads() -> None:
    """Use the cores we were given (GNDPO_THREADS, else the CPUs this process may run on); torch's
    default may oversubscribe a small machine."""
    n = int(os.environ.get("GNDPO_THREADS", "0")) or usable_cpus()
    torch.set_num_threads(n)
