"""Score's per-response partial sums survive their shard exactly enough for GNDPO's statistics: the
standard deviation normalize derives from the stored sums is the one of the tokens' own values."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from gndpo.pipeline.methods.distill import gndpo_stats_from_sums, score_partial_sums
from gndpo.storage.runfs import RunFS
from gndpo.storage.shards import SCORES, read_shard, write_shard


def test_the_stored_partial_sums_give_the_tokens_standard_deviation(tmp_path):
    rng = np.random.default_rng(0)
    # Scores near the clamp with a small spread (a teacher far above the student everywhere): sum c^2 -
    # N mean^2 keeps only the last digits of sum c^2 (about 2e4 here, against N var = 8e-4), so each row's
    # sum must be stored in float64 (relative error 1e-16: 2e-12 absolute, 3e-9 of N var) for the std
    # to hold to 1e-6; float32's 6e-8 (1e-3 absolute) would be larger than N var itself.
    c = [4.9 + 1e-3 * rng.standard_normal(100) for _ in range(8)]
    rows = [{"rollout_id": f"r{i}", **score_partial_sums(x, np.ones(x.size, np.int8))} for i, x in enumerate(c)]
    fs = RunFS(str(tmp_path))
    stored = read_shard(fs, write_shard(fs, "part-00000.parquet", pa.Table.from_pylist(rows, schema=SCORES)))
    n, c_sum, c_sq_sum = (sum(stored.column(name).to_pylist()) for name in ("n_valid", "c_sum", "c_sq_sum"))
    assert n == 800
    assert gndpo_stats_from_sums(n, c_sum, c_sq_sum)["c_std"] == pytest.approx(np.concatenate(c).std(ddof=1), rel=1e-6)
