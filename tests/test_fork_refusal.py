"""Whether a run may fork another (`fork_refusal`), and how `gndpo demo`/`compare` use it: fork where
the settings allow, start afresh with the reason logged where they do not, and let a real error from
the fork propagate. No engines: a committed rollout is a hand-written manifest, and the demo stops
before its first round."""

from dataclasses import replace

import pytest

from gndpo.apps import demo
from gndpo.apps.fork import fork_refusal
from gndpo.apps.init import init_run
from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import load_config
from gndpo.pipeline.run.run import open_run
from tests.conftest import tiny_config_dict, write_config


@pytest.fixture
def parent(tmp_path, tiny_assets):
    cfg = load_config(str(write_config(tmp_path, tiny_config_dict(tiny_assets))))
    url = str(tmp_path / "parent")
    init_run(url, cfg)
    return url, cfg


def test_fork_refusal_names_the_reason_or_none(parent, tmp_path):
    url, cfg = parent
    assert "its rollout of round 0 is not committed" in fork_refusal(url, 0, cfg)
    open_run(url).records(0, "rollout").create_manifest({"units": [], "metrics": {}})
    assert fork_refusal(url, 0, cfg) is None
    assert "round 1 is not committed" in fork_refusal(url, 1, cfg)
    other = replace(cfg, rollout=replace(cfg.rollout, max_tokens=4))
    assert fork_refusal(url, 0, other) == f"fork: rollout cannot change: round 0's rollouts were sampled with {url}'s rollout"
    # A parent that is no run at all is an error, not a reason to start afresh.
    with pytest.raises(GndpoError):
        fork_refusal(str(tmp_path / "nowhere"), 0, cfg)


class Stop(Exception):
    """Raised where the demo would start its first round."""


@pytest.fixture
def demo_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(demo, "init_run", lambda url, cfg: calls.append("init"))
    monkeypatch.setattr(demo, "fork_run", lambda *a, **k: calls.append("fork"))

    def run_loop(*a, **k):
        raise Stop

    monkeypatch.setattr(demo, "run_loop", run_loop)
    monkeypatch.setattr(demo, "LiveModels", lambda **k: type("Live", (), {"close": lambda self: None})())
    return calls


def run_demo(tmp_path, tiny_assets, fork_from=None) -> list[str]:
    lines = []
    with pytest.raises(Stop):
        demo.run_demo(str(tmp_path / "demo"), assets=str(tiny_assets), log=lines.append, fork_from=fork_from)
    return lines


def test_demo_forks_only_where_the_settings_allow(tmp_path, tiny_assets, demo_calls, monkeypatch):
    seen = []
    monkeypatch.setattr(demo, "fork_refusal", lambda *a: seen.append(a) or None)
    run_demo(tmp_path, tiny_assets)
    assert demo_calls == ["init"] and seen == []  # no run to fork: no check either
    assert "round 0 rollouts: reused from /parent" in run_demo(tmp_path, tiny_assets, "/parent")
    assert demo_calls == ["init", "fork"]
    monkeypatch.setattr(demo, "fork_refusal", lambda *a: "fork: rollout cannot change")
    assert "round 0 rollouts: sampled anew (fork: rollout cannot change)" in run_demo(tmp_path, tiny_assets, "/parent")
    assert demo_calls == ["init", "fork", "init"]


@pytest.mark.parametrize("error", [GndpoError("run folder exists with other settings"), OSError("disk full")])
def test_demo_lets_a_failing_fork_fail(tmp_path, tiny_assets, demo_calls, monkeypatch, error):
    monkeypatch.setattr(demo, "fork_refusal", lambda *a: None)

    def fork_run(*a, **k):
        raise error

    monkeypatch.setattr(demo, "fork_run", fork_run)
    with pytest.raises(type(error), match=str(error)):
        demo.run_demo(str(tmp_path / "demo"), assets=str(tiny_assets), log=lambda *_: None, fork_from="/parent")
    assert demo_calls == []  # no fresh run in its place
