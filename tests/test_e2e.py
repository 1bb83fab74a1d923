"""End to end through the real components: vLLM rollout, teacher/student scoring, DuckDB normalize,
DeepSpeed train, on tiny toy models. One run is shared by the module (an engine start costs ~20 s)."""

import json
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from gndpo.pipeline.observe.metrics import collect_metrics
from gndpo.pipeline.run.run import open_run
from gndpo.stages.registry import STAGE_REGISTRY
from tests.conftest import assert_one_line_error, committed_rows, gndpo, gndpo_killed, invoke, invoke_ok, run_log, tiny_config_dict

STAGES = tuple(STAGE_REGISTRY)

pytestmark = pytest.mark.slow
PROMPTS, N = 16, 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_assets):
    """Round 0 through each stage command, then round 1 through the loop."""
    folder = tmp_path_factory.mktemp("e2e")
    config = folder / "config.yaml"
    # TensorBoard does not change what is computed (logging is not in the fingerprint), so the kept
    # runs below, without it, must still match this run bit for bit.
    config.write_text(yaml.safe_dump(tiny_config_dict(tiny_assets, logging={"backends": ["tensorboard"]})))
    run = folder / "run"
    invoke_ok("init", run, "--config", config)
    for stage in STAGES:
        # rollout and score write every progress line (no interval), to show progress inside a unit
        proc = gndpo(stage, run, "--round", 0, env={"GNDPO_PROGRESS_INTERVAL": "0"} if stage in ("rollout", "score") else None)
        (folder / f"{stage}.stderr").write_text(proc.stderr)
        (folder / f"{stage}.stdout").write_text(proc.stdout)
    proc = gndpo("run", run, "--rounds", 2)
    (folder / "run.stderr").write_text(proc.stderr)
    (folder / "run.stdout").write_text(proc.stdout)
    return run


def test_stdout_carries_only_the_result(run_dir):
    """vLLM's, DeepSpeed's ("[WARNING] real_accelerator", "... built successfully") and torch's lines go
    to stderr or the log file: a stage command's stdout is its one result line, `gndpo run`'s its summary."""
    folder = run_dir.parent
    for stage in STAGES:
        assert (folder / f"{stage}.stdout").read_text().splitlines() == [f"{stage} r0: committed, {_rows(run_dir, stage)} rows"]
    # `gndpo run`'s stdout is one summary line of the newest trained round, with its own manifests' figures.
    by = {(m["round"], m["stage"]): m for m in collect_metrics(open_run(str(run_dir)))}
    assert (folder / "run.stdout").read_text() == (
        f"round 1: held-out {by[(1, 'rollout')]['heldout_accuracy']:.3f}, reward {by[(1, 'normalize')]['reward_mean']:.3f}, "
        f"KL estimate {by[(1, 'normalize')]['reverse_kl_estimate']:.3f}, loss {by[(1, 'train')]['loss_mean']:.4g}, "
        f"grad-norm max {by[(1, 'train')]['grad_norm_max']:.3g}; policy v2 committed (2 rounds trained)\n")


