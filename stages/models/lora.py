"""LoRA students (``model.lora``): low-rank adapters injected into the student, and its weights merged.

The adapters are injected in place (PEFT's ``inject_adapter_in_model``), so the model stays the
transformers class every forward of gndpo already runs (the chunked output layer, shared prompts,
DeepSpeed), with each target linear layer computing ``W x + alpha / rank * B A x``. What leaves train:

* the merged weights, ``W + alpha / rank * B A`` in the base layer's own names
  (:func:`merged_state_dict`): the round's policy folder, which score (and rollout's engine with
  ``model.lora.serve: merged``) load like any other model;
* the adapters (:func:`save_adapter`), in PEFT's own format (``adapter_config.json``,
  ``adapter_model.safetensors``), which a later train loads onto the initial student
  (:func:`load_adapter`) to continue the same adapters, which rollout's engine serves with
  ``model.lora.serve: adapters`` (:func:`served_as_adapters`), and which ``PeftModel.from_pretrained``
  reads.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from gndpo.stages.models.loading import load_causal_lm

ADAPTER_DIR = "adapter"  # inside an exported policy folder
ADAPTER_NAME = "default"  # PEFT's name for a model's one adapter
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel's path to the wrapped model: its files' key prefix


def has_adapters(model) -> bool:
    return any(isinstance(m, LoraLayer) for m in model.modules())


def served_as_adapters(lc, cuda: bool) -> bool:
    """Whether rollout's vLLM engine runs the student as the base model plus the round's adapters
    (vLLM's LoRA; ``model.lora.serve``, whose auto means on a GPU): for ``model.lora`` runs whose only
    trained tensors are adapters. A fully trained output layer or embedding table is not an adapter vLLM
    takes: the engine then loads the merged weights."""
    wanted = lc.serve == "adapters" or (lc.serve == "auto" and cuda)
    return lc.enabled and wanted and not (lc.train_output_layer or lc.train_embeddings)


def add_adapters(model, lc, base_path: str) -> None:
    """Inject ``model.lora``'s adapters into ``model`` (B starts at zero, so the model computes what it
    did) and leave trainable only them, plus the output layer and embeddings where ``lc`` asks."""
    config = LoraConfig(r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout, bias="none", base_model_name_or_path=base_path,
                        target_modules=lc.target_modules[0] if lc.target_modules == ["all-linear"] else list(lc.target_modules))
    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    full = [model.get_output_embeddings()] * lc.train_output_layer + [model.get_input_embeddings()] * lc.train_embeddings
    trainable = {id(p) for m in full for p in m.parameters()}
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name or id(param) in trainable)


def adapted_student(policy: str, base: str, model_cfg, device, dtype):
    """The student train updates under ``model.lora``: ``base`` (the initial student) with the adapters
    the round's ``policy`` folder carries (its ``adapter/``), or fresh ones where it has none (round 0).
    Left where it was built, in ``dtype``, for DeepSpeed to place."""
    model = load_causal_lm(base, model_cfg, device=device, dtype=dtype, place=False)
    add_adapters(model, model_cfg.lora, base)
    if (Path(policy) / ADAPTER_DIR).is_dir():
        load_adapter(model, Path(policy) / ADAPTER_DIR)
    return model


def without_adapters(adapted):
    """The base model under ``adapted``'s adapters as a module of its own, with no second copy of its
    weights: a copy of the module tree that shares every base tensor with ``adapted`` and has its
    (copied, small) adapters switched off. The adapters' tensors are copied because PEFT's switch also
    marks them frozen, which must not reach ``adapted``'s. A layer ``model.lora`` trains in full (the
    output layer, the embeddings) is shared as it is now, no longer the base's: callers that want the
    initial student load it where ``lc.train_output_layer`` or ``lc.train_embeddings`` is set."""
    shared = {id(t): t for name, t in (*adapted.named_parameters(), *adapted.named_buffers()) if ".lora_" not in name}
    base = copy.deepcopy(adapted, memo=shared)
    for module in base.modules():
        if isinstance(module, LoraLayer):
            module.enable_adapters(False)
    return base


def merged_state_dict(model, state: dict | None = None, gathered=nullcontext) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every adapter merged into its base layer, under the base model's own
    names (``q_proj.weight``, not ``q_proj.base_layer.weight``); the adapter tensors left out. The
    model itself is not changed (PEFT's merge would, and unmerging does not restore the bits).

    Where the module holds partitions only (ZeRO-3), ``state`` is its whole state dict (DeepSpeed's
    consolidated one, on the rank that writes) and ``gathered`` a context over a list of parameters
    that gathers them (``deepspeed.zero.GatheredParameters``): each adapted layer is gathered in turn,
    on every rank, as the gather is collective."""
    merged = {}
    for prefix, module in model.named_modules():
        if isinstance(module, LoraLayer):
            with gathered(list(module.parameters())):
                weight = module.get_base_layer().weight
                merged[f"{prefix}.weight"] = (weight + module.get_delta_weight(ADAPTER_NAME).to(weight.dtype)).detach()
    out = {}
    for name, tensor in (model.state_dict() if state is None else state).items():
        if ".lora_" in name:
            continue
        plain = name.replace(".base_layer.", ".")
        out[plain] = merged.get(plain, tensor)
    return out


