"""The phase clock behind `gndpo status --phases` (gndpo.storage.meter), on a clock the test moves by
hand, and the executor's sums; the end-to-end figures are checked in test_e2e."""

import pytest

from gndpo.pipeline.exec.units import phase_totals
from gndpo.storage import meter
from gndpo.storage.products import Commit, UnitNumbers
from gndpo.storage.runfs import RunFS


@pytest.fixture
def now(monkeypatch):
    """The meter's clock, moved by the test: ``now.t += 2`` is two seconds."""
    class Now:
        t = 100.0
    monkeypatch.setattr(meter.time, "perf_counter", lambda: Now.t)
    return Now


def test_phases_split_a_units_time_and_charge_each_write_to_its_phase(now, tmp_path):
    fs = RunFS(str(tmp_path))
    with meter.unit_clock() as clock:
        with meter.phase("setup"):
            now.t += 3
        now.t += 5  # compute
        fs.write_new("shard.parquet", b"x" * 100)  # a data file outside any phase: "write"
        with meter.phase("export"):
            now.t += 2
            fs.write_new("model/weights", b"y" * 1000)
            with meter.phase("state"):  # nested: its time is not the export's too
                now.t += 4
                fs.write_new("optimizer/state", b"z" * 10)
        now.t += 1  # compute
    got = clock.breakdown()
    # compute: 5 + 1; the shard write took no time on this clock
    assert got == {"compute": {"seconds": 6.0, "bytes": 0}, "export": {"seconds": 2.0, "bytes": 1000},
                   "setup": {"seconds": 3.0, "bytes": 0}, "state": {"seconds": 4.0, "bytes": 10},
                   "write": {"seconds": 0.0, "bytes": 100}}
    assert sum(p["seconds"] for p in got.values()) == 15.0


def test_nothing_is_measured_outside_a_units_clock(tmp_path):
    with meter.phase("export"):
        RunFS(str(tmp_path)).write_new("a", b"123")
    assert meter._clock is None


def test_a_stage_metrics_sum_its_units_phases():
    numbers = [{"phases": {"setup": {"seconds": 1.5, "bytes": 0}, "write": {"seconds": 0.25, "bytes": 7}}},
               {"phases": {"write": {"seconds": 0.5, "bytes": 3}}}, {}]
    commits = [Commit(f"u{i}", 1, [], 0, 0, 0.0, UnitNumbers.of(unit)) for i, unit in enumerate(numbers)]
    assert phase_totals(commits) == {"phase_setup_bytes": 0, "phase_setup_seconds": 1.5,
                                     "phase_write_bytes": 10, "phase_write_seconds": 0.75}
