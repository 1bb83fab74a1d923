"""Train's outputs for the next round: the updated student, and the EMA teacher beside it.

The student is written in Hugging Face format in the model's training dtype (bf16 on GPUs); under
ZeRO-3 the partitions are gathered layer by layer onto rank 0 first. Beside it goes the probe the next
round's rollout engine must reproduce (:mod:`gndpo.stages.models.probe`). Rank 0 uploads; every rank
takes part in what is collective (the ZeRO-3 gather, the probe's forward).
"""

from __future__ import annotations

from gndpo.dist import Dist
from gndpo.stages.models.loading import is_vision_model, load_tokenizer
from gndpo.stages.models.logprobs import output_width
from gndpo.stages.models.lora import ADAPTER_DIR, has_adapters, policy_state_dict, save_adapter
from gndpo.stages.models.probe import probe_logprobs, write_probe
from gndpo.stages.models.vision import load_processor
from gndpo.stages.training.ema import EmaWeights
from gndpo.storage.products import FileRecord


def export_student(engine, policy: str, fs, out_dir: str, zero_stage: int, dist: Dist, pad_id: int) -> list[FileRecord]:
    """``out_dir/model``: the trained student with its probe; collective. Returns the file records on
    rank 0, [] elsewhere."""
    files = []
    with fs.staging_dir(f"{out_dir}/model") as tmp:
        save_hf_folder(engine, policy, tmp, zero_stage, dist.rank)
        # Every rank runs the probe's forward, as ZeRO-3 gathers weights collectively.
        probe = probe_student(engine.module, policy, pad_id)
        if dist.main:
            write_probe(tmp, probe)
            files = fs.move_dir_in(tmp, f"{out_dir}/model")
    return files


def save_hf_folder(engine, policy: str, folder: str, zero_stage: int, rank: int) -> None:
    """Write the trained student to ``folder`` (on rank 0) in Hugging Face format; collective under
    ZeRO-3, where rank 0 receives the gathered 16-bit weights."""
    whole = None
    if zero_stage == 3:
        import deepspeed

        whole = engine._zero3_consolidated_16bit_state_dict()  # collective: every rank must call it
        # Merging adapters gathers each adapted layer: collective as well.
        state = policy_state_dict(engine.module, whole, deepspeed.zero.GatheredParameters)
    else:
        state = policy_state_dict(engine.module) if rank == 0 else None
    if rank == 0:
        state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        engine.module.save_pretrained(folder, state_dict=state, safe_serialization=True)
        save_preprocessing(policy, folder)
        if has_adapters(engine.module):  # what a later train continues (model.lora)
            save_adapter(engine.module, f"{folder}/{ADAPTER_DIR}", whole)


def save_preprocessing(policy: str, folder: str) -> None:
    """Beside exported weights, what turns inputs into ids and tensors: the policy's tokenizer, and for
    a vision-language model its whole processor (image processor, chat template)."""
    (load_processor(policy) if is_vision_model(policy) else load_tokenizer(policy)).save_pretrained(folder)


def probe_student(model, policy: str, pad_id: int) -> dict:
    """The probe's log-probs under the trained weights, in eval mode; every submodule's mode is restored
    as it was (train marks only its checkpointed layers as training: ``model.train(was_training)`` would
    reset them, and a kept engine's later rounds would recompute nothing)."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        processor = load_processor(policy) if is_vision_model(policy) else None
        return probe_logprobs(model, min(len(load_tokenizer(policy)), output_width(model)), pad_id, processor)
    finally:
        for module, training in modes.items():
            module.training = training


def export_ema(ema: EmaWeights, module, policy: str, fs, out_dir: str) -> list[FileRecord]:
    """``out_dir/ema``: the average as a Hugging Face folder, the next round's EMA teacher (rank 0 only)."""
    with fs.staging_dir(f"{out_dir}/ema") as tmp:
        ema.export(module, tmp)
        save_preprocessing(policy, tmp)
        return fs.move_dir_in(tmp, f"{out_dir}/ema")
