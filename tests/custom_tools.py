"""User tools for tests/test_tools.py, named by import path as a user's config would."""

import time


def reverse(arguments, row):
    return str(arguments["text"])[::-1]


def broken(arguments, row):
    raise RuntimeError("the service is down\nsecond line")


def slow(arguments, row):
    time.sleep(5)
    return "too late"


def garbage(arguments, row):
    return object()


def structured(arguments, row):
    return {"rows": [1, 2]}


def nap(arguments, row):
    time.sleep(0.5)
    return "rested"
