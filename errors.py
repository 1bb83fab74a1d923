"""The one exception type that means "the user (or their data) did something wrong".

The CLI prints these as a single line and exits non-zero; anything else is a bug and keeps its traceback.
"""


class GndpoError(Exception):
    """A user-facing error: bad input, a missing path, a corrupt shard, a mismatched run folder."""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name when it has none: a failure named in one
    line beside other output (a warning, a user error that adds its own context)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
