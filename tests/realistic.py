"""Realistic-shape models built offline: the shapes of a real student/teacher pair, random weights.

The toy task proves the pipeline's logic; it cannot prove memory or speed, which depend on the shapes
of real checkpoints: a vocabulary of ~152k (Qwen's 151,936), a hidden size of 512 and more, context
lengths of thousands of tokens. :func:`build_realistic_pair` writes such a pair in Hugging Face format
(Llama architecture, loadable by transformers and vLLM) with a byte-level BPE tokenizer trained here,
with the ``tokenizers`` library, on text this module generates. The model config's ``vocab_size`` is
larger than the tokenizer, as in real checkpoints, so the logits have the real width.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

QWEN_VOCAB = 151_936
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ShapeSpec:
    vocab_size: int = QWEN_VOCAB  # the model's (logit) width; the tokenizer is smaller
    hidden: int = 512
    layers: int = 2
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 1408
    max_position_embeddings: int = 8192
    tokenizer_vocab: int = 4096
    seed: int = 0
    corpus_lines: int = 20_000  # of synthetic text the tokenizer is trained on
    corpus_words: int = 3000


def synthetic_text(n_lines: int, seed: int, n_words: int = 3000) -> list[str]:
    """Word-like lines from a seeded syllable grammar, with digits and punctuation: enough variety for a
    BPE tokenizer to learn merges of every length (``n_words`` distinct words bound how many)."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "ing", "er", "qu", "st"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(n_words)]
    lines = []
    for _ in range(n_lines):
        parts = [rng.choice(words) for _ in range(rng.randint(5, 25))]
        if rng.random() < 0.3:
            parts.append(f"{rng.randint(0, 99999)} + {rng.randint(0, 999)} = {rng.randint(0, 99999)}")
        lines.append(" ".join(parts).capitalize() + rng.choice([".", "?", "!", ":"]))
    return lines


def build_tokenizer(spec: ShapeSpec):
    """A byte-level BPE tokenizer with ChatML-style special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.tokenizer_vocab, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(synthetic_text(spec.corpus_lines, spec.seed, spec.corpus_words), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=spec.max_position_embeddings
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def new_model(spec: ShapeSpec, tok, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def build_realistic_pair(folder: str | Path, student: ShapeSpec = ShapeSpec(), teacher: ShapeSpec | None = None,
                         n_prompts: int = 64) -> Path:
    """Write ``student/``, ``teacher/`` (same tokenizer) and ``prompts.jsonl`` under ``folder``.

    The teacher defaults to the student's shape with twice the layers. Deterministic for given specs."""
    folder = Path(folder)
    teacher = teacher or ShapeSpec(**{**asdict(student), "layers": 2 * student.layers})
    tok = build_tokenizer(student)
    for name, spec, seed in (("student", student, student.seed), ("teacher", teacher, student.seed + 1)):
        out = folder / name
        new_model(spec, tok, seed).save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
    lines = synthetic_text(n_prompts, student.seed + 2)
    with open(folder / "prompts.jsonl", "w") as f:
        for i, line in enumerate(lines):
            f.write(json.dumps({"prompt": line, "answer": ""}) + "\n")
    return folder
