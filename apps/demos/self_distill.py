"""The self-distillation demo's task: short factual questions, answered in a demonstrated format.

SmolLM2-135M-Instruct ignores format instructions in a system turn or in the question (0 of 16 greedy
answers follow "Begin your reply with 'Answer:'"), but three demonstration turns before a question
("What is the capital of Italy?" -> "Answer: Rome.", and two more) make it answer "Answer: Paris." in
16 of 16. Those demonstrations are the privileged context of ``gndpo demo --task self-distill``: the
teacher is the frozen initial student reading them, the student sees the bare question, and the
``answer_format`` reward checks the format ("Answer:" first, at most 8 words). Context distillation:
the student learns to behave as if the demonstrations were there.

Questions come from a few templates over small fixed lists (capitals, animals' legs, colours, sums,
opposites), so the set is built offline and deterministically; training and held-out questions are
disjoint by construction (split by a hash of the question).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from gndpo.apps.demos.real_models import ensure_real_model
from gndpo.pipeline.observe.logs import info
from gndpo.pipeline.tasks.rewards import answer_format
from gndpo.storage.cache import cached_build

STUDENT = "smollm2-135m-instruct"
MAX_TOKENS = 24  # the demo's rollout.max_tokens: "Answer: Copenhagen." is 6 tokens
DEMONSTRATIONS = [
    ("What is the capital of Italy?", "Answer: Rome."),
    ("How many legs does a cat have?", "Answer: Four."),
    ("What color is a lemon?", "Answer: Yellow."),
]
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Spain": "Madrid", "Portugal": "Lisbon", "Japan": "Tokyo", "China": "Beijing",
    "Egypt": "Cairo", "Russia": "Moscow", "Greece": "Athens", "Ireland": "Dublin", "Norway": "Oslo", "Sweden": "Stockholm",
    "Finland": "Helsinki", "Denmark": "Copenhagen", "Poland": "Warsaw", "Austria": "Vienna", "Hungary": "Budapest",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Peru": "Lima", "Chile": "Santiago", "Kenya": "Nairobi",
    "Thailand": "Bangkok", "Vietnam": "Hanoi", "Turkey": "Ankara", "Cuba": "Havana", "Belgium": "Brussels",
    "Netherlands": "Amsterdam", "Switzerland": "Bern", "Australia": "Canberra", "India": "New Delhi", "Iran": "Tehran",
}
LEGS = {
    "dog": "Four", "spider": "Eight", "bird": "Two", "ant": "Six", "horse": "Four", "chicken": "Two", "bee": "Six",
    "cow": "Four", "duck": "Two", "beetle": "Six", "octopus": "Eight", "goat": "Four", "penguin": "Two", "fly": "Six",
    "sheep": "Four", "crab": "Ten", "lion": "Four", "owl": "Two", "mouse": "Four", "scorpion": "Eight",
}
COLORS = {
    "a banana": "Yellow", "grass": "Green", "the sky on a clear day": "Blue", "snow": "White", "coal": "Black",
    "a ripe tomato": "Red", "an orange": "Orange", "milk": "White", "a strawberry": "Red", "a carrot": "Orange",
    "chocolate": "Brown", "a frog": "Green", "the sun": "Yellow", "a blueberry": "Blue", "a crow": "Black",
    "an eggplant": "Purple", "a lime": "Green", "a polar bear": "White", "a cherry": "Red", "a pumpkin": "Orange",
}
OPPOSITES = {
    "hot": "Cold", "up": "Down", "big": "Small", "fast": "Slow", "day": "Night", "happy": "Sad", "old": "Young",
    "open": "Closed", "light": "Dark", "early": "Late", "wet": "Dry", "full": "Empty", "hard": "Soft", "loud": "Quiet",
}
NUMBERS = ["Zero", "One", "Two", "Three", "Four", "Five", "Six", "Seven", "Eight", "Nine", "Ten", "Eleven", "Twelve"]


def questions() -> list[dict]:
    """Every (prompt, answer) pair of the task, in a fixed order."""
    rows = [(f"What is the capital of {c}?", a) for c, a in CAPITALS.items()]
    rows += [(f"How many legs does a {animal} have?", a) for animal, a in LEGS.items()]
    rows += [(f"What color is {thing}?", a) for thing, a in COLORS.items()]
    rows += [(f"What is the opposite of {w}?", a) for w, a in OPPOSITES.items()]
    rows += [(f"What is {a} plus {b}?", NUMBERS[a + b]) for a in range(1, 7) for b in range(1, 7)]
    rows += [(f"Which city is the capital of {c}?", a) for c, a in CAPITALS.items()]
    rows += [(f"Name the color of {thing}.", a) for thing, a in COLORS.items()]
    rows += [(f"How many legs has a {animal} got?", a) for animal, a in LEGS.items()]
    return [{"prompt": q, "answer": a} for q, a in rows]


def is_heldout(prompt: str, share: float = 0.2) -> bool:
    return int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) / 16**8 < share


def context_messages() -> list[dict]:
    """The teacher's turns: the demonstrations, then the question (``{prompt}``)."""
    turns = []
    for question, answer in DEMONSTRATIONS:
        turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return [*turns, {"role": "user", "content": "{prompt}"}]


# The student's turn in the tasks' greedy figures: the bare question.
BARE_QUESTION = [{"role": "user", "content": "{prompt}"}]


def build_task(out: Path, log=info) -> dict:
    """``train.jsonl`` and ``heldout.jsonl`` in ``out`` and the path of the converted student."""
    rows = questions()
    random.Random(0).shuffle(rows)
    demo_questions = {q for q, _ in DEMONSTRATIONS}
    rows = [r for r in rows if r["prompt"] not in demo_questions]
    split = {"train": [r for r in rows if not is_heldout(r["prompt"])], "heldout": [r for r in rows if is_heldout(r["prompt"])]}
    for name, part in split.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    student = ensure_real_model(STUDENT, log=log)
    details = {"train": len(split["train"]), "heldout": len(split["heldout"]), "student": str(student)}
    # The demo table's first rows: the student with and without the demonstrations, greedy, the way
    # the demo evaluates every policy (its answer_format reward over the held-out questions).
    details["teacher_heldout_accuracy"] = greedy_rate(student, split["heldout"], context_messages(), answer_format)
    details["student_heldout_accuracy"] = greedy_rate(student, split["heldout"], BARE_QUESTION, answer_format)
    (out / "info.json").write_text(json.dumps(details, indent=1))
    log(f"self-distillation task: {details['train']} training and {details['heldout']} held-out questions")
    return details


def greedy_rate(model_dir: Path, rows: list[dict], turns: list[dict], reward, max_new_tokens: int = MAX_TOKENS) -> float:
    """The mean ``reward`` of the greedy answers to ``rows`` (transformers, fp32), each question asked
    through ``turns`` (their contents format strings over the row: ``{prompt}``, ``{answer}``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template([{**t, "content": t["content"].format(**r)} for t in turns],
                                       tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"] for r in rows]
    width = max(map(len, prompts))
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(reward(t, r) for t, r in zip(texts, rows)) / len(rows)


def ensure_self_distill_assets(log=info) -> Path:
    """The task's folder (questions and ``info.json`` naming the converted SmolLM2 folder), built once."""
    return cached_build("self-distill-task-v1", lambda folder: build_task(folder, log=log))
