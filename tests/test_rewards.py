"""Rewards: the math reward on a hand-written table, the format reward, and a user's own reward named
by import path (refused by init with one line when it does not import or fails on the first row)."""

import pytest
import yaml
from typer.testing import CliRunner

from gndpo.cli.app import app, register
from gndpo.errors import GndpoError
from gndpo.pipeline.tasks.rewards import REWARDS, answer_match, answer_words, final_answer, get_reward, math_answer, math_format, to_number
from tests.conftest import tiny_config_dict

# (response, reference answer, expected reward). Written by hand: each case says what a person grading
# the response against the reference would decide.
MATH_CASES = [
    # \boxed, including nested braces and the last box winning
    (r"so the answer is \boxed{42}", "42", 1.0),
    (r"\boxed{41}", "42", 0.0),
    (r"first \boxed{3} then, correcting myself, \boxed{4}", "4", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    (r"\boxed{\frac{1}{2}}", "1/3", 0.0),
    (r"\boxed{{12}}", "12", 0.0),  # "{12}" is not a number; the string "{12}" differs from "12"
    (r"\boxed{1,234}", "1234", 1.0),
    (r"\boxed{\$18}", "18", 1.0),
    (r"\boxed{18 \text{ dollars}}", "18", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    (r"\fbox{7}", "7", 1.0),
    (r"\boxed{x+1}", "x+1", 1.0),
    (r"\boxed{}", "0", 0.0),
    (r"\boxed{5", "5", 1.0),  # an unclosed box is ignored; the last number is 5
    # GSM8K "#### n" lines, in the response and in a reference holding the full solution
    ("She pays 3 * 6 = 18.\n#### 18", "18", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("#### -7", "-7", 1.0),
    ("#### -7", "7", 0.0),
    ("#### 18", "Janet sells 16 - 3 - 4 = 9 eggs, 9 * 2 = 18 dollars.\n#### 18", 1.0),
    ("#### 19", "Janet sells 16 - 3 - 4 = 9 eggs, 9 * 2 = 18 dollars.\n#### 18", 0.0),
    ("####", "0", 0.0),  # an empty "####" line and no number at all
    # the last number, when the answer is not marked
    ("The total is 72.", "72", 1.0),
    ("I think 12, no wait, 13", "13", 1.0),
    ("It is 2.50 dollars", "2.5", 1.0),
    ("+5", "5", 1.0),
    ("-0", "0", 1.0),
    ("answer: 3/4", r"\frac{3}{4}", 1.0),
    ("1e5", "100000", 0.0),  # "1e5" is read as the numbers 1 and 5: the last one, 5, is not 100000
    # malformed and empty responses
    ("", "3", 0.0),
    ("I do not know", "3", 0.0),
    ("forty-two", "42", 0.0),
    (r"\boxed{\frac{1}{0}}", "0", 0.0),
]


@pytest.mark.parametrize("response, answer, expected", MATH_CASES, ids=[f"case{i}" for i in range(len(MATH_CASES))])
def test_math_reward_table(response, answer, expected):
    assert math_answer(response, {"answer": answer}) == expected


def test_math_reward_helpers():
    assert final_answer(r"a \boxed{\frac{a}{b_{1}}} b") == r"\frac{a}{b_{1}}"
    assert final_answer("no numbers here") is None
    assert to_number("1,234.5") == to_number("1234.5") and to_number("1,23") is None
    assert to_number(r"\frac{2}{4}") == to_number("1/2") == to_number(".5")


def test_math_reward_without_math_verify_compares_normalized_strings(monkeypatch):
    """The documented fallback where math-verify is not installed: non-numeric answers compare as
    strings with spacing, $ signs and \\text{} removed."""
    import sys

    monkeypatch.setitem(sys.modules, "math_verify", None)  # import now fails
    assert math_answer(r"\boxed{x + 1}", {"answer": "x+1"}) == 1.0
    assert math_answer(r"\boxed{x + 2}", {"answer": "x+1"}) == 0.0
    assert math_answer(r"\boxed{\frac{1}{2}}", {"answer": "0.5"}) == 1.0  # numbers never need it


def test_math_format_reward():
    assert math_format(r"so \boxed{3}", {}) == 1.0
    assert math_format("work\n#### 3", {}) == 1.0
    assert math_format("the answer is 3", {}) == 0.0
    assert math_format(r"\boxed{}", {}) == 0.0 and math_format("####  ", {}) == 0.0


# (response, reference answer, expected answer_match), graded by hand: the short "Answer: X." format
# and the right answer; case and punctuation do not matter, a word that only contains the answer does.
ANSWER_MATCH_CASES = [
    ("Answer: Paris.", "Paris", 1.0),
    ("  answer: paris", "Paris", 0.0),  # the format asks for "Answer:" as written
    ("Answer: The capital is Mexico City.", "Mexico City", 1.0),
    ("Answer: Mexico, the city.", "Mexico City", 0.0),  # the words, but not next to each other
    ("Answer: Four legs.", "Four", 1.0),
    ("Answer: Fourteen.", "Four", 0.0),
    ("Answer: Rome.", "Paris", 0.0),
    ("The capital of France is Paris.", "Paris", 0.0),  # right, but not in the format
    ("Answer: Paris is the capital city of the French Republic.", "Paris", 0.0),  # longer than 8 words
]


@pytest.mark.parametrize("response, answer, expected", ANSWER_MATCH_CASES)
def test_answer_match_reward_table(response, answer, expected):
    assert answer_match(response, {"answer": answer}) == expected


# (response, reference answer, expected answer_words), graded by hand: the answer's words anywhere, in
# any format; number words and digits are the same number, a word that only contains the answer is not it.
ANSWER_WORDS_CASES = [
    ("The capital of France is Paris.", "Paris", 1.0),
    ("paris", "Paris", 1.0),
    ("The capital of Turkey is Istanbul.", "Ankara", 0.0),
    ("It is Mexico City, of course.", "Mexico City", 1.0),
    ("Mexico, the city.", "Mexico City", 0.0),  # the words, but not next to each other
    ("A spider has 8 legs.", "Eight", 1.0),
    ("Six plus nine equals fifteen.", "15", 1.0),
    ("The answer is 2.", "Two", 1.0),
    ("A bee has fourteen legs.", "Four", 0.0),
    ("The plural of goose is goosegoose.", "Geese", 0.0),
    ("", "Paris", 0.0),
    ("Paris", "", 0.0),  # an empty reference matches nothing
]


@pytest.mark.parametrize("response, answer, expected", ANSWER_WORDS_CASES)
def test_answer_words_reward_table(response, answer, expected):
    assert answer_words(response, {"answer": answer}) == expected


def test_builtins_and_import_paths():
    assert {"exact_match", "math", "math_format"} <= set(REWARDS)
    assert get_reward("tests.custom_rewards:answer_in_response")("the answer 42", {"answer": "42"}) == 1.0
    for name, fragment in [
        ("nope", "unknown reward 'nope'"),
        ("tests.no_such_module:f", "does not import: ModuleNotFoundError"),
        ("tests.custom_rewards:missing", "has no function 'missing'"),
        ("tests.custom_rewards_broken:f", "does not import: RuntimeError"),
    ]:
        with pytest.raises(GndpoError, match=fragment):
            get_reward(name)


register()
runner = CliRunner()


@pytest.mark.parametrize(
    "reward, fragment",
    [
        ("tests.no_such_module:score", "does not import"),
        ("tests.custom_rewards:raises", "reward 'tests.custom_rewards:raises' failed on prompt"),
        ("tests.custom_rewards:not_a_number", "failed on prompt"),
        ("tests.custom_rewards:nan", "must be finite numbers"),
    ],
)
def test_init_refuses_a_broken_custom_reward(tmp_path, tiny_assets, reward, fragment):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tiny_config_dict(tiny_assets, reward=reward)))
    run = tmp_path / "run"
    result = runner.invoke(app, ["init", str(run), "--config", str(config)])
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert result.exit_code != 0 and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr
    assert not run.exists()


def test_init_accepts_a_working_custom_reward_also_for_grpo(tmp_path, tiny_assets):
    cfg = tiny_config_dict(tiny_assets, reward="tests.custom_rewards:answer_in_response")
    cfg["method"] = {"name": "grpo", "outcome": {"rewards": ["exact_match", "tests.custom_rewards:answer_in_response"]}}
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(cfg))
    result = runner.invoke(app, ["init", str(tmp_path / "run"), "--config", str(config)])
    assert result.exit_code == 0, result.stderr


def test_unbiased_pass_at_k_against_enumeration():
    """pass@k = P(some correct among k drawn without replacement from n samples, c correct), counted
    over every k-subset."""
    from itertools import combinations

    from gndpo.stages.text.heldout_eval import unbiased_pass_at_k

    for n in range(1, 7):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(combinations(range(n), k))
                want = sum(any(samples[i] for i in sub) for sub in subsets) / len(subsets)
                assert unbiased_pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
