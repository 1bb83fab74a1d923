"""The one exception type that means "the user (or their data) did something wrong".

The CLI prints these as a single line and exits non-zero; anything else is a bug and keeps its traceback.
"""


class GndpoError(Exception):
    """A user-facing error: bad input, a missing path, a corrupt shard, a mismatched run folder."""
