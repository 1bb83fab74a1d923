"""The one exception type that means "the user (or their data) did something wrong".

The CLI prints these as a single line and exits non-zero; anything else is a bug and keeps its traceback.
"""

import difflib


class GndpoError(Exception):
    """A user-facing error: bad input, a missing path, a corrupt shard, a mismatched run folder."""


def first_line(exc: BaseException, with_type: bool = False) -> str:
    """The first line of ``exc``'s message, or its type's name when it has none: a failure named in one
    line beside other output (a warning, a user error that adds its own context). ``with_type``:
    ``TypeName: first line``, for a failure in a user's own code (a reward, a tool, a template), where
    the type is part of what went wrong."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    if with_type:
        return f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return line or type(exc).__name__


def whole_message(exc: BaseException | str, limit: int = 300) -> str:
    """A library's whole message (or a text, such as a server's answer) on one line (whitespace
    collapsed: its first line alone may stop mid-sentence), shortened to ``limit`` characters; an
    exception's type's name when it has none."""
    text = " ".join(str(exc).split()) or (type(exc).__name__ if isinstance(exc, BaseException) else "")
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def did_you_mean(word: str, choices, where: str = "") -> str:
    """", did you mean X?" for the choice closest to a misspelled ``word`` (difflib), or ""."""
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {where}{close[0]}?" if close else ""
