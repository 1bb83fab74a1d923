"""Verifiable rewards: named functions of (response text, reference answer) -> float in [0, 1]."""

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


REWARDS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match,
    "integer_format": integer_format,
}


def get_reward(name: str) -> Callable[[str, str], float]:
    if name not in REWARDS:
        raise GndpoError(f"unknown reward {name!r}; choose one of: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]
