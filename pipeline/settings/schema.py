"""Experiment configuration: the schema, a tree of frozen dataclasses, one per section.

Every knob has a type, a default and a comment, and what a value may be is declared with it: a range
(``Annotated[float, Range(...)]``), a set of choices (``Literal[...]``) or the type of a list's or a
mapping's items. The package around it reads those declarations:

* :mod:`.validate` builds a Config from nested mappings (:func:`gndpo.pipeline.config.load.config_from_dict`),
  so an unknown key, a mistyped value, a value out of range or a choice that does not exist is a
  one-line error naming the key, given by ``gndpo init`` before anything is written;
* :mod:`.checks` refuses the settings that contradict each other;
* :mod:`.keys` lists every key with its type, default, bounds or choices and its comments (``gndpo
  config keys`` and the docs' reference), so the comments here are the keys' documentation;
* :mod:`.load` reads YAML files and overrides.

A Config is not changed once built (``dataclasses.replace`` makes another).
"""

from __future__ import annotations

import hashlib
import json
import string
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal, TypedDict


@dataclass(frozen=True)
class Range:
    """Bounds a numeric config value must respect (``ge``/``le`` inclusive, ``gt``/``lt`` exclusive),
    checked when the config is read, so a bad value is refused by ``gndpo init`` rather than hours later
    inside a stage."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def violation(self, value) -> str | None:
        ok = (
            (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt)
        )
        return None if ok else f"must be {self.describe()}"

    def describe(self) -> str:
        parts = [f"{w} {b:g}" for b, w in ((self.ge, ">="), (self.gt, ">"), (self.le, "<="), (self.lt, "<")) if b is not None]
        return " and ".join(parts)


Count = Annotated[int, Range(ge=1)]  # how many of something, at least one
NonNegativeInt = Annotated[int, Range(ge=0)]
Positive = Annotated[float, Range(gt=0)]
NonNegative = Annotated[float, Range(ge=0)]
Fraction = Annotated[float, Range(ge=0, le=1)]  # a share or a probability, 0 and 1 included


# Choices several settings share.
Precision = Literal["auto", "float32", "bfloat16", "float16"]  # auto: bf16 on a GPU that supports it, else fp32
AttnImplementation = Literal["sdpa", "eager", "flash_attention_2"]


class Turn(TypedDict):
    """One chat turn: {role: user, content: "..."}."""

    role: str
    content: str


@dataclass(frozen=True)
class DataConfig:
    """Prompt files and how a prompt becomes the text the student sees (gndpo.stages.text.chat)."""

    # Prompts for rollouts: a jsonl / parquet / csv file (any fsspec URL), a folder of Parquet shards or one
    # written by datasets' save_to_disk, or a dataset id in the datasets cache (hf:ORG/NAME, hf:ORG/NAME/CONFIG);
    # a folder or an id ends in @SPLIT to pick a split (data/gsm8k@test, hf:openai/gsm8k/main@train).
    train: str = ""
    # Evaluation prompts, in the same forms as train. Empty: with rollout.eval_heldout, heldout_share of
    # data.train's prompts (at most heldout_max, at least one) is held out, chosen by a hash of each prompt
    # (the same prompts in a fork, a resume or a re-init), and never trained on; without it, no held-out figure.
    heldout: str = ""
    heldout_share: Fraction = 0.02  # 0: hold nothing out of data.train (rounds log no held-out figure)
    heldout_max: Count = 256  # the most prompts held out of data.train
    prompt_key: str = "prompt"  # a plain prompt, wrapped as one user turn
    messages_key: str = "messages"  # or a list of {role, content} turns (system turn included)
    conversations_key: str = "conversations"  # or ShareGPT rows: {from, value} turns (from: human, gpt, system, tool)
    # The answer column; a dotted name reads a field of a struct column (geo3k: reward_model.ground_truth).
    answer_key: str = "answer"
    # Each row's images (a list, or one): paths relative to the prompts file, URLs, bytes, or datasets'
    # {bytes, path} structs; each placed by an <image> in the text or an image part of a turn.
    images_key: str = "images"
    # auto: the student's chat template (with add_generation_prompt) where it has one, else the plain
    # prompt text; none: always the plain prompt text.
    chat_template: Literal["auto", "none"] = "auto"
    system_prompt: str = ""  # a system turn put first where a prompt has none
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the template, e.g. {enable_thinking: false}
    # With several teachers (``teachers``) and score.teacher_mix route: the prompt-file column naming
    # each prompt's teacher.
    teacher_key: str = "teacher"


@dataclass(frozen=True)
class TipConfig:
    """Section 4: keep the most informative tokens (student entropy OR teacher-student KL)."""

    enabled: bool = False  # keep only the informative tokens (the method's loss on those alone)
    keep_ratio: Annotated[float, Range(gt=0, le=1)] = 0.5  # the share of each batch's tokens kept
    entropy_quantile: Fraction = 0.98  # h is capped at this batch quantile before min-max scaling


@dataclass(frozen=True)
class PacedConfig:
    """Section 5: weight each prompt by p^a (1-p)^b of its pass rate p this round."""

    enabled: bool = False  # weight prompts by their pass rate
    a: NonNegative = 1.0  # exponent of p
    b: NonNegative = 1.0  # exponent of 1 - p


@dataclass(frozen=True)
class TropdConfig:
    """Section 6 (interp): trust region on the speculative-decoding acceptance P = min(pi_T/pi_S, 1)."""

    base: Literal["opd", "gndpo"] = "gndpo"  # PG term on trusted tokens
    tau: Fraction = 1.0  # trusted when P >= tau
    tau_quantile: Annotated[float, Range(ge=-1, le=1)] = -1.0  # >= 0: tau is this quantile of P over the batch instead
    outlier: Literal["mask", "clip", "fkl"] = "fkl"  # untrusted tokens: no loss (mask), r_t clipped (clip) or forward KL (fkl)
    clip_value: float = -1.0  # clip mode: r_t <- max(r_t, clip_value)
    fkl_coef: NonNegative = 1.0  # fkl mode: weight (lambda) of forward_kl_topk on outlier tokens


@dataclass(frozen=True)
class EopdConfig:
    """Section 7: OPD plus forward KL on tokens where the teacher is uncertain."""

    entropy_threshold: NonNegative = 0.8  # nats; a token whose teacher entropy exceeds it also gets forward KL
    fkl_coef: NonNegative = 1.0  # weight of that forward KL (on the teacher's top-k)


@dataclass(frozen=True)
class ReopoldConfig:
    """Section 8: floored log-ratio reward, phase 1 masks below the floor, phase 2 keeps high entropy."""

    lam: Annotated[float, Range(gt=0, lt=1)] = 0.1  # floor = log(lam) / (1 - lam)
    switch_round: NonNegativeInt = 1  # rounds < switch_round are phase 1
    beta: Annotated[float, Range(gt=0, le=1)] = 0.2  # phase 2 keeps tokens with student entropy >= quantile_{1-beta}


@dataclass(frozen=True)
class OutcomeConfig:
    """Section 9: outcome rewards for GRPO / GDPO, and mixing an outcome advantage into distillation."""

    # Names in gndpo.pipeline.tasks.rewards; not given: the run's own ``reward`` (config_from_dict).
    rewards: list[str] = field(default_factory=lambda: ["exact_match"])
    weights: list[float] = field(default_factory=list)  # one per reward; empty = all 1
    gdpo_batch_norm: Literal["sequence", "token"] = "sequence"  # sequence (TRL) | token (verl)
    coef: float = 0.0  # distillation methods: A_t = A_dist_t + coef * A_GRPO_i (GRPO's advantage); 0 = off


@dataclass(frozen=True)
class MethodConfig:
    """Which method trains the student, and its knobs (formulas: docs/reference/methods.md).

    ``policy_loss`` and ``loss_agg`` left empty take the method's own default (``gndpo methods``)."""

    name: str = "gndpo"  # see gndpo.pipeline.methods.METHODS (checked there, by gndpo init)
    clamp: Positive = 5.0  # c_t = clamp(lpT - lpS, -clamp, clamp)
    # "" = the method's default; none = no policy-gradient term (the divergence methods' default)
    policy_loss: Literal["", "gspo", "ppo", "reinforce", "is", "none"] = ""
    loss_agg: Literal["", "seq-mean-token-mean", "token-mean"] = ""  # "" = the method's default
    clip_low: NonNegative = 0.2  # ppo / gspo: the importance ratio is clipped from below at 1 - clip_low
    clip_high: NonNegative = 0.2  # ppo / gspo: and from above at 1 + clip_high
    std_eps: Positive = 1e-8  # added to a variance before it divides (GNDPO's standardization, MiniLLM's whitening)
    # With several routed teachers: GNDPO's mean and std of c over the whole round (global) or over
    # each teacher's tokens (teacher), so a teacher whose scores run higher does not dominate.
    stats_scope: Literal["global", "teacher"] = "global"
    jsd_beta: Annotated[float, Range(gt=0, lt=1)] = 0.5  # jsd: the mixture M = beta teacher + (1 - beta) student
    schedule: str = ""  # divergence methods, e.g. "fkl:2,rkl:4": forward KL rounds 0-1, then reverse KL
    reward_beta: NonNegative = 0.0  # > 0: reward-weighted responses, w_i = B softmax(r_i / reward_beta)
    minillm_gamma: Annotated[float, Range(gt=0, le=1)] = 0.95  # minillm: discount of the per-token log-ratio returns
    # Top-k divergences: "bucket" compares the k teacher ids plus one "rest" bucket per model (1 - its
    # top-k mass), so student mass outside the teacher's top-k is paid for; "renormalized" compares both
    # models renormalized over the k ids (the student's tail is then free).
    topk_form: Literal["bucket", "renormalized"] = "bucket"
    # OPSD's point-wise clipping of top-k divergences: each bucket's contribution to the per-token
    # divergence (a teacher top-k id, or the rest) is clamped from above at this value before the sum,
    # so a few tokens (style words) cannot dominate the loss; 0 = off. Sampled-token methods have
    # method.clamp, the same idea on lpT - lpS.
    pointwise_clip: NonNegative = 0.0
    # Top-k divergences against a teacher of another tokenizer (score.cross_tokenizer): the weight of
    # the term that compares, sorted, the probabilities of teacher and student tokens with no twin of
    # the same text in the other vocabulary (ULD's distance), beside the bucket divergence on the rest.
    uld_weight: NonNegative = 1.0
    tip: TipConfig = field(default_factory=TipConfig)
    paced: PacedConfig = field(default_factory=PacedConfig)
    tropd: TropdConfig = field(default_factory=TropdConfig)
    eopd: EopdConfig = field(default_factory=EopdConfig)
    reopold: ReopoldConfig = field(default_factory=ReopoldConfig)
    outcome: OutcomeConfig = field(default_factory=OutcomeConfig)


