"""Loading tokenizers and models onto this process's device, reading a model's config, and the
same-tokenizer check.

Models are loaded in ``model.dtype`` on the device :mod:`gndpo.stages.models.device` picks; the per-token
log-prob computation that score and train share lives in :mod:`gndpo.stages.models.logprobs`.

A user's mistake (a path that does not exist, a folder that holds no model, a model folder without
weights) is refused in one line before a library is asked. Anything the library then raises (an
out-of-memory, a library bug, an unsupported architecture) is a GndpoError raised *from* it, so
``--log-level debug`` shows the cause's traceback.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import torch
from safetensors import safe_open

from gndpo.errors import GndpoError, whole_message
from gndpo.pipeline.settings.schema import ModelConfig
from gndpo.stages.models.device import attn_implementation, local_device, resolve_dtype
from gndpo.storage.meter import phase

# Files that make a folder a model folder to transformers (a model's config, or a tokenizer's).
MODEL_FOLDER_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")
CROSS_TOKENIZER_HINT = "to distil across tokenizers, set score.cross_tokenizer: true (log-probs matched by character offsets)"
# Weight files transformers' from_pretrained reads (sharded checkpoints are named like these too).
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.h5", "*.msgpack", "*.ckpt.index")


# Within :func:`read_once`: each folder's tokenizer and config, read once ({(kind, folder): value}).
_READ_ONCE: ContextVar[dict | None] = ContextVar("gndpo_read_once", default=None)


@contextmanager
def read_once():
    """Within the block, each model folder's tokenizer and config are read from disk once and shared:
    `gndpo init`'s checks ask for the same models' tokenizers and configs many times, and the folders do
    not change while they run. The tokenizers must not be modified."""
    token = _READ_ONCE.set({})
    try:
        yield
    finally:
        _READ_ONCE.reset(token)


def _once(kind: str, path: str, read):
    """``read()``, or inside :func:`read_once` the value it gave for ``(kind, path)`` before."""
    memo = _READ_ONCE.get()
    if memo is None:
        return read()
    key = (kind, str(Path(path).resolve()))
    if key not in memo:
        memo[key] = read()
    return memo[key]


def _check_model_folder(path: str) -> None:
    """Refuse, in one line, a path that does not exist or a folder that holds no model."""
    folder = Path(path)
    if not folder.exists():
        raise GndpoError(f"model path does not exist: {path}")
    if folder.is_dir() and not any((folder / name).is_file() for name in MODEL_FOLDER_FILES):
        raise GndpoError(f"not a model folder (no {' or '.join(MODEL_FOLDER_FILES)}): {path}")


def has_weights(path: str) -> bool:
    """Whether the local folder ``path`` holds model weights (a hub snapshot of a served teacher has none)."""
    folder = Path(path)
    return folder.is_dir() and any(next(folder.glob(pattern), None) for pattern in WEIGHT_PATTERNS)


def check_model_files(path: str) -> None:
    """Refuse, in one line, a local model folder that a causal LM cannot be loaded from: missing, no
    config.json, or no weights (a tokenizer-only folder, an interrupted download)."""
    _check_model_folder(path)
    folder = Path(path)
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise GndpoError(f"not a model folder (no config.json): {path}")
        if not has_weights(path):
            raise GndpoError(f"no model weights in {path} (no {', '.join(WEIGHT_PATTERNS)} file)")
        check_safetensors_files(folder)


def check_safetensors_files(folder: Path) -> None:
    """Refuse, in one line, a safetensors checkpoint that cannot load: a shard its index names but the
    folder lacks, or a file whose header does not parse or whose tensors run past its end (a truncated
    download or copy). Reads only the headers, so it costs milliseconds however large the model."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, AttributeError) as exc:
            raise GndpoError(f"{index} is not a safetensors index (no weight_map): {whole_message(exc)}") from None
        if missing := sorted(s for s in shards if not (folder / s).is_file()):
            raise GndpoError(f"{folder}: {index.name} names {len(missing)} missing weight file(s), first {missing[0]}")
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as exc:  # safetensors' own error type: a header it cannot read
            raise GndpoError(f"{file} cannot be loaded ({whole_message(exc)}): the file is truncated or corrupt; "
                             "download or convert it again") from None


def parameter_count(path: str) -> int | None:
    """The number of weights in ``path``'s safetensors files, read from their headers (milliseconds at
    any size); None for a folder without safetensors weights."""
    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        return None
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total


def load_tokenizer(path: str):
    """The tokenizer of the model folder ``path`` (never remote code); one-line GndpoErrors for a
    missing or empty folder and for what the library cannot read."""
    from transformers import AutoTokenizer

    _check_model_folder(path)

    def read():
        try:
            return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        except Exception as exc:
            raise GndpoError(f"cannot load a tokenizer from {path}: {whole_message(exc)}") from exc

    return _once("tokenizer", path, read)


