"""The seeding rule: every sampling seed of a run is derived from named parts, never from a worker,
a batch or the time, so a retried unit (or a fork re-running a stage) samples what the first try did."""

from __future__ import annotations

import hashlib


def derived_seed(*parts) -> int:
    """A 32-bit sampling seed determined by ``parts`` alone (never by a worker or a batch), so a retried
    request samples what the first try did."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "little")