def test_status_phases_account_for_each_stage_and_its_bytes(run_dir):
    """`gndpo status --phases`: round 0 ran a process per stage. Rollout's engine start and score's and
    train's model loads are phases of their own; train's export and optimizer state wrote exactly the bytes of the files its commit lists under the
    model and state folders (sizes read from the disk); each unit's phases add up to its time (set-up
    plus its work); the manifest's phase metrics are the units' sums."""
    from gndpo.pipeline.exec.status import phase_rows

    run = open_run(str(run_dir))
    rows = {(r["round"], r["stage"]): r for r in phase_rows(run)}
    assert set(rows) == {(r, s) for r in range(2) for s in STAGES}
    assert rows[(0, "rollout")]["engine s"] > 1.0  # a vLLM engine start
    assert rows[(0, "score")]["load s"] > 0 and rows[(0, "train")]["load s"] > 0
    # Round 1 is the last `gndpo run --rounds 2` runs: no optimizer state written after it (train.final_state).
    assert rows[(0, "train")]["state s"] > 0 and rows[(1, "train")]["state s"] == 0
    train = run.records(0, "train")
    commit = train.done("update")
    on_disk = lambda folder: sum(p.stat().st_size for p in (run_dir / commit.numbers.model_dir).parent.joinpath(folder).rglob("*") if p.is_file())  # noqa: E731
    assert rows[(0, "train")]["export MB"] == round(on_disk("model") / 1e6, 3)
    assert rows[(0, "train")]["state MB"] == round(on_disk("optimizer") / 1e6, 3) > 0
    for stage in STAGES:
        rec = run.records(0, stage)
        commits = [rec.done(u) for u in sorted(rec.done_units())]
        for c in commits:
            spent = sum(p["seconds"] for p in c.numbers.phases.values())
            unit = c.numbers
            # A worker's set-up (its engine start and model loads among it) comes before a unit's own clock.
            before = sum(unit.phases.get(p, {"seconds": 0})["seconds"] for p in ("setup", "engine", "load"))
            assert unit.seconds <= spent + 0.01 and spent - before <= unit.seconds + 0.01, c
        metrics = rec.manifest().metrics
        for name in {n for c in commits for n in c.numbers.phases}:
            assert metrics[f"phase_{name}_bytes"] == sum(c.numbers.phases.get(name, {"bytes": 0})["bytes"] for c in commits)
    table = invoke_ok("status", run_dir, "--phases").stdout
    assert "export MB" in table and table.count("train") == 2

    # What `gndpo init` estimated for a round (gndpo.apps.round_size): the weights file to 1%,
    # the optimizer state to 3% (DeepSpeed's checkpoint adds some 17 kB of its own, 2% of the toy's),
    # and at least the shards' bytes (written compressed).
    from gndpo.apps.round_size import estimate_round

    longest = max(len(r["prompt_token_ids"]) for r in committed_rows(run_dir))
    size = estimate_round(run.cfg, longest)
    weights_file = (run_dir / commit.numbers.model_dir / "model.safetensors").stat().st_size
    assert size.export_bytes == pytest.approx(weights_file, rel=0.01)
    assert size.state_bytes == pytest.approx(on_disk("optimizer"), rel=0.03)
    shards = sum(u.bytes for s in ("rollout", "score") for u in run.records(0, s).manifest().units if u.unit != "eval-heldout")
    assert shards <= size.shard_bytes, (shards, size)


def _rows(run_dir, stage: str) -> int:
    return open_run(str(run_dir)).records(0, stage).manifest().rows


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
        invoke_ok("init", run, "--config", config)
    invoke_ok("run", kept, "--rounds", 2)  # one call keeps its engines, in this process as in its own
    log = run_log(kept)
    # Round 0 takes 2 optimizer steps, so the 3rd pass of train.step is round 1's first.
    crash_log = folder / "crash.log"
    code = gndpo_killed("run", crashed, "--rounds", 2, env={"GNDPO_CRASH_AT": "train.step", "GNDPO_CRASH_AFTER": "2"}, log=crash_log)
    assert code == -9, crash_log.read_text()[-2000:]
    assert open_run(str(crashed)).records(1, "train").manifest() is None
    invoke_ok("run", crashed, "--rounds", 2)  # the resume, in this process
    return kept, crashed, log


def student_weights(run_dir):
    from safetensors.numpy import load_file

    _, path = open_run(str(run_dir)).latest_policy()
    return load_file(f"{path}/model.safetensors")


def test_kept_engines_give_the_rows_and_weights_of_fresh_processes(run_dir, kept_runs):
    """Round 1 on the kept vLLM engine (the new weights handed over from the kept DeepSpeed engine's
    memory), the kept teacher and the kept DeepSpeed engine equals round 1 on engines built from the
    run folder's exported files; so does a run killed during the kept engine's update and resumed."""
    kept, crashed, log = kept_runs
    # Round 1's rollout reused round 0's engine, the weights handed over from the kept DeepSpeed engine's memory.
    assert log.count("engine: loaded the weights of") == 1 and "from the trainer's memory" in log, log[-3000:]
    reference = student_weights(run_dir)
    for other in (kept, crashed):
        for stage in ("rollout", "score"):
            assert committed_rows(other, stage, 1) == committed_rows(run_dir, stage, 1), (other.name, stage)
        weights = student_weights(other)
        assert weights.keys() == reference.keys()
        for name in reference:
            np.testing.assert_array_equal(weights[name], reference[name], err_msg=f"{other.name} {name}")
    train = open_run(str(kept)).records(1, "train").manifest().units[0]
    assert train.numbers.optimizer_state_resumed and train.attempt == 1