@phase("load")  # `gndpo status --phases`: the time a unit spends loading models
def load_causal_lm(path: str, model_cfg=None, device: torch.device | None = None, dtype: torch.dtype | None = None,
                   place: bool = True):
    """A causal LM (an image-text-to-text one where the config has a vision tower) from ``path`` in
    ``model.dtype`` with ``model.attn_implementation``, on ``device`` (default: this process's): a GPU's
    weights are read straight onto it, not built in host memory first (8 score workers of a node would
    each hold an 8B teacher there, about 150 GB). ``place=False`` leaves it where it was built: train
    hands the model to DeepSpeed, which places it, or under ZeRO-3 has already partitioned it onto the
    devices."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    model_cfg = model_cfg or ModelConfig()
    device = device or local_device()
    dtype = dtype or resolve_dtype(model_cfg.dtype, device)
    check_model_files(path)
    auto = AutoModelForImageTextToText if is_vision_model(path) else AutoModelForCausalLM
    onto = {"device_map": {"": device}} if place and device.type == "cuda" else {}
    try:
        model = auto.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation(model_cfg.attn_implementation), trust_remote_code=False, **onto
        )
    except Exception as exc:
        raise GndpoError(f"cannot load a model from {path}: {whole_message(exc)}") from exc
    return model.to(device) if place and not onto else model


def model_config(path: str) -> dict:
    """The model's Hugging Face config as a dict: its ``config.json``, or, for a hub id or a folder
    transformers knows how to read otherwise, what ``AutoConfig`` reads."""
    return _once("config", path, lambda: _read_model_config(path))


def _read_model_config(path: str) -> dict:
    local = Path(path) / "config.json"
    if local.is_file():
        try:
            return json.loads(local.read_text())
        except ValueError:
            raise GndpoError(f"corrupt model config: {local}") from None
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path, trust_remote_code=False).to_dict()
    except Exception as exc:
        raise GndpoError(f"cannot read the model config of {path}: {whole_message(exc)}") from exc


def architecture_parameter_count(path: str) -> int:
    """The number of weights ``path``'s architecture has, from its config alone: the model is built on
    the meta device (no memory, no weights read), so a login node sizes an 8B model in a second."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    def count() -> int:
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=False)
            auto = AutoModelForImageTextToText if is_vision_model(path) else AutoModelForCausalLM
            with torch.device("meta"):
                model = auto.from_config(config)
        except Exception as exc:
            raise GndpoError(f"cannot build the architecture of {path} from its config: {whole_message(exc)}") from exc
        return sum(p.numel() for p in model.parameters())  # tied weights once

    return _once("parameters", path, count)


def is_vision_model(path: str) -> bool:
    """Whether the model at ``path`` reads images (its config has a vision tower)."""
    return "vision_config" in model_config(path)


def placeholder_ids(config: dict) -> frozenset:
    """The token ids a vision-language model's config reserves for image (and video) features: only the
    processor may put them in a sequence (a sampled one would ask the forward for a picture it lacks)."""
    names = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
    return frozenset(v for v in (config.get(n) for n in names) if isinstance(v, int) and not isinstance(v, bool))


def unsampleable(path: str) -> dict[int, float] | None:
    """vLLM's ``logit_bias`` that keeps a model from sampling its placeholder tokens (None for text)."""
    return {i: -1e4 for i in placeholder_ids(model_config(path))} or None


def vocabulary_size(path: str) -> int:
    """The width of the model's output layer: ``vocab_size`` of its config (or of its ``text_config``)."""
    config = model_config(path)
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise GndpoError(f"the config of {path} names no vocab_size")
    return size


def check_same_tokenizer(student: str, teacher: str) -> None:
    """Refuse a teacher whose token-to-id map, size or model vocabulary differs from the student's."""
    s_tok, t_tok = load_tokenizer(student), load_tokenizer(teacher)
    if s_tok.get_vocab() != t_tok.get_vocab() or len(s_tok) != len(t_tok):
        raise GndpoError(
            f"teacher tokenizer differs from the student's ({len(t_tok)} vs {len(s_tok)} tokens, "
            f"different token-to-id map): {teacher} vs {student}; {CROSS_TOKENIZER_HINT}"
        )
    s_vocab, t_vocab = vocabulary_size(student), vocabulary_size(teacher)
    if s_vocab != t_vocab:
        raise GndpoError(f"teacher vocab_size {t_vocab} differs from the student's {s_vocab}; {CROSS_TOKENIZER_HINT}")
