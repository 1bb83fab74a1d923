"""A reward module that fails while importing (a user's typo, a missing dependency)."""

raise RuntimeError("this module needs a package that is not installed")
