"""GGUF files to Hugging Face folders, the form gndpo's stages (and vLLM) read.

transformers dequantizes a GGUF file's tensors to float (through the ``gguf`` package) but refuses to
``save_pretrained`` a model it loaded that way, so :func:`convert_gguf` builds a plain model from the
same config (without its quantization entry) and loads the dequantized state dict into it, strictly.
The tokenizer keeps what transformers' GGUF conversion drops: the GGUF's ``add_bos_token`` (Gemma's
prompts must start with ``<bos>``; without it the model writes garbage) and its chat template. A
model without a chat template (a base model) is said so. ``info.json`` records the source's sha256.
The written folder loads without the ``gguf`` package.

torch, transformers and gguf are imported where they are used: `gndpo convert`'s module (and the
packaged-model list it shows in its help) imports this one when the CLI registers its commands, which
must not load torch.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from gndpo.errors import GndpoError, first_line
from gndpo.pipeline.observe.logs import info
from gndpo.storage.runfs import file_sha256

INSTALL_HINT = "pip install 'gndpo[real-models]' (or: make real-models)"
CONVERTER_VERSION = 1  # bumped when a converted folder's files change for the same GGUF


def gguf_metadata(path: Path) -> dict:
    """The GGUF's tokenizer settings that transformers' conversion may drop (scalar entries only)."""
    from gguf import GGUFReader  # the optional real-models extra; checked by read_gguf_metadata first

    fields = GGUFReader(str(path)).fields
    wanted = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.chat_template", "general.name")
    return {key: fields[key].contents() for key in wanted if key in fields}


def read_gguf_metadata(path: Path) -> dict:
    """:func:`gguf_metadata` of a file checked to exist and be GGUF; one-line GndpoErrors otherwise."""
    if not path.is_file():
        raise GndpoError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GndpoError(f"{path} is not a GGUF file (it does not begin with the GGUF magic bytes)")
    if importlib.util.find_spec("gguf") is None:
        raise GndpoError(f"reading GGUF files needs the gguf package: {INSTALL_HINT}")
    try:
        return gguf_metadata(path)
    except (ValueError, OSError, EOFError) as exc:  # gguf's reader: bad magic, a truncated file
        raise GndpoError(f"{path} is not a readable GGUF file ({first_line(exc, with_type=True)})") from None


def load_gguf(path: Path, dtype=None):
    """(tokenizer, model) as transformers reads ``path``: GGUF tensors dequantized to ``dtype`` (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype or torch.float32)
    return tokenizer, model.eval()


def plain_model(quantized, name: str):
    """A float32 model of ``quantized``'s architecture holding its dequantized weights, which
    ``save_pretrained`` accepts (one shared tensor where the embeddings are tied)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the plain model must not claim to be GGUF-quantized
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = quantized.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # one tensor: the embedding, which the tied head shares
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise GndpoError(f"converting {name}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    return model


def restore_tokenizer_settings(tokenizer, meta: dict, name: str) -> str | None:
    """Give ``tokenizer`` back what the GGUF says and transformers' conversion dropped (adding BOS, the
    chat template) and a pad token; returns the chat template (None for a base model without one)."""
    if meta.get("tokenizer.ggml.add_bos_token", False) and not _adds_bos(tokenizer):
        tokenizer.add_bos_token = True
        if not _adds_bos(tokenizer):
            raise GndpoError(f"converting {name}: cannot make the tokenizer add {tokenizer.bos_token} as the GGUF says")
    template = meta.get("tokenizer.chat_template") or tokenizer.chat_template
    if template:
        tokenizer.chat_template = template
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return template or None


def convert_gguf(path: Path, out: Path, log=info) -> dict:
    """Write a plain Hugging Face folder for the GGUF file ``path`` into ``out`` (weights as float32
    safetensors, tokenizer, chat template, generation config, ``info.json``); returns the info."""
    path, out = Path(path), Path(out)
    meta = read_gguf_metadata(path)
    log(f"converting {path.name}: dequantizing its tensors")
    try:
        tokenizer, quantized = load_gguf(path)
    except Exception as exc:  # an architecture or quantization transformers cannot read
        raise GndpoError(f"transformers cannot load {path.name}: {first_line(exc, with_type=True)}") from exc
    model = plain_model(quantized, path.name)
    template = restore_tokenizer_settings(tokenizer, meta, path.name)
    if template is None:
        log(f"{path.name} has no chat template (a base model): use data.chat_template none, or add one to {out}/tokenizer_config.json")
    for special in ("bos", "eos", "pad"):
        setattr(model.generation_config, f"{special}_token_id", getattr(tokenizer, f"{special}_token_id"))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    config = model.config
    details = {
        "source": path.name,
        "source_sha256": file_sha256(path),
        "converter_version": CONVERTER_VERSION,
        "architecture": config.architectures[0] if config.architectures else type(model).__name__,
        "vocab_size": config.vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": template is not None,
        "name": meta.get("general.name", ""),
    }
    (out / "info.json").write_text(json.dumps(details, indent=1, sort_keys=True))
    log(f"converted {path.name} -> {out} ({details['parameters'] / 1e6:.0f}M parameters, vocabulary {config.vocab_size})")
    return details


def _adds_bos(tokenizer) -> bool:
    return tokenizer.bos_token_id is not None and tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]