def test_manifests_and_row_counts(run_dir):
    run = open_run(str(run_dir))
    for r in range(2):
        for stage in STAGES:
            assert run.records(r, stage).manifest() is not None, (r, stage)
        rollouts = run.records(r, "rollout").manifest()
        assert sum(f.rows for f in rollouts.row_files()) == PROMPTS * N
        assert run.records(r, "score").manifest().rows == PROMPTS * N
        # The held-out accuracy is the mean greedy reward over the eval shard: one row per held-out prompt.
        evals = [f for u in rollouts.units if not u.is_work for f in u.files]
        greedy = pq.read_table(run_dir / evals[0].path).to_pylist()
        assert len(evals) == 1 and len(greedy) == len(run.prompts("heldout"))
        assert rollouts.metrics["heldout_accuracy"] == pytest.approx(np.mean([float(g["response"].strip() == g["answer"].strip()) for g in greedy]))
    ids = [pq.read_table(run_dir / f.path).column("rollout_id").to_pylist() for f in run.records(0, "rollout").manifest().row_files()]
    flat = [i for part in ids for i in part]
    assert len(flat) == len(set(flat)) == PROMPTS * N
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(m["round"], m["stage"]) for m in metrics] == [(r, s) for r in range(2) for s in STAGES]


def test_score_shards_are_plain_parquet_and_stats_match_numpy(run_dir):
    run = open_run(str(run_dir))
    files = [str(run_dir / f.path) for f in run.records(0, "score").manifest().files()]
    by_pyarrow = pq.read_table(files[0])
    by_polars = pl.read_parquet(files[0])
    by_duckdb = duckdb.sql(f"SELECT count(*) FROM read_parquet({files!r})").fetchall()[0][0]
    assert by_pyarrow.num_rows == by_polars.height and by_duckdb == PROMPTS * N
    # Global statistics from the normalize stage == numpy over every valid token of the round.
    rollouts = pl.concat([pl.read_parquet(run_dir / f.path) for f in run.records(0, "rollout").manifest().row_files()])
    scores = pl.concat([pl.read_parquet(f) for f in files]).join(rollouts.select("rollout_id", "loss_mask"), on="rollout_id")
    c = []
    for t, s, m in zip(scores["teacher_logprobs"], scores["student_logprobs"], scores["loss_mask"]):
        diff = np.clip(np.asarray(t, np.float64) - np.asarray(s, np.float64), -5, 5)
        c.extend(diff[np.asarray(m) == 1])
    stats = run.records(0, "normalize").manifest().metrics
    assert stats["token_count"] == len(c)
    assert stats["c_mean"] == pytest.approx(np.mean(c), rel=1e-9)
    assert stats["c_std"] == pytest.approx(np.std(c, ddof=1), rel=1e-9)


def test_student_logprobs_match_the_sampler(run_dir):
    """The recomputed student log-probs of round 0 agree with vLLM's sampler log-probs."""
    run = open_run(str(run_dir))
    con = duckdb.connect()
    r = [str(run_dir / f.path) for f in run.records(0, "rollout").manifest().row_files()]
    s = [str(run_dir / f.path) for f in run.records(0, "score").manifest().files()]
    pairs = con.sql(
        f"SELECT r.sampler_logprobs, s.student_logprobs FROM read_parquet({r!r}) r JOIN read_parquet({s!r}) s USING (rollout_id)"
    ).fetchall()
    diffs = [abs(a - b) for sampler, student in pairs for a, b in zip(sampler, student)]
    assert len(pairs) == PROMPTS * N and max(diffs) < 1e-3


