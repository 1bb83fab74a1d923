"""Progress, logging and metrics publishing without engines (the end-to-end checks are in test_e2e)."""

import logging
from types import SimpleNamespace

from gndpo.pipeline.observe import logs, metrics, progress
from gndpo.pipeline.settings.schema import Config, LoggingConfig
from gndpo.storage.products import Manifest


def test_lines_mode_writes_a_plain_line_per_interval_and_at_the_end(caplog, monkeypatch):
    monkeypatch.setenv("GNDPO_PROGRESS", "lines")
    progress.configure(interval=3600)
    with caplog.at_level(logging.INFO, logger="gndpo.progress"):
        with progress.task("score r2", total=4, unit="units") as t:
            t.advance(1, tokens=1000)
            t.advance(3, tokens=3000)
            t.show(loss=0.25)
    lines = [r.getMessage() for r in caplog.records if r.name == "gndpo.progress"]
    # The interval has not passed: only the final line, with the sums and the shown value.
    assert len(lines) == 1 and lines[0].startswith("score r2: 4/4 units, tokens 4,000 (") and "loss 0.25" in lines[0]
    progress.configure(mode="none")
    with caplog.at_level(logging.INFO, logger="gndpo.progress"):
        with progress.task("quiet", total=1) as t:
            t.advance(1)
    assert not [r for r in caplog.records if "quiet" in r.getMessage()]


def test_slow_rates_show_their_digits(monkeypatch):
    """16 prompts in 55 s is 0.29 per second, not "0/s" (a user's report); fast rates keep commas."""
    clock = iter([100.0, 155.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    monkeypatch.setenv("GNDPO_PROGRESS", "none")
    progress.configure()
    t = progress.Task("rollout r0", total=2, unit="units")
    t.counts = {"prompts": 16, "tokens": 123_456}
    assert t.details() == "prompts 16 (0.29/s), tokens 123,456 (2,245/s)"


def test_the_finished_state_is_written_once(caplog, monkeypatch):
    """With an interval that always passes, every advance writes a line, but the one that finishes the
    task does not: close() writes the finished state, once ("train r0: 1/1 units" used to appear twice)."""
    monkeypatch.setenv("GNDPO_PROGRESS", "lines")
    progress.configure(interval=0)
    with caplog.at_level(logging.INFO, logger="gndpo.progress"):
        with progress.task("train r0", total=2, unit="units") as t:
            t.advance(1)
            t.advance(1)
    lines = [r.getMessage() for r in caplog.records if r.name == "gndpo.progress"]
    assert [line.split(",")[0] for line in lines] == ["train r0: 1/2 units", "train r0: 2/2 units"]


def test_the_live_view_is_readable_at_80_columns(monkeypatch):
    """Names, counts and times keep their width on an 80-column terminal; the details are cut first."""
    import io

    from rich.console import Console

    screen = io.StringIO()
    monkeypatch.setattr(progress._terminal, "console", Console(file=screen, width=80, force_terminal=True, color_system=None))
    progress.configure("bar")
    with progress.task("rounds", total=8, unit="stages") as rounds, progress.task("rollout r0", total=16, unit="units") as t:
        t.advance(3, tokens=12345, responses=40)
        rounds.advance(1)
        progress._terminal.bar.refresh()
    progress.configure(mode="none")
    last = [line for line in screen.getvalue().replace("\r", "\n").splitlines() if "rollout r0" in line][-1]
    for text in ("rollout r0", "3/16", "units", "ETA", "tokens"):
        assert text in last, last
    assert "…" not in last.split("tokens")[0]  # only the details may be shortened


def test_sql_tables_show_no_dtypes_and_round_floats_while_csv_keeps_every_digit():
    import polars as pl

    from gndpo.storage.tables import encode_frame

    frame = pl.DataFrame({"name": ["a"], "value": [0.123456789]})
    table = encode_frame(frame, "table").decode()
    assert "0.1235" in table and "0.123456789" not in table and "f64" not in table and "str" not in table
    assert encode_frame(frame, "csv").decode() == "name,value\na,0.123456789\n"


def test_non_zero_train_ranks_draw_nothing(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert progress.resolve_mode("bar") == "none"


def test_a_failing_backend_is_a_warning_not_a_failure(monkeypatch, caplog):
    cfg = Config(logging=LoggingConfig(backends=["wandb"]))
    run = SimpleNamespace(cfg=cfg, fs=SimpleNamespace(url="/nowhere"))

    def broken(*args, **kwargs):
        raise RuntimeError("no network\ntraceback lines")

    monkeypatch.setattr(metrics, "log_wandb", broken)
    with caplog.at_level(logging.WARNING):
        metrics.publish_metrics(run, Manifest(round=0, stage="score", units=[], inputs={}, metrics={"tokens": 3}, rows=0, bytes=0, finished_at=0.0), "/tmp")
    assert [r.getMessage() for r in caplog.records] == ["metrics backend wandb failed: no network"]


def test_worker_file_keeps_info_when_the_terminal_shows_warnings_only(tmp_path):
    logs.configure(level="warning", progress_mode="none")
    try:
        with logs.worker_file(str(tmp_path), "r0000-score") as path, logs.unit_context("u00007"):
            logging.getLogger("gndpo").info("committed")
            logging.getLogger("some_library.module").info("library chatter")  # propagates to the root
        text = open(path).read()
        assert "unit=u00007 gndpo: committed" in text and "library chatter" in text
        assert path.endswith("-r0000-score.log")
    finally:
        logs.configure(level="info", progress_mode="none")
