"""Each stage's GPU memory, estimated at `gndpo init` from the model sizes, the batch budgets and the GPU
(the one this machine has, or ``gndpo init --gpu-memory 80GiB`` on a login node), and the sizes refused
there instead of running out of memory on the GPU node; and whether train checkpoints its layers'
activations where ``train.gradient_checkpointing`` is auto (:func:`uses_checkpointing`, which init and
train ask alike).

The rates are the device check's measurements (bench/results/gpu_check.md: one H200, bf16, a random
Qwen3-1.7B-shaped student, ZeRO-0, sdpa), scaled by the model's shape:

* train's DeepSpeed engine holds ``ENGINE_BYTES`` a parameter (bf16 weights, fp32 master weights and
  AdamW's two fp32 moments; measured 14.1), its gradients 2 more between micro-batches, and building it
  or taking a step briefly ``TRANSIENT_BYTES`` a parameter (measured 24.0 and 24.05, the step with
  torch's multi-tensor AdamW; the fused AdamW train now builds holds no parameter-sized temporaries in
  its step, so the build sets this peak until a GPU measures the step again); the optimizer's
  share divides by the train ranks under ZeRO-1 and above, the gradients under ZeRO-2 and above, the
  weights under ZeRO-3 (DeepSpeed's partitioning; only ZeRO-0 was measured);
* the activations kept for backward: ``ACTIVATION_BYTES`` per hidden unit, layer and position (3.2 MiB
  a position at hidden 2048 and 28 layers); with gradient checkpointing each layer's input (2 bytes a
  hidden unit) and one layer's activations, recomputed in backward; with ``train.fused_output`` also
  one logits buffer of the logits budget and the output layer's weight gradient (bf16, V x H), held
  from the forward to the backward;
* score holds both models' weights and, per model, at most two logits buffers of the logits budget
  (``model.logits_budget_mib``; auto: 1/32 of the GPU, 256 MiB to 1 GiB); its no-grad forward one
  layer's activations for its batch;
* rollout's vLLM engine takes ``engine.gpu_memory_utilization`` of the GPU by design, and must fit the
  student's weights in it; ``rollout.backend: hf`` holds the student's weights, the keys and values of
  ``rollout.hf_batch`` sequences of the engine's context length (at most), a prefill's activations and
  three float32 [batch, V] buffers of the last position's log-probs.

``SLACK`` covers the short-lived buffers measured beside each peak. A stage above ``LIMIT`` of the GPU
is refused (the caching allocator held 6-12 GiB above the measured peaks, and CUDA's context 1.3 GiB);
above ``WARN`` it is a warning. Rollout's engine has never run on a GPU here, nor has anything on several
GPUs or below ZeRO-0's precision measured: these are estimates, printed with the GPU they assume.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Protocol

from gndpo.errors import GndpoError
from gndpo.pipeline.exec.stage import collective_ranks
from gndpo.pipeline.settings.schema import SELF_TEACHER, Config
from gndpo.stages.models.loading import architecture_parameter_count, model_config
from gndpo.stages.models.logprobs import logits_budget

GIB = 2**30
ENGINE_BYTES = 14.1  # per parameter: train's DeepSpeed engine at bf16 (2 weights + 12 optimizer), measured
GRAD_BYTES = 2.0  # per parameter: bf16 gradients, held between the micro-batches of a step
TRANSIENT_BYTES = 24.1  # per parameter: the engine's build and each optimizer step, measured (38.46 and 38.53 GiB at 1.72B)
ACTIVATION_BYTES = 58.5  # per hidden unit, layer and position kept for backward (bf16), measured
CHECKPOINT_BYTES = 2.0  # per hidden unit, layer and position: a checkpointed layer's input (bf16)
SLACK = 2 * GIB  # short-lived buffers beside each measured peak
LIMIT = 0.85  # of the GPU's memory: above it a stage is refused
WARN = 0.70  # above it, a warning
MIN_KV_CACHE = 1 * GIB  # vLLM needs room for some KV cache beside the weights


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of a model: its parameters, hidden size and layers; for a rollout on its
    own module, the width of a layer's keys (and of its values: key-value heads x head size), its
    vocabulary and its context."""

    parameters: int
    hidden: int
    layers: int
    kv_width: int = 0
    vocab: int = 0
    context: int = 0

    @classmethod
    def of(cls, path: str) -> Shape:
        config = model_config(path)
        text = config.get("text_config") or config
        hidden, heads = int(text["hidden_size"]), int(text.get("num_attention_heads") or 1)
        kv_width = int(text.get("num_key_value_heads") or heads) * int(text.get("head_dim") or hidden // heads)
        return cls(architecture_parameter_count(path), hidden, int(text["num_hidden_layers"]), kv_width,
                   int(text.get("vocab_size") or 0), int(text.get("max_position_embeddings") or 0))


class RolloutPlace(Protocol):
    """How rollout samples (a rollout backend's capabilities say it)."""

    engine: bool  # a vLLM engine, which takes engine.gpu_memory_utilization of the GPU


class TeacherPlace(Protocol):
    """Where score's teacher sits (a teacher backend's capabilities say it)."""

    weights_beside_student: bool  # its weights in score's process beside the student's
    engine: bool  # a vLLM engine of it in score's process, with score.engine's share of the GPU


@dataclass(frozen=True)
class StagePeak:
    """One stage's estimated peak on one GPU, with what to change where it does not fit."""

    stage: str
    bytes: float
    knobs: str
    how: str = ""  # how the stage runs where that decides its peak: " with gradient checkpointing"
    # The share an engine reserves up front (vLLM's engine.gpu_memory_utilization), not what the stage
    # needs: shown, never refused or warned about.
    reserved: bool = False


def parse_memory(text: str) -> int:
    """``80GiB``, ``80GB``, ``81559MiB`` or a number of GiB, as bytes; a one-line error otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(GiB|GB|MiB|MB|TiB|TB)?\s*", text)
    if match is None:
        raise GndpoError(f"--gpu-memory {text!r}: write a size such as 80GiB, 80GB or 81559MiB")
    scale = {"GiB": GIB, "GB": 1e9, "MiB": 2**20, "MB": 1e6, "TiB": 2**40, "TB": 1e12, None: GIB}[match[2]]
    return int(float(match[1]) * scale)


def train_ranks(cfg: Config, gpus: int) -> int:
    """Train's ranks on a node of ``gpus`` GPUs, as `gndpo run` launches them (:func:`collective_ranks`)."""
    return collective_ranks(cfg.train.num_processes, gpus)


def train_peak(cfg: Config, student: Shape, gpu: int, checkpointing: bool, ranks: int = 1) -> StagePeak:
    """Train's peak on one of ``ranks`` ranks, with or without gradient ``checkpointing``: the engine
    with the activations of a full micro-batch, or its build and optimizer step, whichever is larger;
    its advice names the micro-batch that would fit ``gpu``. ZeRO-1 splits the optimizer state over the
    ranks, ZeRO-2 the gradients too, ZeRO-3 the weights too."""
    train_cfg = cfg.train
    optimizer = (ENGINE_BYTES - 2) / (ranks if train_cfg.zero_stage >= 1 else 1)
    weights = 2 / (ranks if train_cfg.zero_stage == 3 else 1)
    gradients = GRAD_BYTES / (ranks if train_cfg.zero_stage >= 2 else 1)
    engine = student.parameters * (weights + optimizer)
    positions = train_cfg.max_tokens_per_batch
    if checkpointing:
        per_position = student.hidden * (CHECKPOINT_BYTES * student.layers + ACTIVATION_BYTES)
    else:
        per_position = student.hidden * ACTIVATION_BYTES * student.layers
    # The fused output layer's chunk of fp32 logits beyond the 256 MiB chunk the measured peaks held, and
    # its bf16 weight gradient, held from the forward to the backward.
    output_layer = max(logits_budget(cfg.model, gpu) - 2**28, 0) + 2 * student.vocab * student.hidden if train_cfg.fused_output else 0
    forward = engine + student.parameters * gradients + positions * per_position + output_layer + SLACK
    transient = student.parameters * (TRANSIENT_BYTES - ENGINE_BYTES) / (ranks if train_cfg.zero_stage >= 1 else 1)
    fitting = int((LIMIT * gpu - (forward - positions * per_position)) // per_position)
    knobs = f"set train.max_tokens_per_batch to at most {fitting}" if fitting >= 1024 else "train on more GPUs with train.zero_stage 2 or 3"
    if not checkpointing:
        knobs += ", or train.gradient_checkpointing: true"
    how = (f" on {ranks} ranks (ZeRO-{train_cfg.zero_stage})" if ranks > 1 else "") + (" with gradient checkpointing" if checkpointing else "")
    return StagePeak("train", max(forward, engine + transient), knobs, how)


def uses_checkpointing(cfg: Config, student: str, gpu: int | None, ranks: int = 1) -> bool:
    """Whether train on ``ranks`` ranks recomputes activations in backward for ``student`` (a model
    folder) on GPUs of ``gpu`` bytes (None: no GPU): ``train.gradient_checkpointing`` where it is true
    or false; with auto, only where train's estimated peak without it is above ``WARN`` of the GPU (a
    third more compute buys room no smaller model needs, and the CPU demo keeps its numbers). Init and
    train ask it with the same ranks (init: :func:`train_ranks` of the GPUs `gndpo run` will use)."""
    setting = cfg.train.gradient_checkpointing
    if setting != "auto":
        return setting
    return gpu is not None and train_peak(cfg, Shape.of(student), gpu, checkpointing=False, ranks=ranks).bytes > WARN * gpu


def score_peak(cfg: Config, student: Shape, teachers: list[Shape], gpu: int, where: TeacherPlace) -> StagePeak:
    """Score's peak: the student's and (teachers beside it) the teachers' weights, their logits
    buffers, a batch's activations; a teacher's engine in the process takes its share of the GPU."""
    score_cfg, budget = cfg.score, logits_budget(cfg.model, gpu)
    on_modules = teachers if where.weights_beside_student else []
    weights = 2 * (student.parameters + sum(t.parameters for t in on_modules))
    buffers = 2 * budget * (1 + len(on_modules))
    widest = max([student.hidden, *(t.hidden for t in on_modules)])
    engine = score_cfg.engine.gpu_memory_utilization * gpu if where.engine else 0
    total = weights + buffers + score_cfg.max_tokens_per_batch * widest * ACTIVATION_BYTES + SLACK + engine
    return StagePeak("score", total, "lower score.max_tokens_per_batch or model.logits_budget_mib" +
                     (", or score.engine.gpu_memory_utilization" if engine else ""))


def rollout_peak(cfg: Config, student: Shape, gpu: int, sampler: RolloutPlace) -> StagePeak:
    """Rollout's peak: a vLLM engine's share of the GPU, which must hold the student's weights and some
    KV cache; or the student's module decoding ``rollout.hf_batch`` sequences of at most the engine's
    context (engine.max_model_len, else the model's)."""
    if not sampler.engine:
        rows, positions = cfg.rollout.hf_batch, cfg.engine.max_model_len or student.context
        kv_cache = 2 * student.layers * student.kv_width * 2 * rows * positions
        logprobs = 3 * 4 * rows * student.vocab
        total = 2 * student.parameters + kv_cache + rows * positions * student.hidden * ACTIVATION_BYTES + logprobs + SLACK
        return StagePeak("rollout", total, "lower rollout.hf_batch or engine.max_model_len")
    share = cfg.engine.gpu_memory_utilization * gpu
    if 2 * student.parameters + MIN_KV_CACHE > share:
        raise GndpoError(f"rollout: the student's weights ({2 * student.parameters / GIB:.1f} GiB in bf16) leave no room for a KV cache "
                         f"in vLLM's share of the GPU ({share / GIB:.1f} GiB, engine.gpu_memory_utilization {cfg.engine.gpu_memory_utilization}): "
                         "raise engine.gpu_memory_utilization, or use a larger GPU")
    return StagePeak("rollout", share, "lower engine.gpu_memory_utilization", reserved=True)


def estimate_stages(cfg: Config, gpu: int, where: TeacherPlace, sampler: RolloutPlace, ranks: int = 1) -> list[StagePeak]:
    """Rollout's, score's and train's peaks for ``cfg`` (models as local folders) on a GPU of ``gpu``
    bytes, the teacher in score's process as ``where`` says, rollout sampling as ``sampler`` says, train
    on ``ranks`` ranks."""
    student = Shape.of(cfg.student)
    teachers = [student] if cfg.teacher == SELF_TEACHER else [Shape.of(p) for p in cfg.teacher_models().values()]
    checkpointing = uses_checkpointing(cfg, cfg.student, gpu, ranks)
    return [rollout_peak(cfg, student, gpu, sampler), score_peak(cfg, student, teachers, gpu, where),
            train_peak(cfg, student, gpu, checkpointing, ranks)]


def check_gpu_memory(cfg: Config, gpu: int | None, where: TeacherPlace, sampler: RolloutPlace, ranks: int = 1) -> list[StagePeak]:
    """Estimate every stage on a GPU of ``gpu`` bytes (None: no GPU known here, nothing checked), train
    on ``ranks`` ranks, the teacher in score's process as ``where`` says (its backend's capabilities),
    rollout as ``sampler`` says (its backend's): one
    line of the estimates, a one-line refusal naming the stage that does not fit and what to change, a
    warning for one above ``WARN`` of the GPU."""
    if gpu is None:
        return []
    peaks = estimate_stages(cfg, gpu, where, sampler, ranks)
    line = ", ".join(f"{p.stage}{p.how} {p.bytes / GIB:.1f}" for p in peaks)
    for peak in peaks:
        if not peak.reserved and peak.bytes > LIMIT * gpu:
            raise GndpoError(f"{peak.stage} needs about {peak.bytes / GIB:.1f} GiB of the GPU's {gpu / GIB:.1f} GiB (estimated per stage: {line} GiB; "
                             f"at most {LIMIT:.0%} fits beside the allocator's cache): {peak.knobs}")
        if not peak.reserved and peak.bytes > WARN * gpu:
            logging.getLogger("gndpo").warning(f"{peak.stage} needs about {peak.bytes / GIB:.1f} GiB of the GPU's {gpu / GIB:.1f} GiB: {peak.knobs}")
    logging.getLogger("gndpo").info(f"GPU memory per stage, estimated for a {gpu / GIB:.1f} GiB GPU: {line} GiB")
    return peaks