def test_exported_student_loads_and_generates(run_dir, tmp_path):
    """The exported student is a plain transformers model, and vLLM serves it through `gndpo eval`: both
    give the same greedy answers to the run's held-out prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = open_run(str(run_dir))
    version, path = run.latest_policy()
    assert version == 2
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    result = invoke_ok("eval", run_dir, "--k", 2, "--n", 3, "--out", tmp_path / "eval")
    assert "policy_version=2" in result.stdout and "pass@1=" in result.stdout and "pass@2=" in result.stdout
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    table = pq.read_table(tmp_path / "eval" / "per_prompt.parquet").to_pylist()
    assert len(table) == summary["prompts"] == len(run.prompts("heldout")) and summary["samples_per_prompt"] == 3
    for row in table:  # pass@2 of 3 samples with c correct: 1 - C(3 - c, 2) / C(3, 2)
        assert 0 <= row["correct"] <= 3 and row["pass@2"] == pytest.approx({0: 0.0, 1: 2 / 3}.get(row["correct"], 1.0))
    assert summary["pass@2"] == pytest.approx(np.mean([row["pass@2"] for row in table]))
    assert summary["pass@1"] == pytest.approx(np.mean([row["greedy_reward"] for row in table]))
    max_tokens = run.cfg.rollout.max_tokens
    for row in table[:6]:  # the toy has no chat template: the prompt is the text itself
        ids = tok(row["prompt"], return_tensors="pt", add_special_tokens=False)["input_ids"]  # the prompt holds its <s>
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        assert tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == row["greedy_response"], row


def test_status_and_sql_commands(run_dir):
    status = gndpo("status", run_dir).stdout
    assert status.count("committed") == 8
    # stdout is the table alone (library warnings go to stderr): its frame, its header and 8 stage rows.
    assert len(status.splitlines()) == 12 and all(line[0] in "┌│╞└" for line in status.splitlines()), status
    # A rollout's rows are its responses (the held-out answers apart, shown as their accuracy), and its
    # seconds the stage's wall time, first claim to last commit, engine start-up included.
    from gndpo.pipeline.exec.status import stage_rows

    rec = open_run(str(run_dir)).records(0, "rollout")
    commits = [json.loads(p.read_text()) for p in (run_dir / "rounds" / "r0000" / "rollout" / "done").glob("*.json")]
    claims = [json.loads(p.read_text()) for p in (run_dir / "rounds" / "r0000" / "rollout" / "claims").glob("*/a001.json")]
    row = next(r for r in stage_rows(open_run(str(run_dir))) if (r["round"], r["stage"]) == (0, "rollout"))
    assert row["rows"] == PROMPTS * N and row["heldout"] == rec.manifest().metrics["heldout_accuracy"]
    wall = max(c["committed_at"] for c in commits) - min(c["claimed_at"] for c in claims)
    assert row["seconds"] == pytest.approx(wall, abs=0.051) and wall > sum(c["seconds"] for c in commits)
    out = invoke_ok("sql", run_dir, "SELECT round, count(*) AS n FROM rollouts GROUP BY round ORDER BY round", "--format", "csv").stdout
    assert out.strip().splitlines() == ["round,n", f"0,{PROMPTS * N}", f"1,{PROMPTS * N}"]
    out = invoke_ok("sql", run_dir, "SELECT value FROM stats WHERE name = 'token_count' AND round = 0", "--format", "csv").stdout
    assert float(out.splitlines()[1]) > 0


def test_gc_keep_rounds_frees_old_policies_and_keeps_what_readers_need(run_dir, tmp_path):
    """`gndpo gc --keep-rounds 1` on a two-round run removes round 0's exported student and optimizer
    state (and says how much: the bytes on disk), keeps round 1's and every rollout and score; a fork
    from round 1, whose rollouts round 0's export sampled, is refused in one line. (The commands run in
    this process: what they print is gndpo's own lines.)"""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    train0 = run / "rounds" / "r0000" / "train" / "data" / "update" / "a001"
    on_disk = sum(f.stat().st_size for d in ("model", "optimizer") for f in (train0 / d).rglob("*") if f.is_file())
    dry = invoke_ok("gc", run, "--keep-rounds", "1", "--dry-run").stdout
    assert f"would remove round 0: rounds/r0000/train/data/update/a001/model, rounds/r0000/train/data/update/a001/optimizer ({on_disk / 1e9:.2f} GB)" in dry
    assert (train0 / "model").is_dir()
    rows_before = invoke_ok("sql", run, "SELECT count(*) FROM rollouts", "--format", "csv").stdout
    out = invoke_ok("gc", run, "--keep-rounds", "1").stdout
    assert f"1 round(s) pruned, {on_disk / 1e9:.2f} GB freed" in out
    assert not (train0 / "model").exists() and not (train0 / "optimizer").exists()
    assert (run / "rounds" / "r0001" / "train" / "data" / "update" / "a001" / "model" / "model.safetensors").is_file()
    assert invoke_ok("sql", run, "SELECT count(*) FROM rollouts", "--format", "csv").stdout == rows_before
    assert invoke_ok("status", run).stdout.count("committed") == 8
    invoke_ok("report", run, "--out", tmp_path / "report")  # the report reads metrics and rollouts, not policies
    assert (tmp_path / "report" / "report.html").is_file()
    refused = invoke("fork", run, tmp_path / "fork", "--from-round", "1")
    assert refused.exit_code == 1 and "removed by `gndpo gc --keep-rounds`" in refused.stderr and not (tmp_path / "fork").exists()
    again = invoke_ok("gc", run, "--keep-rounds", "1").stdout  # nothing left to prune
    assert "0 round(s) pruned" in again
    # A prune stopped after marking the round (its folders partly there) is finished by the next one.
    train0.joinpath("optimizer").mkdir()
    train0.joinpath("optimizer", "left.pt").write_bytes(b"x")
    finished = invoke_ok("gc", run, "--keep-rounds", "1").stdout
    assert "removed round 0: rounds/r0000/train/data/update/a001/optimizer" in finished and not (train0 / "optimizer").exists()
    # A bad --keep-rounds is refused before anything is removed, garbage folders included.
    stray = run / "rounds" / "r0000" / "score" / "data" / "u00000" / "a009"
    stray.mkdir(parents=True)
    bad = invoke("gc", run, "--keep-rounds", "0")
    assert bad.exit_code == 1 and "--keep-rounds must be at least 1" in bad.stderr and stray.is_dir()


