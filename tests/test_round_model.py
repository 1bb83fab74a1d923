"""The round model (gndpo.apps.round_model) against round times worked out by hand from its rules, and
``run.overlap: auto`` against the model: never an order it predicts slower than sequential."""

from __future__ import annotations

import itertools

import pytest

from gndpo.apps.round_model import AHEAD, SEQUENTIAL, STREAMED, Machine, RoundCosts, StageCost, fastest, paper_costs, predict
from gndpo.apps.schedule import choose_order, machine_of
from gndpo.pipeline.config.load import config_from_dict
from tests.conftest import tiny_config_dict


def costs(rollout, score, normalize, train, units=128, parallel=1.0, served=False) -> RoundCosts:
    return RoundCosts({"rollout": StageCost(rollout, parallel), "score": StageCost(score, parallel, own_devices=served),
                       "normalize": StageCost(normalize, parallel), "train": StageCost(train, parallel)}, units, "given")


def test_the_seeds_scale_by_hand():
    # The student's stages on 6 GPUs, the 8B teacher served on 2 of its own; minutes.
    seeds = costs(28, 11, 0.2, 8, served=True)
    shared = predict(seeds, Machine(6, 6), ahead=1)
    assert shared[SEQUENTIAL] == pytest.approx(47.2)
    assert shared[STREAMED] == pytest.approx(28 + 11 / 128 + 0.2 + 8)  # the teacher's 11 minutes hidden behind rollout
    assert shared[AHEAD] == pytest.approx(28 + 0.2 + 8)  # rollout and train still take turns on the same GPUs
    split = predict(seeds, Machine(6, 4), ahead=1)  # rollout on 4, train on 2: each slower on fewer GPUs
    assert split[STREAMED] == pytest.approx(28 * 6 / 4 + 11 / 128 + 3 * (0.2 + 8))
    assert split[AHEAD] == pytest.approx(max(28 * 6 / 4, 3 * 8.2, 11, split[STREAMED] / 2))


def test_two_cores_gain_only_what_does_not_scale():
    perfect = predict(costs(6, 20, 0.1, 5), Machine(2, 1), ahead=1)
    # Every stage twice as slow on one core: rollout 12 beside the learner's 50.2.
    assert perfect[AHEAD] == pytest.approx(50.2) and perfect[AHEAD] > perfect[SEQUENTIAL]
    assert predict(costs(6, 20, 0.1, 5), Machine(2, 2), ahead=1) == pytest.approx({SEQUENTIAL: 31.1, STREAMED: 31.1, AHEAD: 31.1})
    # A served teacher pinned to the learner's core (score does not scale) and half of rollout and train serial.
    two = RoundCosts({"rollout": StageCost(4, 0.5), "score": StageCost(20, 0.0), "normalize": StageCost(0.1, 0.0),
                      "train": StageCost(5, 0.5)}, 8, "given")
    times = predict(two, Machine(2, 1), ahead=1)
    assert times[SEQUENTIAL] == pytest.approx(29.1)
    assert times[STREAMED] == pytest.approx(max(6, 20) + 20 / 8 + 0.1 + 7.5)
    assert times[AHEAD] == pytest.approx(max(6, 20 + 0.1 + 7.5, times[STREAMED] / 2))
    assert predict(two, Machine(2, 1), ahead=0).keys() == {SEQUENTIAL, STREAMED}


GRID = [costs(r, s, n, t, units=u, parallel=p, served=served)
        for r, s, n, t, u, p, served in itertools.product((1, 30), (0.5, 12), (0.1,), (2, 9), (1, 64), (0.0, 0.6, 1.0), (False, True))]


@pytest.mark.parametrize("machine", [Machine(2, 2), Machine(2, 1), Machine(8, 8), Machine(8, 6), Machine(8, 2)], ids=str)
def test_auto_never_picks_an_order_predicted_slower_than_sequential(tiny_assets, machine, monkeypatch):
    monkeypatch.delenv("GNDPO_STAGE_CPUS", raising=False)
    cfg = config_from_dict(tiny_config_dict(tiny_assets, run={"max_staleness": 1}))
    gpus, learner = machine.devices, machine.devices - machine.rollout
    picked = set()
    for given in GRID:
        times = predict(given, machine, ahead=1)
        order = choose_order(cfg, gpus, learner, costs=given)
        name = SEQUENTIAL if order.sequential else AHEAD if order.rollout_ahead else STREAMED
        assert times[name] <= times[SEQUENTIAL], (given, machine, order)
        assert name == fastest(times, (STREAMED, AHEAD) if machine.split else (STREAMED,))
        picked.add(name)
    assert SEQUENTIAL in picked and len(picked) > 1  # the grid holds both answers on every machine


def test_the_machine_the_model_sees(monkeypatch):
    monkeypatch.setenv("GNDPO_STAGE_CPUS", "rollout=0 score=1 normalize=1 train=1")
    monkeypatch.setattr("gndpo.apps.schedule.usable_cpus", lambda: 2)
    assert machine_of(0, 0) == Machine(2, 1) and machine_of(0, 0).split
    monkeypatch.setenv("GNDPO_STAGE_CPUS", "rollout=0,1 train=1")
    assert not machine_of(0, 0).split
    assert machine_of(8, 2) == Machine(8, 6) and not machine_of(8, 0).split


def test_paper_costs_follow_the_config(tiny_assets):
    local = paper_costs(config_from_dict(tiny_config_dict(tiny_assets)))
    served = paper_costs(config_from_dict(tiny_config_dict(
        tiny_assets, score={"backend": "server", "student_logprobs": "engine", "servers": ["http://127.0.0.1:1"]})))
    assert not local.stages["score"].own_devices and served.stages["score"].own_devices
    # The student's forward over the round's tokens is one unit: recomputing it is the difference.
    assert local.stages["score"].seconds - served.stages["score"].seconds == pytest.approx(1.0)
    assert local.units == 2 and local.stages["rollout"].seconds > local.stages["train"].seconds > local.stages["normalize"].seconds