def policy_state_dict(model, state: dict | None = None, gathered=nullcontext) -> dict[str, torch.Tensor]:
    """The weights the policy exports: :func:`merged_state_dict` for a model with adapters, else its own
    (``state`` and ``gathered``: as there, for a partitioned module)."""
    if has_adapters(model):
        return merged_state_dict(model, state, gathered)
    return model.state_dict() if state is None else state


def save_adapter(model, folder: str | Path, state: dict | None = None) -> None:
    """The adapters in PEFT's format under ``folder`` (``PeftModel.from_pretrained`` reads them onto the
    initial student). A fully trained output layer or embedding table goes into the same file, under
    its name in the model. ``state``: the model's whole state dict where the module holds partitions
    only (ZeRO-3)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.peft_config[ADAPTER_NAME]
    whole = model.state_dict() if state is None else state
    state = get_peft_model_state_dict(model, state_dict=whole, adapter_name=ADAPTER_NAME)
    extra = {n: whole[n] for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    save_file({PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in {**state, **extra}.items()}, str(folder / WEIGHTS_FILE))
    config.save_pretrained(str(folder))


def load_adapter(model, folder: str | Path) -> None:
    """Set ``model``'s injected adapters (and fully trained layers) to those :func:`save_adapter` wrote;
    a ValueError if the file misses a trainable tensor of ``model`` or holds one it does not have."""
    state = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(Path(folder) / WEIGHTS_FILE)).items()}
    adapters = set(get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME))
    params = dict(model.named_parameters())
    full = {n for n, p in params.items() if p.requires_grad and "lora_" not in n}
    missing, unknown = sorted((adapters | full) - set(state)), sorted(set(state) - adapters - full)
    if missing or unknown:
        raise ValueError(f"{folder}: the adapters do not fit the model (missing {missing[:2]}, unknown {unknown[:2]})")
    set_peft_model_state_dict(model, {k: state[k] for k in adapters}, adapter_name=ADAPTER_NAME)
    with torch.no_grad():
        for name in full:
            with whole_for_writing(params[name]):
                params[name].copy_(state[name])


def whole_for_writing(param):
    """A context in which ``param`` holds its whole tensor and what is written to it reaches every
    rank's partition after: for a model built partitioned under ZeRO-3, where the adapters' fully
    trained layers are loaded into partitioned parameters; otherwise nothing to do."""
    if not hasattr(param, "ds_id"):
        return nullcontext()
    import deepspeed  # only a ZeRO-3 train gets here, and it has imported DeepSpeed long before

    return deepspeed.zero.GatheredParameters([param], modifier_rank=0)
