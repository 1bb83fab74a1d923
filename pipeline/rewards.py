"""Verifiable rewards: named functions of (response text, reference answer) -> float in [0, 1].

correctness (exact_match), integer answer (integer_format) and format (answer_length)."""

from __future__ import annotations

import re
from typing import Callable

from gndpo.errors import GndpoError


def exact_match(response: str, answer: str) -> float:
    """1 if the response, stripped, is exactly the reference answer."""
    return float(response.strip() == str(answer).strip())


def integer_format(response: str, answer: str) -> float:
    """1 if the response is a bare (possibly signed) integer, whatever its value."""
    return float(re.fullmatch(r"\s*-?\d+\s*", response) is not None)


def answer_length(response: str, answer: str) -> float:
    """Format: 1 if the stripped response has as many characters as the reference answer (the toy
    task's answers are fixed-width, so this rewards the format without looking at the digits)."""
    return float(len(response.strip()) == len(str(answer).strip()))


# Rollout stores every one of these per response (the ``rewards`` map), so GDPO and the logs can use
# any of them; ``reward`` in the config names the primary one (accuracy, pass rates, GRPO default).
REWARDS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match,
    "integer_format": integer_format,
    "answer_length": answer_length,
}


def get_reward(name: str) -> Callable[[str, str], float]:
    if name not in REWARDS:
        raise GndpoError(f"unknown reward {name!r}; choose one of: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]