SELF_TEACHER = "self"  # ``teacher: self``: the student model is its own teacher
RUN_TEACHER = "run:"  # ``teacher: run:RUN[@K]``: another run's trained policy (gndpo.pipeline.run.teacher_runs)


def split_run_teacher(teacher: str) -> tuple[str, str]:
    """(the run, the policy version as written or "") of a ``run:RUN[@K]`` teacher."""
    body = teacher[len(RUN_TEACHER):]
    run, at, version = body.rpartition("@")
    if not at or "/" in version:  # an "@" inside the run's URL itself, not a version
        return body, ""
    return run, version


@dataclass(frozen=True)
class SelfTeacherConfig:
    """``teacher: self`` (on-policy self-distillation): which weights of the student score its rollouts."""

    # frozen: the run's initial student (OPSD's default); live: the round's rollout policy; ema: an
    # exponential moving average of the student, updated by train after every optimizer step
    # (theta_ema <- ema_decay theta_ema + (1 - ema_decay) theta, starting from the initial student)
    # and exported beside each round's model.
    weights: Literal["frozen", "live", "ema"] = "frozen"
    ema_decay: Annotated[float, Range(gt=0, lt=1)] = 0.999  # weights ema: the average's decay per optimizer step


@dataclass(frozen=True)
class TeacherContextConfig:
    """A privileged context only the teacher sees: the teacher's prompt is ``messages`` rendered through
    the teacher's chat template (each turn's content a Python format string over the prompt row's
    columns, e.g. "{prompt}\\n\\nA verified solution: {solution}"), and the student's response ids follow
    it unchanged. Empty: the teacher sees the student's prompt."""

    messages: list[Turn] = field(default_factory=list)  # content with {column} placeholders
    # OP2SD's ablation: every placeholder but {prompt} filled from another, seeded prompt of the set
    # (never the prompt itself), so the context is real but about a different problem.
    other_problem: bool = False
    seed: NonNegativeInt = 0  # other_problem: seed of the choice of the other prompt

    def columns(self) -> tuple[str, ...]:
        """The prompt-row columns the turns name, in order of first use ({prompt} included)."""
        names = [field for turn in self.messages for _, field, _, _ in string.Formatter().parse(turn["content"]) if field is not None]
        return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class RolloutConfig:
    """How the student samples: prompts and samples a round, the work-unit size, sampling settings, the
    length budget, stops, multi-turn tools, and the held-out evaluation rollout runs each round."""

    prompts_per_round: Count = 256  # prompts drawn from data.train each round
    n: Count = 4  # samples per prompt
    prompts_per_unit: Count = 64  # work-unit size; fixed by the plan, independent of worker count
    temperature: Positive = 1.0  # sampling temperature
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0  # nucleus sampling's p; 1 = off
    top_k: Annotated[int, Range(ge=-1)] = -1  # -1 = off
    max_tokens: Count = 8  # the most tokens of a response (of each student turn, with tools)
    seed: NonNegativeInt = 0  # the sampling seed (which prompts each round draws, and the engine's)
    # What samples: vllm (an engine, kept between rounds) or hf (the student's own module decoding in
    # batches: no engine start, any device torch runs on; text prompts only). docs/how-to/rollout-backends.md.
    backend: Literal["vllm", "hf"] = "vllm"
    hf_batch: Count = 64  # backend hf: responses decoded together (their keys and values held at once)
    eval_heldout: bool = True  # also log the policy's greedy held-out accuracy with the same engine
    # Off-policy guidance (TrOPD, section 6): for this fraction of prompts the teacher writes the first
    # guide_prefix_tokens tokens and the student continues; prefix tokens are not trained by policy
    # gradient (loss_mask 0) but by forward KL on the teacher's top-k.
    guided_fraction: Fraction = 0.0
    guide_prefix_tokens: Count = 2  # tokens the teacher writes at the start of a guided response
    # Generation stops at the tokenizer's EOS, the chat template's end-of-turn token and these strings.
    stop: list[str] = field(default_factory=list)
    # Responses cut at max_tokens (finish_reason "length"): keep (trained like any other, the usual
    # choice for distillation), mask (no loss, still in the statistics) or drop (neither).
    truncated: Literal["keep", "mask", "drop"] = "keep"
    # Multi-turn tool use: the tools the student may call (built-in names, module:function, or
    # name=module:function to have the student call it name; empty = one turn per response). A call
    # ends the student's turn, its result comes back as a tool turn
    # rendered by the chat template, and the student continues, for at most max_turns student turns
    # and max_tool_response_tokens tokens of interleaved response (student, tool and template tokens;
    # each student turn is also capped by max_tokens). A tool that fails or runs past tool_timeout_s
    # answers with an error message instead.
    tools: list[str] = field(default_factory=list)
    max_turns: Count = 4  # tools: the most student turns in one response
    max_tool_response_tokens: Count = 512  # tools: the most tokens of one interleaved response
    tool_timeout_s: Positive = 10.0  # tools: seconds a call may take before it answers with an error

    @property
    def response_tokens(self) -> int:
        """The most tokens one response can hold: the whole interleaved conversation with tools."""
        return self.max_tool_response_tokens if self.tools else self.max_tokens

    @property
    def units_per_round(self) -> int:
        """The work units a round's prompts make: prompts_per_unit each, the last one shorter."""
        return -(-self.prompts_per_round // self.prompts_per_unit)


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (the ``peft`` package's LoRA) instead of training every weight: the student's
    weights stay as they are and each target linear layer gains ``alpha / rank * B @ A``, with A and B
    the only trained parameters (and the output layer / embeddings where asked). The optimizer state
    then covers the adapters alone. Each round exports the merged weights (what rollout and score read)
    and the adapters beside them (``model/adapter/``, PEFT's format), and a later train continues from
    the initial student plus those adapters, so the run trains one adapter throughout."""

    enabled: bool = False  # train low-rank adapters instead of every weight
    rank: Count = 16  # the adapters' rank r
    alpha: Positive = 32.0  # the adapters' output is scaled by alpha / rank
    dropout: Annotated[float, Range(ge=0.0, lt=1.0)] = 0.0  # dropout on the adapters' input while training
    # Module names as PEFT matches them ("q_proj", ...), or ["all-linear"]: every linear layer but the output layer.
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    train_output_layer: bool = False  # the output layer trains in full beside the adapters
    train_embeddings: bool = False  # the input embeddings train in full (tied to the output layer where the model ties them)
    # What rollout's vLLM engine runs: the initial student with each round's adapters on every request
    # (adapters: vLLM's LoRA, nothing reloaded between rounds), or the merged weights reloaded each round
    # (merged). auto: adapters on a GPU; merged on CPU, where vLLM's LoRA runs its adapter products as
    # plain torch ops and a rollout took 3x as long (the self-distillation demo's SmolLM2 rounds).
    serve: Literal["auto", "adapters", "merged"] = "auto"


@dataclass(frozen=True)
class ModelConfig:
    """How score and train place and run the student and teacher (resolved in gndpo.stages.models.device)."""

    dtype: Precision = "auto"  # score's and train's precision: auto = bf16 on a GPU that supports it, else fp32
    attn_implementation: AttnImplementation = "sdpa"  # flash_attention_2 where flash-attn can run (elsewhere sdpa, with a warning)
    # Full-vocabulary logits exist for at most this many response positions at a time (lm_head and
    # log-softmax run chunk by chunk after one backbone pass; train recomputes a chunk in backward).
    # Still the cap on the chunk, now sized by logits_budget_mib below; at a small vocabulary (the toy's)
    # the budget allows more, so this alone decides, as before.
    token_chunk: Count = 1024
    # MiB one fp32 [positions, vocabulary] buffer may take: a chunk holds budget // (V x 4 B) positions
    # (at least 1, at most token_chunk), so memory follows the vocabulary instead of a token count.
    # Score keeps at most two such buffers per model, train one (its fused output layer). auto = 1/32 of
    # the device's memory (the GPU's, else the machine's), at least 256 MiB and at most 1 GiB: 768 MiB
    # on a 24 GiB machine (768 positions at Gemma's 262,144-token vocabulary), 1 GiB from a 32 GiB GPU up.
    # Per-chunk overhead is small either way (scoring a 2,048-token response at 262,144 was no slower
    # with 256 positions than with 1,024); what a larger chunk buys is train's fused output layer
    # taking whole responses at once: one longer than the chunk needs a second pass over its logits.
    logits_budget_mib: Count | Literal["auto"] = "auto"
    # Vision-language students: train the language model only (the vision tower and the connector that
    # maps its features stay as they are), the common choice; false trains the whole model.
    freeze_vision: bool = True
    # Score's and train's forward passes read a prompt once for all the responses in a batch that share
    # it (rollout.n samples of a prompt; a teacher context), the responses attending to its keys and
    # values: the prompt's share of the compute is divided by the number of its responses in the batch,
    # with the same log-probs and gradients up to float rounding. False runs each prompt + response as
    # one sequence. Train reads whole sequences under train.gradient_checkpointing, which cannot keep
    # a prompt's keys and values for the responses.
    shared_prompts: bool = True
    lora: LoraConfig = field(default_factory=LoraConfig)  # train low-rank adapters only (model.lora.enabled)


@dataclass(frozen=True)
class ScoreConfig:
    """How score computes and stores the teachers' (and the recomputed student's) per-token values:
    batch sizes, the top-k, stored precision, the teacher backend, several or cross-tokenizer teachers."""

    # A forward pass holds at most max_tokens_per_batch (padded prompt + response) tokens and at most
    # rows_per_chunk responses; responses are grouped by length so padding stays small.
    max_tokens_per_batch: Count = 32768
    rows_per_chunk: Count = 128  # the most responses in one forward pass
    teacher_topk: Count = 16  # k of the teacher top-k (ids, log-probs) stored for divergence methods
    # Precision of the stored per-token values. bfloat16 rounds them to bf16 (kept in float32 columns,
    # so every reader sees plain floats) and shards shrink about 2.5x; the importance ratio at a round's
    # first step is then 1 only to bf16 precision (~0.4% of a log-prob) instead of float32's.
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Where the teacher's log-probs come from: hf (the teacher module on the score worker's device,
    # every column) or vllm (a vLLM engine scoring the stored token ids as prompt log-probs: the
    # sampled token's and the top-k; engine settings below, tensor_parallel_size for a teacher larger
    # than one GPU) or server (OpenAI-compatible teacher servers, below: the sampled token's and the
    # top-k, as vllm). The student's log-probs are always recomputed by the training forward.
    backend: Literal["hf", "vllm", "server"] = "hf"
    # score.backend server: the teacher's servers, as base URLs (http://host:8000; vLLM's server, or
    # SGLang's where its API answers alike); with several teachers, {teacher name: [URLs]}.
    servers: list[str] | dict[str, list[str]] = field(default_factory=list)
    # The name the servers serve the teacher under (their /v1/models, vLLM's --served-model-name); with
    # several teachers {teacher name: name}. Empty: the teacher's hub id (a local folder needs one).
    server_model: str | dict[str, str] = ""
    server_api_key_env: str = ""  # an environment variable holding the servers' key (a bearer token; never stored)
    server_ca_bundle: str = ""  # https: a CA bundle to verify the servers with (empty: the system's)
    server_timeout_s: Positive = 300.0  # one request's longest wait for its answer
    server_retries: NonNegativeInt = 5  # attempts after a request's first failure, each on the least loaded server
    server_in_flight: Count = 8  # requests in flight per server
    # While every server is failing: how long after the last answer of any server the unit fails (long
    # enough for a dropped connection or a failover; raise it to wait for a teacher's restart).
    server_outage_s: Positive = 60.0
    # Replicas of one teacher must score a fixed probe sequence alike: the largest mean |log-prob
    # difference| accepted between a server and the first (bf16 replicas on different GPU types differ).
    server_tolerance: Positive = 3e-2
    # Where the student's log-prob of each sampled token comes from: recompute (a forward of the student,
    # the same function train differentiates, so a round's first importance ratio is 1 up to float
    # rounding), engine (the rollout engine's sampler log-probs: no student forward in score, and with
    # score.backend vllm no student module at all) or auto (engine where the round's rollout engine
    # sampled in fp32, nothing below rules it out and logging.entropy_metrics is off, since the student's
    # entropy needs its forward anyway; recompute otherwise). engine needs
    # rollout.temperature 1 (vLLM returns the raw distribution's log-probs), student-sampled responses
    # (no tools, no guided prefixes) and a method that does not read the student's distribution in score
    # (entropies, the full KL); the round's student entropy metric is then not computed. Engine and
    # trainer agree to about 1e-6 per token in fp32 (rollout_logprob_diff on the demo: mean 1.1e-6, max
    # 5.7e-5); in bf16 they can differ by far more (slime's and verl's users report it), hence auto.
    student_logprobs: Literal["auto", "recompute", "engine"] = "auto"
    # Several teachers (``teachers``): route (each prompt to the teacher its prompt-file column names)
    # or mean (every token scored by all of them: log of the mean probability, over the vocabulary).
    teacher_mix: Literal["route", "mean"] = "route"
    # A teacher whose tokenizer differs from the student's (refused unless this is true): the response
    # is re-tokenized by the teacher after its own rendering of the prompt, and its log-probs and top-k
    # reach the student's tokens span by span (gndpo.stages.text.align, gndpo.stages.text.vocabulary).
    cross_tokenizer: bool = False
    # With cross_tokenizer: the text that ends a turn for the teacher, for a base model without a chat
    # template (its demonstrations separated by "\n\n", say). The student's end token is then scored as
    # that text, and the text's first teacher token stands for the student's end token in the top-k.
    # Empty: the teacher's end-of-turn token, else its EOS.
    teacher_end_text: str = ""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig())


@dataclass(frozen=True)
class TrainConfig:
    """How train updates the student: optimizer, learning-rate schedule, clipping, optimizer steps and
    batch sizes per round, DeepSpeed (ZeRO stage, ranks, offload), checkpoints within a round."""

    lr: Positive = 1e-6  # AdamW's (peak) learning rate
    # The lr over a round's optimizer steps: constant, or cosine from lr at the first step down to
    # lr * lr_min_ratio at the last (restarting each round: a function of the step, so resume-safe).
    lr_schedule: Literal["constant", "cosine"] = "constant"
    lr_min_ratio: Fraction = 0.1  # cosine: the last step's lr as a share of lr
    # Round r's peak lr is lr * lr_round_decay**r: later rounds, whose student is near what the teacher
    # can give, move it less (1 = every round starts at lr).
    lr_round_decay: Annotated[float, Range(gt=0, le=1)] = 1.0
    weight_decay: NonNegative = 0.0  # AdamW's weight decay
    optimizer_steps: Count = 1  # mini-batches per round (1 = one step per rollout batch, as the paper)
    # A micro-batch (one forward/backward on one rank) holds at most max_tokens_per_batch padded tokens
    # and at most micro_batch_size responses.
    max_tokens_per_batch: Count = 16384
    micro_batch_size: Count = 64  # the most responses in one micro-batch
    grad_clip: NonNegative = 1.0  # 0 = no clipping
    zero_stage: Annotated[int, Range(ge=0, le=3)] = 0  # 0-3; with 3 the model is built partitioned and the export gathers it
    # Recompute each layer's activations in backward: less memory, about a third more compute. auto =
    # on where a GPU is found and train's estimated peak without it is above 70% of the GPU's memory
    # (stages/models/gpu_memory.py; `gndpo init` prints the estimate), off on CPU.
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    carry_optimizer_state: bool = True  # keep AdamW moments across rounds
    # Write the carried optimizer state (AdamW's moments, and the fp32 master weights in bf16: about 3x
    # the exported policy's bytes) after every state_every-th round only. A process that keeps its
    # DeepSpeed engine (`gndpo run`) carries the state in memory between writes; a train that starts
    # without it (after a crash, or stages run one process each) rebuilds it by replaying the train
    # stages since the last written state from their committed rows, deterministically, and checks
    # that the replay ends on the previous round's exported weights, byte for byte.
    state_every: Count = 1
    # Write it after the run's last round too (the round `gndpo run --rounds N` ends on, or a stage
    # command's --final). Off: a short job pays no state write nothing reads; extending the run
    # (`gndpo run --rounds M`) rebuilds the state by the replay above, exactly.
    final_state: bool = False
    # Where the process keeps its one-rank DeepSpeed engine for the next round (`gndpo run`), write that
    # state on a thread while the next round rolls out, scores and normalizes, instead of before the
    # round commits; the next update waits for it before its first step. Until the write's record
    # exists the state does not, so a crash meanwhile costs a replay (as above), never a wrong state.
    state_async: bool = True
    # Compute the output layer's gradient in the forward pass, chunk by chunk (stages/models/fused_output.py:
    # three output-layer matmuls a position, no logits recomputed); false recomputes each chunk's logits
    # in backward (four). Teachers of another vocabulary and ZeRO-3 always recompute.
    fused_output: bool = True
    checkpoint_every: NonNegativeInt = 8  # optimizer steps between in-round checkpoints a retry resumes from (0 = none)
    num_processes: NonNegativeInt = 0  # train ranks on this node; 0 = one per visible GPU (1 on CPU)
    seed: NonNegativeInt = 0  # torch's seed and the shuffle of a round's responses into optimizer steps


@dataclass(frozen=True)
class EngineConfig:
    """vLLM engine settings shared by rollout and eval."""

    dtype: Precision = "auto"  # auto = model.dtype's resolution (bf16 on a capable GPU, fp32 on CPU)
    max_model_len: NonNegativeInt = 0  # 0 = the model's own context length (max_position_embeddings)
    cuda_graphs: bool = True  # False = vLLM's enforce_eager; the CPU build always runs eager
    # Each CPU engine's own KV cache (vLLM's kv_cache_memory_bytes), fractions allowed; GPUs use
    # gpu_memory_utilization. A token takes 2 x layers x KV heads x head size x the dtype's bytes (46 KB for
    # SmolLM2-135M in fp32): 0.25 GiB holds 5,800 of them, 32 sequences of 180 tokens at once.
    kv_cache_gib: Annotated[float, Range(gt=0)] = 1.0
    gpu_memory_utilization: Annotated[float, Range(gt=0, le=1)] = 0.85  # the share of a GPU's memory the engine may take
    max_num_seqs: Count = 256  # the most sequences the engine runs at once
    tensor_parallel_size: Count = 1  # GPUs one engine spans
    # CPU build only (the default there): the engine runs inside the gndpo process that uses it (vLLM's
    # uniprocess executor and in-process engine core) instead of in an engine-core process and a worker
    # process of its own. Each of those is a fresh interpreter that imports torch and vLLM again: about
    # 25 s of a 38 s start on 2 cores, and 4 s of the stop. The engine then computes with this process's
    # torch threads (a separate worker takes one core less: vLLM reserves one for its engine core), and
    # no engine process exists to die or to be killed on its own. False: processes of its own, as on GPUs,
    # where engines always run in their own processes.
    in_process: bool = True


@dataclass(frozen=True)
class LoggingConfig:
    """Where the round metrics go besides ``metrics.jsonl``. Not part of the run's fingerprint: where a
    run reports does not change what it computes."""

    backends: list[Literal["tensorboard", "wandb"]] = field(default_factory=list)  # tensorboard: RUN/tensorboard/
    wandb_project: str = "gndpo"  # the W&B project runs log to
    wandb_entity: str = ""  # empty: the default entity of the logged-in account
    wandb_mode: Literal["online", "offline"] = "online"  # offline: write RUN/logs/wandb/ only (upload later with `wandb sync`)
    # score's entropy metrics: one more full-vocabulary pass per scored chunk and model; off saves it
    entropy_metrics: bool = True


@dataclass(frozen=True)
class RoundsConfig:
    """How rounds follow each other (docs/concepts/rounds.md). ``overlap`` and ``poll_seconds`` decide only
    when stages run, never what they compute, so they are not part of the fingerprint; ``max_staleness`` is."""

    # Rollout of round k samples with policy max(k - max_staleness, 0): 0 = on-policy (the default); 1 =
    # round k+1 rolls out with policy k while round k scores, normalizes and trains. Always exactly that
    # lag, never "whatever is newest", so the rows do not depend on timing and a rerun reproduces them.
    max_staleness: NonNegativeInt = 0
    # auto: the order the round model predicts fastest on the devices `gndpo run` sees, from each
    # stage's cost on paper, or the seconds the run's rounds took one stage at a time once there are
    # some (init and run say each order's predicted round time):
    # stages that share devices only take turns on them, a served teacher's or a learner split's
    # (`gndpo run --learner-gpus`) run beside; on: every overlap the settings allow, whatever the
    # devices; off: one stage at a time.
    overlap: Literal["auto", "on", "off"] = "auto"
    # Seconds between a waiting worker's looks at the run folder for the commits it waits for, where a
    # commit cannot wake it: a worker on another machine, or a run on object storage, where each look
    # is a listing request. On one machine with a local run folder a commit wakes the waiting workers at once.
    poll_seconds: Positive = 2.0


@dataclass(frozen=True)
class Config:
    """A run's whole experiment: models, data, reward, method and each stage's settings. Frozen once
    read and checked (:func:`gndpo.pipeline.config.load.load_config`); its :meth:`fingerprint` is the
    run's identity, so a rerun with other settings is refused rather than mixed in."""

    student: str = ""  # the model trained: a Hugging Face model folder (or hub id)
    teacher: str = ""  # the model that scores the student's tokens: a model folder (or hub id), self or run:RUN[@K]
    teachers: dict[str, str] = field(default_factory=dict)  # several teachers: {name: model path}, instead of teacher
    self_teacher: SelfTeacherConfig = field(default_factory=SelfTeacherConfig)  # with teacher: self
    teacher_context: TeacherContextConfig = field(default_factory=TeacherContextConfig)
    reward: str = "exact_match"  # what grades a response: a built-in reward (gndpo.pipeline.tasks.rewards) or module:function
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RoundsConfig = field(default_factory=RoundsConfig)
    # Folders user plugins (rewards, tools named module:function) import from; `gndpo init` records the
    # config file's folder and the current folder, as absolute paths, unless the config names its own.
    plugin_dirs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """Every setting as plain dicts and values (the form YAML and the fingerprint read)."""
        return asdict(self)

    def teacher_models(self) -> dict[str, str]:
        """{name: model path} of the run's teachers: ``teachers``, or the one ``teacher`` named by its path
        (the name score records per row)."""
        return dict(self.teachers) if self.teachers else {self.teacher: self.teacher}

    def fingerprint(self) -> str:
        """The run's identity: every setting that changes what is computed (``logging``, where plugins
        are found and ``run.overlap`` are left out; ``run`` only where its staleness is not 0, so runs
        made before the section existed keep their identity; likewise ``rollout.backend`` and
        ``rollout.hf_batch`` only where the backend is not vllm)."""
        settings = {k: v for k, v in self.to_dict().items() if k not in ("logging", "plugin_dirs", "run")}
        if self.rollout.backend == "vllm":
            settings["rollout"] = {k: v for k, v in settings["rollout"].items() if k not in ("backend", "hf_batch")}
        if self.run.max_staleness:
            settings["run"] = {"max_staleness": self.run.max_staleness}
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
