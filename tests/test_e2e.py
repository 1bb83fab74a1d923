"""End to end through the real components: vLLM rollout, teacher/student scoring, DuckDB normalize,
DeepSpeed train, on tiny toy models. One run is shared by the module (an engine start costs ~20 s)."""

import json

import duckdb
import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import yaml

from gndpo.pipeline.runs import open_run
from gndpo.storage.records import rollout_shards
from gndpo.storage.records import STAGES, manifest_files
from tests.conftest import committed_rows, gndpo, gndpo_killed, tiny_config_dict

pytestmark = pytest.mark.slow
PROMPTS, N = 16, 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_assets):
    """Round 0 through each stage command, then round 1 through the loop."""
    folder = tmp_path_factory.mktemp("e2e")
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config_dict(tiny_assets)))
    run = folder / "run"
    gndpo("init", run, "--config", config)
    for stage in STAGES:
        gndpo(stage, run, "--round", 0)
    gndpo("run", run, "--rounds", 2)
    return run


@pytest.fixture(scope="module")
def kept_runs(tmp_path_factory, tiny_assets):
    """The same config through `gndpo run` alone (one process, engines kept across stages and rounds):
    once uninterrupted, once SIGKILLed during round 1's first optimizer step on the kept DeepSpeed
    engine and then rerun."""
    folder = tmp_path_factory.mktemp("kept")
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config_dict(tiny_assets)))
    kept, crashed = folder / "kept", folder / "crashed"
    for run in (kept, crashed):
        gndpo("init", run, "--config", config)
    log = gndpo("run", kept, "--rounds", 2).stdout
    # Round 0 takes 2 optimizer steps, so the 3rd pass of train.step is round 1's first.
    crash_log = folder / "crash.log"
    code = gndpo_killed("run", crashed, "--rounds", 2, env={"GNDPO_CRASH_AT": "train.step", "GNDPO_CRASH_AFTER": "2"}, log=crash_log)
    assert code == -9, crash_log.read_text()[-2000:]
    assert open_run(str(crashed)).records(1, "train").manifest() is None
    gndpo("run", crashed, "--rounds", 2)
    return kept, crashed, log


def student_weights(run_dir):
    from safetensors.numpy import load_file

    _, path = open_run(str(run_dir)).latest_policy()
    return load_file(f"{path}/model.safetensors")


def test_kept_engines_give_the_rows_and_weights_of_fresh_processes(run_dir, kept_runs):
    """Round 1 on the kept vLLM engine (new weights loaded into it), the kept teacher and the kept
    DeepSpeed engine equals round 1 on engines built from the run folder; so does a run killed during
    the kept engine's update and resumed."""
    kept, crashed, log = kept_runs
    assert log.count("engine: loaded the weights of") == 1  # round 1's rollout reused round 0's engine
    reference = student_weights(run_dir)
    for other in (kept, crashed):
        for stage in ("rollout", "score"):
            assert committed_rows(other, stage, 1) == committed_rows(run_dir, stage, 1), (other.name, stage)
        weights = student_weights(other)
        assert weights.keys() == reference.keys()
        for name in reference:
            np.testing.assert_array_equal(weights[name], reference[name], err_msg=f"{other.name} {name}")
    train = open_run(str(kept)).records(1, "train").manifest()["units"][0]
    assert train["optimizer_state_resumed"] and train["attempt"] == 1


def test_manifests_and_row_counts(run_dir):
    run = open_run(str(run_dir))
    for r in range(2):
        for stage in STAGES:
            assert run.records(r, stage).manifest() is not None, (r, stage)
        rollouts = run.records(r, "rollout").manifest()
        assert sum(f["rows"] for f in rollout_shards(rollouts)) == PROMPTS * N
        assert run.records(r, "score").manifest()["rows"] == PROMPTS * N
        assert 0.0 <= rollouts["metrics"]["heldout_accuracy"] <= 1.0
    ids = [pq.read_table(run_dir / f["path"]).column("rollout_id").to_pylist() for f in rollout_shards(run.records(0, "rollout").manifest())]
    flat = [i for part in ids for i in part]
    assert len(flat) == len(set(flat)) == PROMPTS * N
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(m["round"], m["stage"]) for m in metrics] == [(r, s) for r in range(2) for s in STAGES]


def test_score_shards_are_plain_parquet_and_stats_match_numpy(run_dir):
    run = open_run(str(run_dir))
    files = [str(run_dir / f["path"]) for f in manifest_files(run.records(0, "score").manifest())]
    by_pyarrow = pq.read_table(files[0])
    by_polars = pl.read_parquet(files[0])
    by_duckdb = duckdb.sql(f"SELECT count(*) FROM read_parquet({files!r})").fetchall()[0][0]
    assert by_pyarrow.num_rows == by_polars.height and by_duckdb == PROMPTS * N
    # Global statistics from the normalize stage == numpy over every valid token of the round.
    rollouts = pl.concat([pl.read_parquet(run_dir / f["path"]) for f in rollout_shards(run.records(0, "rollout").manifest())])
    scores = pl.concat([pl.read_parquet(f) for f in files]).join(rollouts.select("rollout_id", "loss_mask"), on="rollout_id")
    c = []
    for t, s, m in zip(scores["teacher_logprobs"], scores["student_logprobs"], scores["loss_mask"]):
        diff = np.clip(np.asarray(t, np.float64) - np.asarray(s, np.float64), -5, 5)
        c.extend(diff[np.asarray(m) == 1])
    stats = run.records(0, "normalize").manifest()["metrics"]
    assert stats["token_count"] == len(c)
    assert stats["c_mean"] == pytest.approx(np.mean(c), rel=1e-9)
    assert stats["c_std"] == pytest.approx(np.std(c, ddof=1), rel=1e-9)


