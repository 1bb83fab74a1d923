"""The privileged-answer demo task (``gndpo demo --task privileged``): its questions, split and config.

The model-facing part (SmolLM2 greedy answers, a round) needs the real-models packages and lives in the
bench (bench/privileged_answer.py); these checks are the data the task is built from."""

from __future__ import annotations

from pathlib import Path

from gndpo.apps.demos.privileged import CONTEXT, HELDOUT_SHARE, fact_of, questions
from gndpo.apps.demos.self_distill import is_heldout
from gndpo.pipeline.config.load import load_config
from gndpo.pipeline.tasks.rewards import answer_words


def test_questions_are_distinct_and_their_answers_are_right_by_the_reward():
    rows = questions()
    prompts = [r["prompt"] for r in rows]
    assert len(rows) >= 300 and len(set(prompts)) == len(prompts)
    # A response stating the reference answer is correct; one stating another question's answer of the
    # same kind is not (the reward reads content, and the lists do not repeat an answer under two names).
    assert all(answer_words(f"The answer is {r['answer']}.", r) == 1.0 for r in rows)
    assert answer_words("The capital of Turkey is Istanbul.", next(r for r in rows if r["prompt"] == "What is the capital of Turkey?")) == 0.0
    assert next(r["answer"] for r in rows if r["prompt"] == "What is 7 plus 8?") == "15"
    assert next(r["answer"] for r in rows if r["prompt"] == "What day comes after Sunday?") == "Monday"


def test_the_split_holds_out_about_an_eighth_and_facts_recur_across_wordings():
    rows = questions()
    heldout = [r for r in rows if is_heldout(r["prompt"], HELDOUT_SHARE)]
    assert 0.08 < len(heldout) / len(rows) < 0.16
    # Two wordings of one fact are one fact; a different country is another.
    assert fact_of({"prompt": "What is the capital of Peru?", "answer": "Lima"}) == \
        fact_of({"prompt": "Which city is the capital of Peru?", "answer": "Lima"})
    assert fact_of({"prompt": "How many legs does a spider have?", "answer": "Eight"}) == \
        fact_of({"prompt": "How many legs has a spider got?", "answer": "Eight"})
    assert fact_of({"prompt": "What is the capital of Peru?", "answer": "Lima"}) != \
        fact_of({"prompt": "What is the capital of Chile?", "answer": "Santiago"})


def test_the_teacher_context_names_the_answer_and_the_config_parses():
    turn = CONTEXT[0]["content"].format(prompt="What is the capital of Peru?", answer="Lima")
    assert turn == "What is the capital of Peru? (The answer is Lima.)"
    cfg = load_config(str(Path(__file__).parent.parent / "apps" / "demo_privileged.yaml"))
    assert cfg.reward == "answer_words" and cfg.self_teacher.weights == "frozen" and cfg.rollout.eval_heldout
