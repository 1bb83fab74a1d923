"""An example of a user's reward for `examples/own-chat-data-gdpo.yaml`: a function of (response text,
prompt row) returning a float. The row holds the prompt file's prompt_id, prompt, messages (JSON) and
the answer column (named by data.answer_key)."""


def contains_reference(response: str, row: dict) -> float:
    """1 if the reference answer appears in the response, ignoring case."""
    return float(str(row["answer"]).strip().lower() in response.lower())
