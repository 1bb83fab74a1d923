"""The privileged-answer task: SmolLM2 answers short factual questions, its teacher has read the answer.

On-policy self-distillation with privileged information: the teacher is the frozen initial student,
the same pretrained model, reading the question with the reference answer in brackets after it; the
student reads the bare question. Unlike the self-distillation demo (a format the bare student never samples), the bare student
already answers many of these questions, right or wrong, in its own words: when it samples the right
answer the teacher agrees, when it samples a wrong one the teacher, who knows better, does not. That is
the signal a sampled-token method (OPD, GNDPO) learns from. Correctness is ``answer_words``: the
answer's words anywhere in the response, whatever the format.

About four hundred questions from templates over small fixed lists (the self-distillation demo's
capitals, legs, colours and opposites, and languages, continents, young animals, plurals, the days and
months, sums and differences), most asked in two wordings. Training and held-out questions are split by a
hash of the question, so a held-out question is new wording; its fact is in training in another wording
about as often as ``info.json``'s ``heldout_fact_in_train`` says.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from gndpo.apps.demos.real_models import ensure_real_model
from gndpo.apps.demos.self_distill import BARE_QUESTION, CAPITALS, COLORS, LEGS, OPPOSITES, STUDENT, greedy_rate, is_heldout
from gndpo.pipeline.observe.logs import info
from gndpo.pipeline.tasks.rewards import answer_words
from gndpo.storage.cache import cached_build

# The teacher's turn: the question with its answer in brackets. Tried on a first split's 84 held-out
# questions (greedy, 24 tokens, transformers): correct in 0.86 of them, in the bare student's own words
# ("The capital of Turkey is Ankara."), against 0.57 for the bare question (on the 50 of this split, 16
# tokens: 0.84 against 0.52, info.json). A "Hint: the answer is ..." line after the
# question reaches 0.88 but changes the style ("The answer to this question is Ankara."), which a
# sampled-token method then learns before the facts; the answer in a system turn reaches 0.68.
CONTEXT = [{"role": "user", "content": "{prompt} (The answer is {answer}.)"}]
# The held-out share: ~50 questions, which the round loop evaluates greedily every round, and the answer
# budget (apps/demo_privileged.yaml's rollout.max_tokens) the task's own greedy figures use too.
HELDOUT_SHARE, MAX_TOKENS = 0.12, 16
MORE_CAPITALS = {
    "Italy": "Rome", "Argentina": "Buenos Aires", "South Korea": "Seoul", "Indonesia": "Jakarta", "Philippines": "Manila",
    "Saudi Arabia": "Riyadh", "Nigeria": "Abuja", "Ghana": "Accra", "Ethiopia": "Addis Ababa", "Morocco": "Rabat",
    "Pakistan": "Islamabad", "Czech Republic": "Prague", "Romania": "Bucharest", "Bulgaria": "Sofia", "Serbia": "Belgrade",
    "Croatia": "Zagreb", "Iceland": "Reykjavik", "Venezuela": "Caracas", "Jamaica": "Kingston", "New Zealand": "Wellington",
    "Malaysia": "Kuala Lumpur", "Iraq": "Baghdad", "Syria": "Damascus", "Lebanon": "Beirut", "Afghanistan": "Kabul",
    "Nepal": "Kathmandu", "Qatar": "Doha", "Libya": "Tripoli", "Sudan": "Khartoum", "Uganda": "Kampala",
    "Zimbabwe": "Harare", "North Korea": "Pyongyang", "Estonia": "Tallinn", "Latvia": "Riga", "Lithuania": "Vilnius",
    "Slovakia": "Bratislava", "Albania": "Tirana", "Ecuador": "Quito", "Uruguay": "Montevideo",
}
LANGUAGES = {
    "France": "French", "Germany": "German", "Spain": "Spanish", "Italy": "Italian", "Japan": "Japanese",
    "Russia": "Russian", "Portugal": "Portuguese", "Brazil": "Portuguese", "Greece": "Greek", "Poland": "Polish",
    "the Netherlands": "Dutch", "Sweden": "Swedish", "Norway": "Norwegian", "Finland": "Finnish", "Denmark": "Danish",
    "Turkey": "Turkish", "Egypt": "Arabic", "Mexico": "Spanish", "Argentina": "Spanish", "South Korea": "Korean",
    "Thailand": "Thai", "Vietnam": "Vietnamese", "Hungary": "Hungarian", "Saudi Arabia": "Arabic",
}
CONTINENTS = {
    "France": "Europe", "Kenya": "Africa", "Japan": "Asia", "Brazil": "South America", "Canada": "North America",
    "Egypt": "Africa", "India": "Asia", "Peru": "South America", "Mexico": "North America", "Norway": "Europe",
    "Nigeria": "Africa", "Thailand": "Asia", "Chile": "South America", "Germany": "Europe", "Morocco": "Africa",
    "Vietnam": "Asia", "Argentina": "South America", "Spain": "Europe", "Ghana": "Africa", "Nepal": "Asia",
    "Colombia": "South America", "Poland": "Europe", "Ethiopia": "Africa", "China": "Asia", "Cuba": "North America",
}
YOUNG = {
    "dog": "Puppy", "cat": "Kitten", "cow": "Calf", "horse": "Foal", "sheep": "Lamb", "frog": "Tadpole",
    "kangaroo": "Joey", "duck": "Duckling", "bear": "Cub", "pig": "Piglet", "deer": "Fawn", "chicken": "Chick",
    "goose": "Gosling", "swan": "Cygnet", "goat": "Kid", "lion": "Cub",
}
PLURALS = {
    "mouse": "Mice", "child": "Children", "foot": "Feet", "tooth": "Teeth", "goose": "Geese", "man": "Men",
    "woman": "Women", "person": "People", "ox": "Oxen", "cactus": "Cacti", "leaf": "Leaves", "knife": "Knives",
}
MORE_OPPOSITES = {
    "left": "Right", "black": "White", "rich": "Poor", "strong": "Weak", "thick": "Thin", "high": "Low",
    "near": "Far", "clean": "Dirty", "sweet": "Sour", "cheap": "Expensive", "love": "Hate", "win": "Lose",
}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
          "December"]


def questions() -> list[dict]:
    """Every (prompt, answer) pair of the task, in a fixed order."""
    capitals, opposites = {**CAPITALS, **MORE_CAPITALS}, {**OPPOSITES, **MORE_OPPOSITES}
    rows = [(f"What is the capital of {c}?", a) for c, a in capitals.items()]
    rows += [(f"Which city is the capital of {c}?", a) for c, a in capitals.items()]
    rows += [(f"What language is spoken in {c}?", a) for c, a in LANGUAGES.items()]
    rows += [(f"What is the main language of {c}?", a) for c, a in LANGUAGES.items()]
    rows += [(f"On which continent is {c}?", a) for c, a in CONTINENTS.items()]
    rows += [(f"How many legs does a {animal} have?", a) for animal, a in LEGS.items()]
    rows += [(f"How many legs has a {animal} got?", a) for animal, a in LEGS.items()]
    rows += [(f"What color is {thing}?", a) for thing, a in COLORS.items()]
    rows += [(f"Name the color of {thing}.", a) for thing, a in COLORS.items()]
    rows += [(f"What is the opposite of {w}?", a) for w, a in opposites.items()]
    rows += [(f"What is a baby {animal} called?", a) for animal, a in YOUNG.items()]
    rows += [(f"What is the plural of {w}?", a) for w, a in PLURALS.items()]
    rows += [(f"What day comes after {d}?", DAYS[(i + 1) % 7]) for i, d in enumerate(DAYS)]
    rows += [(f"What month comes after {m}?", MONTHS[(i + 1) % 12]) for i, m in enumerate(MONTHS)]
    rows += [(f"What is {a} plus {b}?", str(a + b)) for a in range(2, 10) for b in range(2, 10) if (a + b) % 3 == 0]
    rows += [(f"What is {a} minus {b}?", str(a - b)) for a in range(5, 13) for b in range(1, 5) if (a + b) % 2 == 0]
    return [{"prompt": q, "answer": a} for q, a in rows]


def fact_of(row: dict) -> tuple[str, str]:
    """What a question asks about, whatever its wording: (its subject's last words, the answer)."""
    subject = row["prompt"].rstrip("?.").split(" of ")[-1].split(" in ")[-1].split(" does a ")[-1].split(" has a ")[-1]
    return subject.removesuffix(" have").removesuffix(" got"), row["answer"]


def build_task(out: Path, log=info) -> dict:
    """``train.jsonl`` and ``heldout.jsonl`` in ``out``, the converted student's path, and the student's
    greedy held-out correctness with and without the answer in its context."""
    rows = questions()
    random.Random(0).shuffle(rows)
    heldout = {r["prompt"] for r in rows if is_heldout(r["prompt"], HELDOUT_SHARE)}
    split = {"train": [r for r in rows if r["prompt"] not in heldout], "heldout": [r for r in rows if r["prompt"] in heldout]}
    for name, part in split.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    student = ensure_real_model(STUDENT, log=log)
    trained_facts = {fact_of(r) for r in split["train"]}
    details = {"train": len(split["train"]), "heldout": len(split["heldout"]), "student": str(student),
               "heldout_fact_in_train": sum(fact_of(r) in trained_facts for r in split["heldout"]) / len(split["heldout"])}
    details["teacher_heldout_accuracy"] = greedy_rate(student, split["heldout"], CONTEXT, answer_words, MAX_TOKENS)
    details["student_heldout_accuracy"] = greedy_rate(student, split["heldout"], BARE_QUESTION, answer_words, MAX_TOKENS)
    (out / "info.json").write_text(json.dumps(details, indent=1))
    log(f"privileged-answer task: {details['train']} training and {details['heldout']} held-out questions")
    return details


def ensure_privileged_assets(log=info) -> Path:
    """The task's folder (questions and ``info.json`` naming the converted SmolLM2 folder), built once."""
    return cached_build("privileged-answer-task-v2", lambda folder: build_task(folder, log=log))
