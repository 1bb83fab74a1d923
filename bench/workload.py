"""Benchmark workload W: a ~27M-parameter student and a ~3x teacher with a real-sized BPE vocabulary.

Built offline and deterministically (same files for the same spec): a byte-level BPE tokenizer trained
with ``tokenizers`` on text :mod:`tests.realistic` generates (32,000 tokens, the vocabulary of
Llama-2 and Mistral), two Llama models with random weights and that vocabulary, and prompt files. Random
weights almost never sample EOS, so every response runs to ``max_tokens`` and a round's token count is
exactly prompts x samples x max_tokens: the shapes, not the weights, are what the benchmarks measure.

W as specified is 256 prompts x 4 samples x 256 tokens with one optimizer step per round. On the 2-core
CPU machine that is about 260k tokens of teacher and student forward passes plus a student backward,
roughly 100 TFLOP, a quarter of an hour per round per framework; :data:`CPU_SCALE` is the
same W with 64 prompts and 64-token responses (1/16 of the tokens), which is what ``run_all.py`` runs
here. ``--full`` runs W itself (for a GPU machine).

The SmolLM2 workload (:func:`build_smollm2_workload`, :func:`smollm2_config`) is a real pretrained model
instead: SmolLM2-135M-Instruct as student and teacher, 64 templated chat questions, 32 prompts x 2
samples x 24 tokens, 2 optimizer steps.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.realistic
from tests.realistic import ShapeSpec, build_realistic_pair, synthetic_text  # noqa: E402

CACHE = Path.home() / ".cache" / "gndpo" / "bench"

STUDENT = ShapeSpec(vocab_size=32_000, tokenizer_vocab=32_000, hidden=320, layers=6, heads=5, kv_heads=1,
                    intermediate=864, max_position_embeddings=1024, corpus_lines=60_000, corpus_words=40_000)
TEACHER = ShapeSpec(vocab_size=32_000, tokenizer_vocab=32_000, hidden=640, layers=9, heads=10, kv_heads=2,
                    intermediate=1728, max_position_embeddings=1024, corpus_lines=60_000, corpus_words=40_000)


@dataclass(frozen=True)
class Scale:
    prompts: int
    n: int
    max_tokens: int

    def tokens(self) -> int:
        return self.prompts * self.n * self.max_tokens


FULL_SCALE = Scale(prompts=256, n=4, max_tokens=256)
CPU_SCALE = Scale(prompts=64, n=4, max_tokens=64)


def parameters(spec: ShapeSpec) -> dict:
    """Parameter counts of a Llama of this shape: embedding, output layer, and the transformer blocks."""
    head_dim = spec.hidden // spec.heads
    attention = 2 * spec.hidden * spec.hidden + 2 * spec.hidden * spec.kv_heads * head_dim
    block = attention + 3 * spec.hidden * spec.intermediate + 2 * spec.hidden
    return {"embedding": spec.vocab_size * spec.hidden, "lm_head": spec.vocab_size * spec.hidden,
            "blocks": spec.layers * block + spec.hidden}


def build_workload(folder: Path = CACHE / "w") -> Path:
    """Write (once) ``student/``, ``teacher/``, ``train.jsonl`` and ``heldout.jsonl`` under ``folder``."""
    folder = Path(folder)
    stamp = folder / "spec.json"
    spec = {"student": STUDENT.__dict__, "teacher": TEACHER.__dict__, "version": 1}
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return folder
    build_realistic_pair(folder, STUDENT, TEACHER, n_prompts=0)
    for name, count, seed in (("train", 1024, 11), ("heldout", 128, 12)):
        with open(folder / f"{name}.jsonl", "w") as f:
            for i, line in enumerate(synthetic_text(count, seed, STUDENT.corpus_words)):
                f.write(json.dumps({"prompt_id": f"{name}-{i:05d}", "prompt": f"Continue the text: {line}", "answer": ""}) + "\n")
    stamp.write_text(json.dumps(spec))
    return folder


def workload_config(assets: Path, scale: Scale, method: str = "reverse_kl", **sections) -> dict:
    """A gndpo config for one W round at ``scale``: ``method`` (reverse KL on the teacher's top-16, the
    objective TRL's GKD has with beta=1), temperature 1, one optimizer step over the whole round, fp32."""
    cfg = {
        "student": str(assets / "student"),
        "teacher": str(assets / "teacher"),
        "data": {"train": str(assets / "train.jsonl"), "heldout": str(assets / "heldout.jsonl")},
        "method": {"name": method},
        "reward": "exact_match",
        "rollout": {"prompts_per_round": scale.prompts, "n": scale.n, "max_tokens": scale.max_tokens,
                    "prompts_per_unit": max(scale.prompts // 2, 1), "temperature": 1.0, "eval_heldout": False},
        "score": {"teacher_topk": 16, "max_tokens_per_batch": 8192, "rows_per_chunk": 64},
        "train": {"lr": 1e-5, "optimizer_steps": 1, "micro_batch_size": 32, "max_tokens_per_batch": 8192,
                  "checkpoint_every": 0},
        "model": {"token_chunk": 1024},
        "engine": {"max_model_len": 512, "kv_cache_gib": 2},
    }
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value)
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


# SmolLM2: a real pretrained model (SmolLM2-135M-Instruct, converted by ``gndpo convert``: Llama, 30
# layers, hidden 576, a 49,152-token vocabulary, tied embeddings, ChatML with a default system turn).
# Student and teacher are the same folder (a fixed teacher, the set-up TRL's GKD supports); short chat
# questions, 32 for the round and 32 held out, 2 samples of up to 24 tokens, 2 optimizer steps, fp32.
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_SCALE = Scale(prompts=32, n=2, max_tokens=24)
SMOLLM2_STEPS = 2
SMOLLM2_QUESTIONS = {
    "What is the capital of {}?": ["France", "Japan", "Italy", "Canada", "Egypt", "Brazil", "Kenya", "Norway"],
    "How many legs does a {} have?": ["spider", "dog", "chicken", "ant", "horse", "crab", "snake", "octopus"],
    "What color is a ripe {}?": ["banana", "lemon", "strawberry", "blueberry", "lime", "tomato", "plum", "cherry"],
    "Which language is mostly spoken in {}?": ["Germany", "Mexico", "Portugal", "China", "Russia", "Greece", "Sweden", "Poland"],
    "What is the opposite of {}?": ["hot", "tall", "fast", "happy", "early", "open", "heavy", "light"],
    "What do you call a baby {}?": ["cat", "dog", "cow", "sheep", "horse", "goat", "deer", "bear"],
    "On which continent is {}?": ["Peru", "India", "Nigeria", "Australia", "Spain", "Chile", "Vietnam", "Morocco"],
    "What is {}?": ["2 plus 3", "7 times 6", "10 minus 4", "9 plus 8", "12 divided by 3", "5 times 5", "15 minus 7", "6 plus 6"],
}


def smollm2_questions() -> list[str]:
    """The 64 questions (8 templates x 8 fillers) in a fixed order."""
    return [template.format(fill) for template, fills in SMOLLM2_QUESTIONS.items() for fill in fills]


def build_smollm2_workload(folder: Path = CACHE / "smollm2") -> dict:
    """The converted SmolLM2 folder (converted once by gndpo, then cached) and ``train.jsonl`` /
    ``heldout.jsonl`` under ``folder``: the 64 questions in a seeded order, split 32 / 32, so that the
    round's prompts are the whole train file and both frameworks see exactly the same ones."""
    import random

    from gndpo.apps.demos.real_models import ensure_real_model

    model = ensure_real_model(SMOLLM2, log=lambda *_: None)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    questions = smollm2_questions()
    random.Random(0).shuffle(questions)
    half = SMOLLM2_SCALE.prompts
    for name, part in (("train", questions[:half]), ("heldout", questions[half : 2 * half])):
        lines = [json.dumps({"prompt_id": f"{name}-{i:03d}", "prompt": q, "answer": ""}) for i, q in enumerate(part)]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return {"model": model, "train": folder / "train.jsonl", "heldout": folder / "heldout.jsonl"}


# The seeds' shape on SmolLM2 (GNDPO's geo3k script: n = 16, prompts up to 8k tokens; OPSD's teacher
# reading a privileged context longer than the question): 8 samples per prompt, and each prompt a
# few-shot preamble several times the response's length.
SEEDS_SCALE = Scale(prompts=8, n=8, max_tokens=24)
SEEDS_STEPS = 2
FEW_SHOT = [("What is the capital of Peru?", "Lima."), ("How many legs does a cat have?", "Four."),
            ("What color is a ripe orange?", "Orange."), ("Which language is mostly spoken in France?", "French."),
            ("What is the opposite of cold?", "Hot."), ("What do you call a baby dog?", "A puppy."),
            ("On which continent is Japan?", "Asia."), ("What is 4 plus 4?", "8.")]


def few_shot(question: str) -> str:
    """``question`` after eight worked examples and an instruction: the seeds' long-prompt shape."""
    shots = "\n".join(f"Q: {q}\nA: {a}" for q, a in FEW_SHOT)
    return f"Answer the last question in the style of these examples: one short sentence.\n{shots}\nQ: {question}\nA:"


def build_seeds_workload(folder: Path = CACHE / "smollm2-seeds") -> dict:
    """:func:`build_smollm2_workload`'s questions, each behind the few-shot preamble (:func:`few_shot`),
    the first ``SEEDS_SCALE.prompts`` as the round's prompts."""
    base = build_smollm2_workload()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("train", "heldout"):
        rows = [json.loads(line) for line in base[name].read_text().splitlines()]
        lines = [json.dumps({**row, "prompt": few_shot(row["prompt"])}) for row in rows]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return {"model": base["model"], "train": folder / "train.jsonl", "heldout": folder / "heldout.jsonl"}


def smollm2_config(assets: dict, scale: Scale = SMOLLM2_SCALE, steps: int = SMOLLM2_STEPS, lr: float = 1e-6) -> dict:
    """One gndpo round on SmolLM2: ``reverse_kl`` on the teacher's top-16, temperature 1, ``steps``
    optimizer steps of micro-batches of 16 sequences, fp32, the teacher the same folder as the student."""
    model = str(assets["model"])
    return {
        "student": model,
        "teacher": model,
        "data": {"train": str(assets["train"]), "heldout": str(assets["heldout"])},
        "method": {"name": "reverse_kl"},
        "reward": "exact_match",
        "rollout": {"prompts_per_round": scale.prompts, "n": scale.n, "max_tokens": scale.max_tokens,
                    "prompts_per_unit": max(scale.prompts // 2, 1), "temperature": 1.0, "eval_heldout": False},
        "score": {"teacher_topk": 16, "max_tokens_per_batch": 8192, "rows_per_chunk": 64},
        "train": {"lr": lr, "optimizer_steps": steps, "micro_batch_size": 16, "max_tokens_per_batch": 8192,
                  "checkpoint_every": 0},
        "model": {"dtype": "float32"},
        # 0.25 GiB of KV cache holds 5,800 tokens of SmolLM2-135M in fp32 (46 KB each): a unit's 32
        # sequences at 180 tokens, and more with the n samples of a prompt sharing its blocks.
        "engine": {"max_model_len": 256, "kv_cache_gib": 0.25},
    }


if __name__ == "__main__":
    folder = build_workload()
    print(folder, {name: parameters(spec) for name, spec in (("student", STUDENT), ("teacher", TEACHER))})
