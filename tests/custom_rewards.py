"""Rewards a user might write, named by import path in tests (``tests.custom_rewards:...``)."""


def answer_in_response(response: str, row: dict) -> float:
    return float(str(row["answer"]).strip() in response)


def raises(response: str, row: dict) -> float:
    raise KeyError("solution")


def not_a_number(response: str, row: dict):
    return "correct"


def nan(response: str, row: dict) -> float:
    return float("nan")
