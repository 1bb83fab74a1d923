"""One training file is enough: without ``data.heldout``, init holds a few of data.train's prompts out by
a hash of each prompt (``data.heldout_share``, at most ``data.heldout_max``), never trained on, the same
whatever the file's order or later additions; with ``rollout.eval_heldout`` off it holds nothing out and
the rounds log no held-out figure. A held-out file that is given still wins. The rounds on one file, with
and without answers, are in tests/test_prompts_without_answers.py and test_the_single_file_round below."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from gndpo.pipeline.observe.metrics import collect_metrics
from gndpo.pipeline.run.prompts import load_prompts, split_heldout
from gndpo.pipeline.run.run import open_run
from gndpo.pipeline.settings.schema import DataConfig
from tests.conftest import assert_one_line_error, invoke, invoke_ok, tiny_config_dict, write_config


def table_of(prompts: list[str]) -> pl.DataFrame:
    return pl.DataFrame({"prompt_id": [hashlib.sha1(p.encode()).hexdigest()[:16] for p in prompts], "prompt": prompts})


def rank_by_hand(prompt: str) -> float:
    """A prompt's held-out rank re-derived: the first 15 hex digits of sha256("heldout:" + its id) / 16^15."""
    return int(hashlib.sha256(f"heldout:{hashlib.sha1(prompt.encode()).hexdigest()[:16]}".encode()).hexdigest()[:15], 16) / 16**15


def held_by_hand(prompts: list[str], share: float, most: int) -> set[str]:
    """The held-out prompts re-derived: those whose rank is below ``share``, the lowest ``most`` of them,
    or the lowest one where none is."""
    below = sorted((rank_by_hand(p), p) for p in prompts if rank_by_hand(p) < share)[:most] or [min((rank_by_hand(p), p) for p in prompts)]
    return {p for _, p in below}


def test_the_split_is_the_hash_rule_whatever_the_order():
    prompts = [f"{a}+{b}=" for a in range(40) for b in range(25)]  # 1,000 prompts
    train, held = split_heldout(table_of(prompts), DataConfig(heldout_share=0.02, heldout_max=256))
    expected = held_by_hand(prompts, 0.02, 256)
    assert set(held["prompt"]) == expected and 8 <= len(expected) <= 40  # about 20
    assert set(train["prompt"]) == set(prompts) - expected
    assert train["prompt"].to_list() == [p for p in prompts if p not in expected]  # the rest keep their order

    shuffled = prompts[:]
    random.Random(0).shuffle(shuffled)
    assert set(split_heldout(table_of(shuffled), DataConfig())[1]["prompt"]) == expected
    # Prompts added later move no prompt across (below the cap).
    more = prompts + [f"{a}*{b}=" for a in range(30) for b in range(30)]
    assert expected <= set(split_heldout(table_of(more), DataConfig())[1]["prompt"])


def test_repeats_stay_together_and_the_bounds_hold():
    prompts = [f"q{i}" for i in range(300)]
    repeated = prompts + prompts[:150]
    train, held = split_heldout(table_of(repeated), DataConfig(heldout_share=0.5, heldout_max=10))
    assert held["prompt"].n_unique() == 10 and set(held["prompt"]) == held_by_hand(prompts, 0.5, 10)
    assert not set(held["prompt"]) & set(train["prompt"])
    assert held.height + train.height == len(repeated)  # a repeated held-out prompt has both rows there
    few = split_heldout(table_of(prompts[:5]), DataConfig(heldout_share=0.001))[1]
    assert set(few["prompt"]) == held_by_hand(prompts[:5], 0.001, 256) and few.height == 1  # at least one
    nothing = split_heldout(table_of(prompts), DataConfig(heldout_share=0.0))
    assert nothing[0].height == 300 and nothing[1].height == 0


def test_a_prompt_ranked_exactly_at_the_share_is_trained_on():
    """The split holds out the prompts ranked *below* data.heldout_share: a share equal to a prompt's rank
    (a float init can be given) leaves that prompt in train, and the next float above it holds it out."""
    prompts = [f"q{i}" for i in range(50)]
    ranked = sorted(prompts, key=rank_by_hand)
    boundary = ranked[9]  # not the lowest: that one is held out whatever the share
    share = rank_by_hand(boundary)
    train, held = split_heldout(table_of(prompts), DataConfig(heldout_share=share))
    assert set(held["prompt"]) == set(ranked[:9]) and boundary in set(train["prompt"])
    above = split_heldout(table_of(prompts), DataConfig(heldout_share=math.nextafter(share, 1)))[1]
    assert set(above["prompt"]) == set(ranked[:10])