def test_docs_first_run_works_as_written(tmp_path, tiny_assets):
    """docs/getting-started/your-own-model.md's "first run of your own" block, run as written by bash in a
    fresh folder (its gndpo is the venv's; demo-run/config.yaml is the tiny toy's): a reward in the current
    folder imports, the run trains two rounds, status and sql answer."""
    import re
    import subprocess
    import sys

    page = (Path(__file__).resolve().parents[1] / "docs" / "getting-started" / "your-own-model.md").read_text()
    block = re.search(r"A first run of your own.*?```bash\n(.*?)```", page, re.S)[1]
    (tmp_path / "demo-run").mkdir()
    (tmp_path / "demo-run" / "config.yaml").write_text(yaml.safe_dump(tiny_config_dict(tiny_assets)))
    script = block.replace(".venv/bin/gndpo", str(Path(sys.executable).with_name("gndpo")))
    proc = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = open_run(str(tmp_path / "runs" / "mine"))
    assert run.cfg.reward == "my_rewards:ends_with_answer" and run.records(1, "train").manifest() is not None
    assert re.search(r"round\s.*reward", proc.stdout) and proc.stdout.count("committed") >= 8, proc.stdout


def test_rerun_is_a_no_op(run_dir):
    """Nothing is computed or written again (but the run's log file)."""
    def files():
        return sorted(p.relative_to(run_dir) for p in run_dir.rglob("*") if p.is_file() and p.relative_to(run_dir).parts[0] != "logs")

    before = files()
    invoke_ok("run", run_dir, "--rounds", 2)
    assert files() == before


