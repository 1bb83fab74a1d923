"""Normalize's token quantiles in bounded memory equal DuckDB's exact ``quantile_cont`` bit for bit."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from gndpo.pipeline.methods import base
from gndpo.pipeline.methods.base import StatsQuery


def samples(rng) -> dict[str, np.ndarray]:
    n = 20_000
    return {
        "spread": rng.normal(size=n),
        "heavy_tail": rng.standard_cauchy(n) * 1e3,
        "point_mass": np.where(rng.random(n) < 0.4, 1.0, rng.random(n)),  # an acceptance min(pi_T / pi_S, 1)
        "ties": rng.integers(0, 7, n).astype(np.float64),
        "outlier": np.concatenate([rng.random(n - 1) * 1e-6, [1e300]]),  # one value far from the rest
        "tiny": rng.random(3),
    }


@pytest.mark.parametrize("dtype", ["FLOAT", "DOUBLE"])
@pytest.mark.parametrize("scans", ["one fetch", "many scans"])
def test_quantile_equals_duckdbs_quantile_cont(monkeypatch, dtype, scans):
    if scans == "many scans":  # narrow the range over several scans before fetching
        monkeypatch.setattr(base, "RANGE_BUCKETS", 8)
        monkeypatch.setattr(base, "FETCHED_VALUES", 50)
    rng = np.random.default_rng(0)
    con = duckdb.connect()
    query = StatsQuery(con)
    for name, values in samples(rng).items():
        values = values.astype(np.float32 if dtype == "FLOAT" else np.float64)
        if dtype == "FLOAT":
            values = values[np.isfinite(values)]
        con.register("raw", pa.table({"x": values, "ok": rng.random(len(values)) < 0.9}))
        con.execute(f"CREATE OR REPLACE VIEW tokens AS SELECT CASE WHEN ok THEN x::{dtype} END AS hS FROM raw")  # nulls left out
        for q in (0.0, 0.001, 0.25, 0.5, 0.7, 0.999, 1.0):
            exact = con.execute(f"SELECT quantile_cont(hS, {q})::DOUBLE FROM tokens").fetchall()[0][0]
            got = query.quantile("hS", q)
            assert got == exact or (np.isnan(got) and np.isnan(exact)), (name, q, got, exact)


def test_quantile_of_no_values_is_none():
    con = duckdb.connect()
    con.execute("CREATE VIEW tokens AS SELECT NULL::DOUBLE AS hS FROM range(3)")
    assert StatsQuery(con).quantile("hS", 0.5) is None