def single_file_config(folder: Path, tiny_assets: Path, answers: bool = True, **sections) -> Path:
    """The tests' tiny config with data.train alone (answers dropped unless ``answers``)."""
    cfg = tiny_config_dict(tiny_assets, **sections)
    rows = [json.loads(line) for line in (tiny_assets / "train.jsonl").read_text().splitlines()]
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps(r if answers else {"prompt": r["prompt"]}) + "\n" for r in rows))
    cfg["data"] = {"train": str(train)}
    return write_config(folder, cfg)


def test_init_holds_out_of_the_one_file_and_says_so(tmp_path, tiny_assets, caplog):
    config = single_file_config(tmp_path, tiny_assets, rollout={"prompts_per_round": 8})
    with caplog.at_level(logging.INFO, logger="gndpo"):  # the terminal's level is another test's to set
        invoke_ok("init", tmp_path / "run", "--config", config, "data.heldout_share=0.1")
    said = " ".join(r.getMessage() for r in caplog.records)
    run = open_run(str(tmp_path / "run"))
    train, held = run.prompts("train"), run.prompts("heldout")
    everything = load_prompts(str(tmp_path / "train.jsonl")).to_dicts()
    assert {r["prompt"] for r in held} == held_by_hand([r["prompt"] for r in everything], 0.1, 256)
    assert len(train) + len(held) == len(everything) and not {r["prompt_id"] for r in held} & {r["prompt_id"] for r in train}
    assert f"{len(held)} of data.train's {len(everything)} prompts are held out" in said
    assert "data.heldout=FILE" in said and run.heldout_measure() == "accuracy"

    # Another run of the same file (a re-init, a fork's parent file) holds out the same prompts.
    invoke_ok("init", tmp_path / "again", "--config", config, "data.heldout_share=0.1", "rollout.seed=3")
    assert open_run(str(tmp_path / "again")).prompts("heldout") == held


def test_a_heldout_file_still_wins(tmp_path, tiny_assets, caplog):
    config = single_file_config(tmp_path, tiny_assets)
    with caplog.at_level(logging.INFO, logger="gndpo"):
        invoke_ok("init", tmp_path / "run", "--config", config, f"data.heldout={tiny_assets / 'heldout.jsonl'}")
    run = open_run(str(tmp_path / "run"))
    assert len(run.prompts("train")) == 96 and len(run.prompts("heldout")) == 24
    assert not [r for r in caplog.records if "held out" in r.getMessage()]


def test_without_the_heldout_evaluation_nothing_is_held_out(tmp_path, tiny_assets, caplog):
    config = single_file_config(tmp_path, tiny_assets, answers=False)
    with caplog.at_level(logging.INFO, logger="gndpo"):
        invoke_ok("init", tmp_path / "run", "--config", config, "rollout.eval_heldout=false")
    run = open_run(str(tmp_path / "run"))
    assert len(run.prompts("train")) == 96 and run.prompts("heldout") == [] and run.heldout_measure() == "none"
    assert not [r for r in caplog.records if "held out" in r.getMessage()]
    refused = invoke("eval", tmp_path / "run", "--out", tmp_path / "eval")
    assert_one_line_error(refused, "has no held-out prompts", "--prompts FILE")
    assert not (tmp_path / "eval").exists()


def test_a_file_too_small_to_hold_out_from_is_one_line(tmp_path, tiny_assets):
    config = single_file_config(tmp_path, tiny_assets, rollout={"prompts_per_round": 96})
    result = invoke("init", tmp_path / "run", "--config", config)
    assert_one_line_error(result, "data.train has", "fewer than rollout.prompts_per_round 96", "held out")
    assert not (tmp_path / "run").exists() or not (tmp_path / "run" / "run.yaml").exists()


@pytest.mark.slow
def test_the_single_file_round(tmp_path, tiny_assets):
    """data.train alone, with answers: `gndpo run` trains a round and logs the greedy held-out accuracy
    on the prompts held out of it (the run without answers is test_two_rounds_of_gndpo_on_prompts_only)."""
    run_dir = tmp_path / "run"
    invoke_ok("init", run_dir, "--config", single_file_config(tmp_path, tiny_assets, rollout={"prompts_per_round": 8}),
              "data.heldout_share=0.05")
    invoke_ok("run", run_dir, "--rounds", 1)
    run = open_run(str(run_dir))
    by = {(m["round"], m["stage"]): m for m in collect_metrics(run)}
    assert np.isfinite(by[(0, "rollout")]["heldout_accuracy"]) and 0 < len(run.prompts("heldout")) < 24
    assert (run_dir / "rounds" / "r0000" / "train" / "_MANIFEST.json").exists()