def test_compare_with_seeds(tmp_path, tiny_assets):
    """`gndpo compare --seeds 2` runs each method for the same rounds and tabulates accuracy and
    stability: each method runs once per rollout seed (the second method forking the
    first one's run of the same seed), each cell is the mean over seeds with its sample standard
    deviation, and the report draws the mean with the seeds' band."""
    import json

    from gndpo.apps.report import find_runs
    from gndpo.storage.shards import read_shards

    small = ["--set", "rollout.prompts_per_round=8", "--set", "rollout.n=2", "--set", "train.micro_batch_size=8",
             "--set", "train.optimizer_steps=2", "--set", "engine.max_model_len=32", "--set", "engine.in_process=true"]
    cmp = tmp_path / "cmp"
    out = invoke_ok("compare", "opd", "forward_kl", "--seeds", "2", "--rounds", "1", "--out", cmp, "--assets", tiny_assets, *small).stdout
    assert "acc_r1_sd" in out
    summary = json.loads((cmp / "compare.json").read_text())
    runs, rows = summary["runs"], summary["rows"]
    assert summary["seeds"] == 2 and [(r["method"], r["seed"]) for r in runs] == [("opd", 0), ("opd", 1), ("forward_kl", 0), ("forward_kl", 1)]
    def responses(run_dir):
        run = open_run(str(run_dir))
        return sorted(tuple(r["response_token_ids"]) for r in read_shards(run.fs, run.records(0, "rollout").require_manifest().row_files()).to_pylist())

    for seed in (0, 1):
        run_dir = cmp / "00-opd" / f"seed-{seed}" / "run"
        assert open_run(str(run_dir)).cfg.rollout.seed == seed
        # forward_kl's round 0 is opd's of the same seed (a fork), and the two seeds sampled different responses
        assert responses(cmp / "01-forward_kl" / f"seed-{seed}" / "run") == responses(run_dir)
    assert responses(cmp / "00-opd" / "seed-0" / "run") != responses(cmp / "00-opd" / "seed-1" / "run")
    for row in rows:
        mine = [r for r in runs if r["method"] == row["method"]]
        for col in ("acc_r0", "acc_r1", "grad_norm_max"):
            a, b = mine[0][col], mine[1][col]
            assert row[col] == pytest.approx((a + b) / 2) and row[f"{col}_sd"] == pytest.approx(abs(a - b) / 2**0.5)
    for r in runs:  # the final column is each run's own evaluation of its final student
        method_dir = cmp / f"{['opd', 'forward_kl'].index(r['method']):02d}-{r['method']}"
        summary = json.loads((method_dir / f"seed-{r['seed']}" / "eval" / "summary.json").read_text())
        assert r["acc_r1"] == summary["pass@1"] and r["grad_norm_max"] > 0
        if r["method"] == "opd":
            assert r["adv_min"] >= -5.0 and r["adv_max"] <= 5.0  # OPD's clamp
        else:
            assert r["adv_min"] is None  # a pure divergence loss has no policy-gradient advantage
    # Per round of every run: the score it started from and its steps' figures, which the run's row sums up.
    for r in runs:
        mine = [p for p in json.loads((cmp / "compare.json").read_text())["per_round"] if (p["method"], p["seed"]) == (r["method"], r["seed"])]
        assert [p["round"] for p in mine] == [0] and mine[0]["heldout_start"] == r["acc_r0"]
        assert mine[0]["grad_norm_max"] == r["grad_norm_max"] and mine[0]["grad_norm_p99"] <= r["grad_norm_max"]
        assert mine[0]["clipped_steps"] in (0.0, 0.5, 1.0) and mine[0]["kl_estimate"] > 0  # 2 steps, clip 1.0
    assert (cmp / "compare.md").read_text().startswith("| method | seeds |") and " ± " in (cmp / "compare.md").read_text()
    assert_one_line_error(invoke("compare", "opd", "nope", "--out", tmp_path / "bad"), "unknown method 'nope'")
    assert not (tmp_path / "bad").exists()
    bad = invoke("compare", "opd", "--seeds", "2", "--set", "rollout.seed=3", "--out", tmp_path / "bad2")
    assert bad.exit_code == 1 and "rollout.seed" in bad.stderr and not (tmp_path / "bad2").exists()
    bad = invoke("compare", "opd", "--task", "nope", "--out", tmp_path / "bad3")
    assert bad.exit_code == 1 and "unknown demo task 'nope'" in bad.stderr and not (tmp_path / "bad3").exists()
    # The report: one series per method, the mean of its seeds with their band.
    series = find_runs(str(cmp))
    assert [s.label for s in series] == ["opd", "forward_kl"] and all(len(s.members) == 2 for s in series)
    for s in series:
        x, mean = s.values("train", "grad_norm_max")
        _, lo, hi = s.spread("train", "grad_norm_max")
        assert x == [0] and lo[0] <= mean[0] <= hi[0] and lo[0] < hi[0]
        assert s.values("rollout", "heldout_accuracy")[0] == [0, 1]  # start and the final evaluation
    invoke_ok("report", cmp)
    html = (cmp / "report" / "report.html").read_text()
    assert html.count("<h3>opd</h3>") == 1 and html.count("<h3>forward_kl</h3>") == 1
    assert "<td>opd</td>" in html and "<td>forward_kl</td>" in html and (cmp / "report" / "accuracy.png").exists()


# -- operability: metrics, TensorBoard, progress and logs, SQL formats, report ---------------------------


