"""What run.max_staleness promises, checked without an engine: the policy each round samples with (and
the train a rollout reads for it), that every staleness is a run identity of its own, the policy a stale
round's rollout engine is given, and what a fork of a round may change: not the policy its inherited
rollouts were sampled with, nor, at staleness above 0, a loss without an importance ratio."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gndpo.apps.fork import fork_refusal, fork_run
from gndpo.apps.init import init_run
from gndpo.errors import GndpoError
from gndpo.pipeline.config.load import config_from_dict
from gndpo.pipeline.exec.stage import StageContext
from gndpo.pipeline.run.run import Run, open_run
from gndpo.pipeline.settings.schema import Config, RoundsConfig
from gndpo.stages.rollout import RolloutJob
from gndpo.storage.runfs import RunFS
from tests.conftest import tiny_config_dict

# The policy version that samples rounds 0..5 at each staleness: the student after max(k - s, 0) rounds.
SAMPLED_BY = {0: [0, 1, 2, 3, 4, 5], 1: [0, 0, 1, 2, 3, 4], 2: [0, 0, 0, 1, 2, 3], 3: [0, 0, 0, 0, 1, 2]}


def test_each_round_samples_with_the_policy_exactly_its_staleness_behind(tmp_path):
    (read,) = RolloutJob.reads
    for staleness, versions in SAMPLED_BY.items():
        run = Run(RunFS(str(tmp_path)), Config(run=RoundsConfig(max_staleness=staleness)))
        assert [run.sampling_version(k) for k in range(6)] == versions
        # Rollout reads the train that exported its policy (version v is round v-1's export; -1: the student).
        assert [read.round_of(run, k) for k in range(6)] == [v - 1 for v in versions]


def test_every_staleness_is_a_run_identity_of_its_own():
    prints = [Config(run=RoundsConfig(max_staleness=s)).fingerprint() for s in SAMPLED_BY]
    assert len(set(prints)) == len(prints)


@pytest.fixture(scope="module")
def stale_parent(tmp_path_factory, tiny_assets) -> str:
    """A run at staleness 1 (ppo: a ratio) whose rollouts of rounds 0 and 1 are committed (hand-written
    manifests: no engine) and whose train of round 0 is not."""
    url = str(tmp_path_factory.mktemp("stale") / "parent")
    init_run(url, config_from_dict(tiny_config_dict(tiny_assets, method={"policy_loss": "ppo"}, run={"max_staleness": 1})))
    for k in (0, 1):
        open_run(url).records(k, "rollout").create_manifest({"units": [], "metrics": {}})
    return url


class Engines:
    """Stands in for LiveModels: records the policy folder each rollout engine is given."""

    def __init__(self):
        self.policies = []

    def student_engine(self, policy, *args, **kwargs):
        self.policies.append(policy)
        return object()


def test_a_stale_round_rolls_out_on_its_sampling_policy(stale_parent):
    # Round 1 at staleness 1 samples with policy 0 (the student) while round 0 still trains: its engine
    # gets the student's folder, and its rows will say version 0.
    run, engines = open_run(stale_parent), Engines()
    job = RolloutJob(run, 1, StageContext(log=lambda *_: None, live=engines))
    job.setup()
    assert engines.policies == [run.policy_path(0)] and job.version == 0


def test_a_fork_keeps_the_policy_its_rollouts_were_sampled_with(stale_parent):
    cfg = open_run(stale_parent).cfg
    on_policy = replace(cfg, run=replace(cfg.run, max_staleness=0))
    # Round 1 was sampled by policy 0; at staleness 0 the fork would score it as sampled by policy 1.
    assert fork_refusal(stale_parent, 1, on_policy) == (
        f"fork: run.max_staleness 0 would score round 1 as sampled by policy 1, but {stale_parent}'s rollouts of it "
        "were sampled by policy 0 (run.max_staleness 1)")
    assert fork_refusal(stale_parent, 0, on_policy) is None  # round 0 is the student's at every staleness
    assert fork_refusal(stale_parent, 1, replace(cfg, run=replace(cfg.run, max_staleness=2))) is None  # policy 0 as well


def test_a_fork_at_staleness_1_refuses_a_loss_without_a_ratio(stale_parent, tmp_path):
    with pytest.raises(GndpoError, match="run.max_staleness 1 trains on samples of an older policy, and method reopold has policy loss "
                                         "reinforce, with no importance ratio") as refused:
        fork_run(stale_parent, str(tmp_path / "fork"), 0, ["method.name=reopold", "method.policy_loss="])
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "fork").exists()