def test_student_logprobs_match_the_sampler(run_dir):
    """The recomputed student log-probs of round 0 agree with vLLM's sampler log-probs."""
    run = open_run(str(run_dir))
    con = duckdb.connect()
    r = [str(run_dir / f["path"]) for f in rollout_shards(run.records(0, "rollout").manifest())]
    s = [str(run_dir / f["path"]) for f in manifest_files(run.records(0, "score").manifest())]
    pairs = con.sql(
        f"SELECT r.sampler_logprobs, s.student_logprobs FROM read_parquet({r!r}) r JOIN read_parquet({s!r}) s USING (rollout_id)"
    ).fetchall()
    diffs = [abs(a - b) for sampler, student in pairs for a, b in zip(sampler, student)]
    assert len(pairs) == PROMPTS * N and max(diffs) < 1e-3


def test_exported_student_loads_and_generates(run_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = open_run(str(run_dir))
    version, path = run.latest_policy()
    assert version == 2
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    out = model.generate(**tok("12+34=", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert out.shape[1] > len(tok("12+34=")["input_ids"])
    # ... and vLLM serves it through `gndpo eval` on the run's held-out prompts.
    result = gndpo("eval", run_dir, "--k", 2, "--n", 3, "--out", tmp_path / "eval")
    assert "policy_version=2" in result.stdout and "pass@1=" in result.stdout and "pass@2=" in result.stdout
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    table = pq.read_table(tmp_path / "eval" / "per_prompt.parquet").to_pylist()
    assert len(table) == summary["prompts"] == len(run.prompts("heldout")) and summary["samples_per_prompt"] == 3
    for row in table:  # pass@2 of 3 samples with c correct: 1 - C(3 - c, 2) / C(3, 2)
        assert 0 <= row["correct"] <= 3 and row["pass@2"] == pytest.approx({0: 0.0, 1: 2 / 3}.get(row["correct"], 1.0))
    assert summary["pass@2"] == pytest.approx(np.mean([row["pass@2"] for row in table]))
    assert summary["pass@1"] == pytest.approx(np.mean([row["greedy_reward"] for row in table]))


def test_status_and_sql_commands(run_dir):
    status = gndpo("status", run_dir).stdout
    assert status.count("committed") == 8
    out = gndpo("sql", run_dir, "SELECT round, count(*) AS n FROM rollouts GROUP BY round ORDER BY round", "--csv").stdout
    assert out.strip().splitlines() == ["round,n", f"0,{PROMPTS * N}", f"1,{PROMPTS * N}"]
    out = gndpo("sql", run_dir, "SELECT value FROM stats WHERE name = 'token_count' AND round = 0", "--csv").stdout
    assert float(out.splitlines()[1]) > 0


def test_rerun_is_a_no_op(run_dir):
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*") if p.is_file())
    gndpo("run", run_dir, "--rounds", 2)
    after = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*") if p.is_file())
    assert before == after


def test_demo_on_prebuilt_assets(tmp_path, tiny_assets):
    out = gndpo(
        "demo", tmp_path / "demo", "--rounds", "1", "--assets", tiny_assets,
        "--set", "rollout.prompts_per_round=8", "--set", "rollout.n=2", "--set", "train.micro_batch_size=8",
        "--set", "engine.max_model_len=32",
    ).stdout
    assert "teacher" in out and "student (start)" in out and "student after round 1" in out


def test_compare_two_methods(tmp_path, tiny_assets):
    """`gndpo compare` runs each method for the same rounds and tabulates accuracy and stability."""
    import json

    small = ["--set", "rollout.prompts_per_round=8", "--set", "rollout.n=2", "--set", "train.micro_batch_size=8",
             "--set", "train.optimizer_steps=2", "--set", "engine.max_model_len=32"]
    out = gndpo("compare", "opd", "forward_kl", "--rounds", "1", "--out", tmp_path / "cmp", "--assets", tiny_assets, *small).stdout
    assert "opd" in out and "forward_kl" in out and "grad_norm_max" in out
    rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["opd", "forward_kl"]
    for r in rows:
        assert 0.0 <= r["acc_r0"] <= 1.0 and 0.0 <= r["acc_r1"] <= 1.0 and r["grad_norm_max"] > 0
    assert rows[0]["adv_min"] >= -5.0 and rows[0]["adv_max"] <= 5.0  # OPD's clamp
    assert rows[1]["adv_min"] is None  # a pure divergence loss has no policy-gradient advantage
    assert (tmp_path / "cmp" / "compare.md").read_text().startswith("| method |")
    bad = gndpo("compare", "opd", "nope", "--out", tmp_path / "bad", check=False)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1 and "unknown method 'nope'" in bad.stderr
    assert not (tmp_path / "bad").exists()