def round_frames(run_dir, r: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Round r's rollouts and scores, read straight from the committed shards."""
    run = open_run(str(run_dir))
    rollouts = pl.concat([pl.read_parquet(run_dir / f.path) for f in run.records(r, "rollout").manifest().row_files()])
    scores = pl.concat([pl.read_parquet(run_dir / f.path) for f in run.records(r, "score").manifest().files()])
    return rollouts, scores


def test_round_metrics_equal_recomputations_from_the_shards(run_dir):
    """Every metric of the operability set is in metrics.jsonl for every round, and those the shards
    determine equal a recomputation here: rewards, lengths, truncation, the teacher KL estimate, the
    rollout-vs-train log-prob gap, and GNDPO's advantages (c - mean) / (std + eps)."""
    rows = {(m["round"], m["stage"]): m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    expected = {
        "rollout": ["reward_mean", "heldout_accuracy", "tokens", "tokens_per_s"],
        "score": ["student_entropy_mean", "teacher_entropy_mean", "rollout_logprob_diff_max", "rollout_logprob_diff_mean", "tokens_per_s"],
        "normalize": ["reverse_kl_estimate", "reward_mean", "response_length_mean", "response_length_max", "truncated_fraction", "tokens_per_s"],
        "train": ["adv_mean", "adv_std", "adv_min", "adv_max", "grad_norm_mean", "grad_norm_max", "clip_fraction", "loss_mean", "tokens_per_s"],
    }
    for r in range(2):
        for stage, names in expected.items():
            for name in names:
                value = rows[(r, stage)].get(name)
                assert isinstance(value, (int, float)) and np.isfinite(value), (r, stage, name, value)
        rollouts, scores = round_frames(run_dir, r)
        joined = rollouts.join(scores, on="rollout_id")
        mask = np.concatenate([np.asarray(m, bool) for m in joined["loss_mask"]])
        lp_t = np.concatenate([np.asarray(x, np.float64) for x in joined["teacher_logprobs"]])[mask]
        lp_s = np.concatenate([np.asarray(x, np.float64) for x in joined["student_logprobs"]])[mask]
        sampler = np.concatenate([np.asarray(x, np.float64) for x in joined["sampler_logprobs"]])[mask]
        lengths = np.array([len(x) for x in rollouts["response_token_ids"]])
        norm, score, train = rows[(r, "normalize")], rows[(r, "score")], rows[(r, "train")]
        assert norm["reward_mean"] == pytest.approx(rollouts["reward"].mean(), abs=1e-12)
        assert rows[(r, "rollout")]["reward_mean"] == pytest.approx(rollouts["reward"].mean(), abs=1e-12)
        assert norm["response_length_mean"] == pytest.approx(lengths.mean()) and norm["response_length_max"] == lengths.max()
        assert norm["truncated_fraction"] == pytest.approx((rollouts["finish_reason"] == "length").mean())
        c = np.clip(lp_t - lp_s, -5, 5)
        assert norm["reverse_kl_estimate"] == pytest.approx(-c.mean(), rel=1e-6)
        gap = np.abs(lp_s - sampler)
        assert score["rollout_logprob_diff_max"] == pytest.approx(gap.max(), rel=1e-5, abs=1e-7)
        assert score["rollout_logprob_diff_mean"] == pytest.approx(gap.mean(), rel=1e-5, abs=1e-7)
        adv = (c - c.mean()) / (np.std(c, ddof=1) + 1e-8)
        for name, value in (("adv_mean", adv.mean()), ("adv_std", adv.std()), ("adv_min", adv.min()), ("adv_max", adv.max())):
            assert train[name] == pytest.approx(value, rel=1e-4, abs=1e-5), name
        # Entropies are over the vocabulary (not in the shards for GNDPO): in (0, log V].
        assert 0 < score["student_entropy_mean"] <= np.log(15) + 1e-6 and 0 < score["teacher_entropy_mean"] <= np.log(15) + 1e-6
        assert 0.0 <= train["clip_fraction"] <= 1.0 and train["grad_norm_max"] >= train["grad_norm_mean"] > 0


def test_tensorboard_event_files_hold_the_metrics(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((run_dir / "tensorboard").iterdir())
    assert len(events) == 1 and events[0].name.startswith("events.out.tfevents")  # rebuilt whole, never appended
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for stage, name in (("normalize", "reverse_kl_estimate"), ("train", "grad_norm_mean"), ("score", "student_entropy_mean")):
        points = [(e.step, e.value) for e in acc.Scalars(f"{stage}/{name}")]
        assert points == [(m["round"], pytest.approx(m[name], rel=1e-6)) for m in rows if m["stage"] == stage]


def test_progress_lines_and_worker_logs_without_a_terminal(run_dir):
    """Captured output is not a terminal: progress comes as plain lines (no escape codes), vLLM's own
    messages stay off the terminal but are in the worker's log file, whose lines name host, pid, unit."""
    import re

    folder = run_dir.parent
    rollout_err, run_err = (folder / "rollout.stderr").read_text(), (folder / "run.stderr").read_text()
    assert "\x1b[" not in rollout_err + run_err
    assert re.search(r"^\d\d:\d\d:\d\d INFO rollout r0: 3/3 units, prompts 16 \([\d.]+/s\), responses 32 \([\d.]+/s\), "
                     r"tokens \d+ \([\d.]+/s\)", rollout_err, re.M), rollout_err
    # Inside a unit, progress moves as its responses finish (a unit's own lines; its end is the stage's line).
    inside = [tuple(map(int, m)) for m in re.findall(r"INFO rollout r0 u0000\d: (\d+)/(\d+) responses", rollout_err)]
    assert any(0 < done < total for done, total in inside), rollout_err
    score_err = (folder / "score.stderr").read_text()
    inside = [tuple(map(int, m)) for m in re.findall(r"INFO score: forward passes: (\d+)/(\d+) responses", score_err)]
    assert any(0 < done < total for done, total in inside), score_err
    assert re.search(r"^\d\d:\d\d:\d\d INFO train r1: 2/2 steps, tokens \d+ \([\d,]+/s\), loss [-+.\de]+, grad_norm [.\d]+", run_err, re.M), run_err
    assert re.search(r"INFO rounds: 8/8 stages", run_err)
    assert "Resolved architecture" not in rollout_err  # a vLLM INFO line
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    rollout_log = next(text for name, text in logs.items() if name.endswith("-r0000-rollout.log"))
    assert "Resolved architecture" in rollout_log
    assert re.search(r"host=\S+ pid=\d+ unit=u0000[01] ", rollout_log), rollout_log[-2000:]
    assert any(name.endswith("-run.log") for name in logs)


def test_progress_draws_a_bar_on_a_terminal(tmp_path):
    """With stderr on a (pseudo) terminal, auto mode draws rich's bar rather than lines."""
    import os
    import pty
    import subprocess
    import sys

    script = ("from gndpo.pipeline.observe import progress; import sys; print(progress.resolve_mode('auto'), file=sys.stdout)\n"
              "with progress.task('demo', total=2, unit='steps') as t:\n    t.advance(1); t.advance(1, tokens=5)\n")
    leader, follower = pty.openpty()
    proc = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=follower, text=True, timeout=60)
    os.close(follower)
    drawn = os.read(leader, 65536).decode(errors="replace")
    os.close(leader)
    assert proc.stdout.strip() == "bar" and "demo" in drawn and "2/2" in drawn


def test_sql_formats_round_trip_and_every_view_has_round(run_dir, tmp_path):
    from typer.testing import CliRunner

    from gndpo.cli.app import app, register
    from gndpo.pipeline.observe.sql import query

    register()
    runner = CliRunner()

    def gndpo(*args, check=True):  # in this process: no interpreter start per statement
        result = runner.invoke(app, ["--progress", "none", *map(str, args)])
        assert not check or result.exit_code == 0, result.output
        result.returncode = result.exit_code
        return result

    for view in ("rollouts", "scores", "tokens", "stats", "metrics"):
        rounds = gndpo("sql", run_dir, f"SELECT DISTINCT round FROM {view} ORDER BY round", "--format", "csv").stdout
        assert rounds.split() == ["round", "0", "1"], view
    statement = "SELECT round, rollout_id, reward, finish_reason, response_token_ids FROM rollouts ORDER BY rollout_id"
    expected = query(open_run(str(run_dir)), statement)
    readers = {"json": pl.read_json, "parquet": pl.read_parquet}
    for fmt, reader in readers.items():
        out = tmp_path / f"result.{fmt}"
        gndpo("sql", run_dir, statement, "--format", fmt, "--out", out)
        back = reader(out)
        assert back.columns == expected.columns and back.height == PROMPTS * N * 2
        assert back.select(pl.col("response_token_ids").cast(pl.List(pl.Int64))).equals(
            expected.select(pl.col("response_token_ids").cast(pl.List(pl.Int64)))
        )
        assert back["rollout_id"].to_list() == expected["rollout_id"].to_list() and back["reward"].to_list() == expected["reward"].to_list()
    scalar = statement.replace(", response_token_ids", "")
    csv_text = gndpo("sql", run_dir, scalar, "--format", "csv").stdout
    back = pl.read_csv(csv_text.encode())
    assert back.equals(query(open_run(str(run_dir)), scalar).with_columns(pl.col("round").cast(pl.Int64)))
    table = gndpo("sql", run_dir, scalar, "--format", "table").stdout
    assert "rollout_id" in table and expected["rollout_id"][0] in table and len(table.splitlines()) > PROMPTS * N * 2
    bad = gndpo("sql", run_dir, "SELECT 1", "--format", "parquet", check=False)
    assert bad.returncode == 1 and bad.stderr.strip() == "error: --format parquet needs --out FILE"
    bad = gndpo("sql", run_dir, "SELECT 1", "--format", "xml", check=False)
    assert bad.returncode == 1 and "unknown --format 'xml'" in bad.stderr


def test_docs_sql_cookbook_runs(run_dir):
    """Every `gndpo sql RUN "..."` of docs/how-to/monitoring.md's cookbook runs on a real run and returns rows."""
    import re

    from gndpo.pipeline.observe.sql import query

    page = (Path(__file__).resolve().parent.parent / "docs" / "how-to" / "monitoring.md").read_text()
    cookbook = page[page.index("A cookbook:"):]
    statements = re.findall(r'gndpo sql RUN "(.*?)"', cookbook, re.S)
    assert len(statements) >= 5
    for statement in statements:
        assert query(open_run(str(run_dir)), " ".join(statement.split())).height > 0, statement
