"""Overlapped rounds: score streams behind rollout, and with run.max_staleness 1 rollout of round k+1
runs beside round k's train, sampling with policy k. Two runs of the same staleness-1 config share the
module: one sequential in one process on kept engines (the reference), one overlapped in stage
processes, SIGKILLed with two rounds in flight and rerun by the same command. Their rows and weights
must be the same bits; the overlapped run's commit times must show score committing while rollout
still computes; and train's importance ratio must divide by the sampling policy's log-probs,
recomputed here with transformers."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from gndpo.apps.report import find_runs, round_table, round_waits, timeline_figure
from gndpo.apps.round_model import measured_costs, paper_costs
from gndpo.apps.rounds import DeviceSets, stage_cpus, stage_processes
from gndpo.apps.schedule import RoundOrder, choose_order, may_start
from gndpo.errors import GndpoError
from gndpo.pipeline.config.checks import check_staleness
from gndpo.pipeline.config.load import config_from_dict, load_config
from gndpo.pipeline.exec.status import round_seconds, stage_rows, union_length
from gndpo.pipeline.run.run import open_run
from gndpo.stages.registry import STAGE_REGISTRY
from gndpo.stages.rollout import HELDOUT_UNIT
from gndpo.storage.records import StageRecords
from gndpo.storage.runfs import RunFS

from .conftest import assert_one_line_error, invoke, invoke_ok, model_logprob_tol, model_logprobs, tiny_config_dict, write_config

STAGES = tuple(STAGE_REGISTRY)
EVAL_UNIT = HELDOUT_UNIT.id

ROUNDS = 2


def stale_config(assets: Path, overlap: str, **sections) -> dict:
    # Four rollout units, so score has units to stream behind; one optimizer step, so the step's ratio
    # is the whole round's; the student's column recomputed, so it is the sampling policy's forward.
    return tiny_config_dict(
        assets, rollout={"prompts_per_unit": 4}, train={"optimizer_steps": 1}, score={"student_logprobs": "recompute"},
        method={"policy_loss": "ppo"}, run={"max_staleness": 1, "overlap": overlap}, **sections,
    )


def created(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True)
    run = folder / "run"
    invoke_ok("init", run, "--config", write_config(folder, cfg))
    return run


def stage_in_flight(fs: RunFS, round_idx: int, stage: str) -> bool:
    """Claimed by a worker, not committed (no manifest, as the stage's records read it): the stage
    runs now, or ran when its worker was killed."""
    records = StageRecords(fs, round_idx, stage)
    return bool(fs.listdir(f"{records.prefix}/claims")) and records.manifest() is None


def stages_in_flight(fs: RunFS) -> list[tuple[int, str]]:
    return [(r, s) for r in range(ROUNDS) for s in STAGES if stage_in_flight(fs, r, s)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_assets) -> dict:
    """{"sequential": run, "overlapped": run, "killed_in_flight": the stages running when it was killed}."""
    folder = tmp_path_factory.mktemp("overlap")
    sequential = created(folder / "sequential", stale_config(tiny_assets, "off"))
    invoke_ok("run", sequential, "--rounds", ROUNDS)  # in this process, on kept engines
    overlapped = created(folder / "overlapped", stale_config(tiny_assets, "on"))
    # Each rollout unit lingers 1 s after sampling, so score (started with rollout, streaming behind it)
    # has rollout units to wait for, and round 1's rollout (started once round 0's commits) runs long
    # enough to be caught beside round 0's train.
    env = {**os.environ, "GNDPO_DELAY_AT": "rollout.generate", "GNDPO_DELAY_S": "1"}
    fs = RunFS(str(overlapped))
    with open(folder / "killed.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gndpo.cli", "run", str(overlapped), "--rounds", str(ROUNDS)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline and {r for r, _ in stages_in_flight(fs)} != {0, 1}:
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)  # the loop and every stage process it started
        proc.wait()
    killed_at = time.time()
    in_flight = stages_in_flight(fs)  # read once every process is dead: what the kill left
    # The same command again, in this process, its stage processes started as the killed ones were: the
    # overlapped scheduler's own restart (round 1's rollout again beside round 0's train, dead workers'
    # leases taken over) is what is tested. About 20 s more than `--overlap off` on kept engines, which
    # would only show that the records a kill leaves resume in some order.
    invoke_ok("run", overlapped, "--rounds", ROUNDS)
    return {"sequential": sequential, "overlapped": overlapped, "killed_in_flight": in_flight, "killed_at": killed_at}


def shards(run: Path, round_idx: int, stage: str) -> dict[str, list]:
    """{unit: its committed tables} of a stage, read with pyarrow."""
    manifest = open_run(str(run)).records(round_idx, stage).require_manifest()
    return {u.unit: [pq.read_table(run / f.path) for f in u.files if f.path.endswith(".parquet")] for u in manifest.units}


def commit_times(run: Path, round_idx: int, stage: str) -> dict[str, float]:
    manifest = open_run(str(run)).records(round_idx, stage).require_manifest()
    return {u.unit: u.committed_at for u in manifest.units if u.unit != EVAL_UNIT}


@pytest.mark.slow
def test_killed_with_two_rounds_in_flight_the_rerun_has_the_unkilled_rows_and_weights(runs):
    in_flight = runs["killed_in_flight"]
    assert {r for r, _ in in_flight} == {0, 1}, f"the kill did not catch two rounds in flight: {in_flight}"
    assert (1, "rollout") in in_flight
    for r in range(ROUNDS):
        for stage in ("rollout", "score", "normalize"):
            got, want = shards(runs["overlapped"], r, stage), shards(runs["sequential"], r, stage)
            assert got.keys() == want.keys(), (r, stage)
            for unit in want:
                assert all(a.equals(b) for a, b in zip(got[unit], want[unit], strict=True)), (r, stage, unit)
    for r in range(ROUNDS):  # the exported weights, byte for byte
        exports = [open_run(str(runs[k])).policy_path(r + 1) for k in ("overlapped", "sequential")]
        digests = [{p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in Path(e).glob("*.safetensors")} for e in exports]
        assert digests[0] and digests[0] == digests[1], r


@pytest.mark.slow
def test_the_rerun_works_each_stage_in_one_process_for_every_round(runs):
    """Overlapped, `gndpo run` starts each stage's worker once for the whole run: every unit the rerun
    committed, of whichever round, was committed by its stage's one process (the pid in its worker id)."""
    run = open_run(str(runs["overlapped"]))
    for stage in STAGES:
        pids = {c.numbers.worker.split(":")[1] for r in range(ROUNDS) for c in run.records(r, stage).require_manifest().units
                if c.committed_at > runs["killed_at"]}
        assert len(pids) == 1, (stage, pids)


@pytest.mark.slow
def test_score_commits_units_while_rollout_still_computes(runs):
    # Round 0 ran with its rollout units slowed (round 1's, rerun after the kill, sampled at full speed).
    rollout, score = commit_times(runs["overlapped"], 0, "rollout"), commit_times(runs["overlapped"], 0, "score")
    assert min(score.values()) < max(rollout.values()), (rollout, score)
    # One stage at a time: each score unit after rollout's last.
    rollout, score = commit_times(runs["sequential"], 0, "rollout"), commit_times(runs["sequential"], 0, "score")
    assert min(score.values()) > max(rollout.values())


@pytest.mark.slow
def test_round_1_samples_with_policy_0_and_says_so(runs):
    run = open_run(str(runs["overlapped"]))
    (rollout,) = shards(runs["overlapped"], 1, "rollout")["u00000"]
    assert set(rollout.column("policy_version").to_pylist()) == {0}
    assert run.records(1, "rollout").require_manifest().metrics["staleness"] == 1
    for name in ("overlapped", "sequential"):  # rollout's policy_version figure is the sampling policy's
        opened = open_run(str(runs[name]))
        jsonl = [json.loads(line) for line in (runs[name] / "metrics.jsonl").read_text().splitlines()]
        figures = {m["round"]: m["policy_version"] for m in jsonl if m["stage"] == "rollout"}
        assert figures == {r: opened.records(r, "rollout").require_manifest().metrics["policy_version"] for r in range(ROUNDS)}
        assert figures == {r: opened.sampling_version(r) for r in range(ROUNDS)} == {0: 0, 1: 0}, name
    assert run.records(1, "train").require_manifest().metrics["staleness"] == 1
    assert run.records(0, "train").require_manifest().metrics["staleness"] == 0
    rows = {(row["round"], row["stage"]): row for row in stage_rows(run)}
    assert rows[(1, "rollout")]["staleness"] == 1 and rows[(0, "rollout")]["staleness"] == 0
    assert "r0 train" in (rows[(1, "rollout")]["beside"] or "")
    assert "r0 rollout" in (rows[(0, "score")]["beside"] or "")
    sequential = {(row["round"], row["stage"]): row for row in stage_rows(open_run(str(runs["sequential"])))}
    assert all(row["beside"] is None for row in sequential.values())
    status = invoke_ok("status", str(runs["overlapped"])).output
    assert "beside" in status and "staleness" in status
    assert "<th>staleness</th>" in round_table(find_runs(str(runs["overlapped"])))  # the report's round table
    # Where the workers that stay waited: for their input (normalize for score, ...), in status --phases
    # and the metrics; a sequential run in one process waits for nothing.
    phases = invoke_ok("status", str(runs["overlapped"]), "--phases").output
    assert "waiting s" in phases, phases
    assert sum(run.records(r, "normalize").require_manifest().metrics.get("wait_input_seconds", 0.0) for r in range(ROUNDS)) > 0
    assert "waiting s" not in invoke_ok("status", str(runs["sequential"]), "--phases").output
    # ... and in the report: each round's waits in the round table (the stages' metrics summed), and the timeline drawn.
    waits = round_waits(run)
    assert waits[0]["input"] == pytest.approx(sum(run.records(0, s).require_manifest().metrics.get("wait_input_seconds", 0.0) for s in STAGES))
    assert "<th>waited_input_s</th>" in round_table(find_runs(str(runs["overlapped"])))
    assert timeline_figure(str(runs["overlapped"])).startswith(b"\x89PNG")
    # A round's wall time counts the time its stages ran side by side once: less than their sum here.
    walls = round_seconds(run)
    assert walls[0] < sum(row["seconds"] for (r, _), row in rows.items() if r == 0)


@pytest.mark.slow
def test_a_rerun_predicts_from_the_seconds_its_rounds_took(runs):
    """Once a run's rounds ran one stage at a time, `gndpo run`'s model takes their seconds (round 0,
    which starts the engines, left out), and its line gives each order's round time in seconds; rounds
    whose stages ran side by side measure no stage alone."""
    run = open_run(str(runs["sequential"]))
    costs = measured_costs(run, paper_costs(run.cfg))
    assert costs.measured and costs.source == "measured over round 1 of this run"
    seconds = {row["stage"]: row["seconds"] for row in stage_rows(run) if row["round"] == 1}
    assert {stage: cost.seconds for stage, cost in costs.stages.items()} == seconds
    line = choose_order(run.cfg, 0, overlap="auto", costs=costs).line()  # the run itself was made with run.overlap off
    assert f"sequential {sum(seconds.values()):.1f} s" in line and "measured over round 1" in line, line
    assert choose_order(run.cfg, 0, overlap="auto", run=run).line() == line  # what `gndpo run` asks: the run measures its own costs
    overlapped = open_run(str(runs["overlapped"]))
    assert measured_costs(overlapped, paper_costs(overlapped.cfg)) is None


def test_overlapping_spans_count_once_in_a_rounds_seconds():
    assert union_length([(0.0, 10.0), (5.0, 12.0), (20.0, 21.0)]) == 13.0
    assert union_length([(0.0, 10.0), (2.0, 3.0)]) == 10.0 and union_length([]) == 0.0


@pytest.mark.slow
def test_train_ratio_divides_by_the_sampling_policy_log_probs(runs):
    """Round 1's rows were sampled by policy 0 and train starts from policy 1, so the first step's mean
    ratio is mean exp(lp_1 - lp_0) over the loss tokens, recomputed here, not 1 (what a train would show
    that took the current policy's log-probs for the behaviour's)."""
    run = open_run(str(runs["overlapped"]))
    models = [AutoModelForCausalLM.from_pretrained(run.policy_path(v), dtype=torch.float32).eval() for v in (0, 1)]
    ratios, student = [], []
    for unit, (rollout,) in shards(runs["overlapped"], 1, "rollout").items():
        if unit == EVAL_UNIT:  # the held-out accuracy's greedy table
            continue
        for row in rollout.to_pylist():
            lp0, lp1 = (np.array(model_logprobs(m, row["prompt_token_ids"], row["response_token_ids"])) for m in models)
            mask = np.array(row["loss_mask"], dtype=bool)
            ratios += list(np.exp(lp1 - lp0)[mask])
            student.append((row["rollout_id"], lp0))
    steps = run.records(1, "train").done("update").numbers.steps
    expected = float(np.mean(ratios))
    assert abs(expected - 1) > 1e-3  # training moved the policy: a ratio of 1 would be wrong
    # Train's log-probs and score's against these forwards: each within two float32 forwards' rounding,
    # atol + rtol * |lp| <= 2 * atol (tests/conftest.py); a ratio of two moves by twice that, relatively.
    tol = model_logprob_tol(*models)
    assert steps[0]["ratio_mean"] == pytest.approx(expected, rel=4 * tol["atol"])
    # The student column score stored is the sampling policy's forward.
    scores = {r["rollout_id"]: r["student_logprobs"] for (t,) in shards(runs["overlapped"], 1, "score").values() for r in t.to_pylist()}
    for rid, lp0 in student:
        np.testing.assert_allclose(scores[rid], lp0, err_msg=rid, **tol)


# -- choosing the order, without running ------------------------------------------------------------------


def order_of(tiny_assets, gpus=0, learner_gpus=0, **sections) -> RoundOrder:
    return choose_order(config_from_dict(tiny_config_dict(tiny_assets, **sections)), gpus, learner_gpus)


def test_auto_takes_the_order_the_round_model_predicts_fastest(tiny_assets, monkeypatch):
    monkeypatch.delenv("GNDPO_STAGE_CPUS", raising=False)
    cpu = order_of(tiny_assets)  # stages that scale over the same devices: nothing gained by overlapping
    assert cpu.sequential and "the CPU" in cpu.line() and "run.overlap on" in cpu.line() and "score streamed 1.00" in cpu.line()
    assert order_of(tiny_assets, gpus=1).sequential
    served = {"backend": "server", "student_logprobs": "engine", "servers": ["http://127.0.0.1:1"]}
    # A served teacher computes on devices of its own, beside rollout; rollout ahead would share the GPU's memory with train.
    on_gpu = order_of(tiny_assets, gpus=1, score=served, run={"max_staleness": 1})
    assert on_gpu.stream_score and on_gpu.rollout_ahead == 0 and "one GPU" in on_gpu.line()
    assert order_of(tiny_assets, score={**served, "student_logprobs": "recompute"}).sequential  # score computes the student's forward here
    # The toy's costs on paper: rollout on 6 of 8 GPUs and the learner's stages on 2 take longer than all 8 in turn.
    split = order_of(tiny_assets, gpus=8, learner_gpus=2, run={"max_staleness": 1})
    assert split.sequential and "--learner-gpus 2 left unused" in split.line()
    forced = order_of(tiny_assets, run={"max_staleness": 1, "overlap": "on"})
    assert forced.stream_score and forced.rollout_ahead == 1
    assert order_of(tiny_assets, gpus=8, learner_gpus=2, run={"overlap": "off"}).sequential
    command = choose_order(config_from_dict(tiny_config_dict(tiny_assets)), 0, overlap="on")
    assert command.stream_score and "--overlap on" in command.line()


def test_learner_gpus_split_the_node(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices = DeviceSets.of(8, 2)
    assert devices.rollout == [str(i) for i in range(6)] and devices.learner == ["6", "7"]
    url = str(tmp_path / "run")
    rollout = stage_processes(url, "rollout", 0, 8, devices=devices.rollout)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in rollout] == [str(i) for i in range(6)]
    score = stage_processes(url, "score", 0, 8, devices=devices.learner, follow=True)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in score] == ["6", "7"] and all("--follow" in p.argv for p in score)
    (train,) = stage_processes(url, "train", 0, 8, devices=devices.learner)
    assert train.env["CUDA_VISIBLE_DEVICES"] == "6,7" and "--nproc_per_node=2" in train.argv
    for bad, fragment in (((8, 8), "leaves rollout no GPU"), ((4, -1), "must be >= 0")):
        with pytest.raises(GndpoError, match=fragment):
            DeviceSets.of(*bad)


def test_stage_cpus_pin_each_stage(monkeypatch):
    monkeypatch.setenv("GNDPO_STAGE_CPUS", "rollout=0 score=1 train=1,2")
    assert stage_cpus() == {"rollout": (0,), "score": (1,), "train": (1, 2)}
    with pytest.raises(GndpoError, match="GNDPO_STAGE_CPUS entry 'evaluate=1'"):
        stage_cpus("evaluate=1")


class Records:
    def __init__(self, done: bool):
        self.done = done

    def manifest(self):
        return {} if self.done else None


@dataclasses.dataclass
class PlannedRun:
    committed: set
    staleness: int

    def records(self, r, stage):
        return Records((r, stage) in self.committed)

    def sampling_version(self, r):
        return max(r - self.staleness, 0)


def test_each_order_starts_a_stage_once_what_it_reads_is_there():
    round0 = {(0, s) for s in ("rollout",)}
    sequential, streamed, ahead = RoundOrder(False, 0, ""), RoundOrder(True, 0, ""), RoundOrder(True, 1, "")
    assert not may_start(PlannedRun(set(), 0), sequential, 0, "score", {(0, "rollout")})
    assert may_start(PlannedRun(set(), 0), streamed, 0, "score", {(0, "rollout")})
    # Resumed after rollout committed: score starts though no rollout started in this scheduler.
    assert may_start(PlannedRun({(0, "rollout")}, 0), streamed, 0, "score", set())
    assert not may_start(PlannedRun(round0, 1), sequential, 1, "rollout", set())  # waits for train of round 0
    assert may_start(PlannedRun(round0, 1), ahead, 1, "rollout", set())  # policy 0 is all it needs
    assert not may_start(PlannedRun(round0 | {(1, "rollout")}, 1), ahead, 2, "rollout", set())  # needs train of round 0
    # train of round 1 waits for train of round 0 even when its own data is there
    data1 = {(1, s) for s in ("rollout", "score", "normalize")} | {(0, s) for s in ("rollout", "score", "normalize")}
    assert not may_start(PlannedRun(data1, 1), ahead, 1, "train", set())


def test_init_refuses_staleness_only_for_a_policy_gradient_without_the_ratio(tmp_path, tiny_assets):
    """Stale rollouts: a policy gradient without an importance ratio is refused (reopold's reinforce); a
    top-k divergence alone, computed in train under the current student, and a ratio-corrected policy
    gradient, with or without a divergence term, are accepted (docs/concepts/methods.md)."""
    cfg = write_config(tmp_path, tiny_config_dict(tiny_assets, method={"name": "reopold"}, run={"max_staleness": 1}))
    assert_one_line_error(invoke("init", tmp_path / "run-reopold", "--config", cfg), "run.max_staleness 1", "policy loss reinforce",
                          "method.policy_loss", "gspo, ppo, is")
    assert not (tmp_path / "run-reopold").exists()
    for method in ({"name": "forward_kl"}, {"name": "reverse_kl"}, {"name": "eopd"}, {"name": "reverse_kl", "policy_loss": "gspo"}):
        check_staleness(config_from_dict(tiny_config_dict(tiny_assets, method=method, run={"max_staleness": 1})))
    cfg = write_config(tmp_path, tiny_config_dict(tiny_assets, method={"name": "forward_kl"}, run={"max_staleness": 1}))
    invoke_ok("init", tmp_path / "run-forward-kl", "--config", cfg)


def test_staleness_is_part_of_the_identity_and_the_order_is_not(tiny_assets):
    base = config_from_dict(tiny_config_dict(tiny_assets))
    assert config_from_dict(tiny_config_dict(tiny_assets, run={"overlap": "on"})).fingerprint() == base.fingerprint()
    assert config_from_dict(tiny_config_dict(tiny_assets, run={"max_staleness": 1})).fingerprint() != base.fingerprint()


def test_a_bare_on_or_off_in_yaml_is_the_overlap_it_says(tmp_path, tiny_assets):
    """YAML 1.1 reads unquoted on and off as booleans: written plainly in a config or as an override,
    run.overlap is still the choice it names (it was refused as "got True")."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config_dict(tiny_assets)) + "run:\n  overlap: on\n")
    assert load_config(str(config)).run.overlap == "on"
    assert load_config(str(config), ["run.overlap=off"]).run.overlap == "off"
    assert config_from_dict({"run": {"overlap": False}}).run.overlap == "off"
    with pytest.raises(GndpoError, match="must be one of auto, on, off, got 3"):
        config_from_dict({"run": {"overlap": 3}})


@pytest.mark.parametrize("overlap", ["off", "auto"])
def test_devices_and_pinning_are_refused_before_the_order_line_whatever_the_order(tmp_path, tiny_assets, monkeypatch, overlap):
    """`gndpo run --learner-gpus 2` without GPUs, and a malformed GNDPO_STAGE_CPUS, are one error line
    before anything is said or run, in the sequential order too (it once ran a whole round)."""
    run = created(tmp_path / "run", tiny_config_dict(tiny_assets))
    refused = invoke("run", run, "--rounds", 1, "--gpus", 0, "--learner-gpus", 2, "--overlap", overlap)
    assert_one_line_error(refused, "--learner-gpus 2", "uses none")
    monkeypatch.setenv("GNDPO_STAGE_CPUS", "rollout=x")
    assert_one_line_error(invoke("run", run, "--rounds", 1, "--gpus", 0, "--overlap", overlap), "GNDPO_STAGE_CPUS entry 'rollout=x'")
    assert open_run(str(run)).records(0, "rollout").plan() is None


@pytest.mark.slow
def test_a_killed_worker_is_started_again_and_the_run_finishes(tmp_path, tiny_assets):
    """Overlapped with workers that stay, the score worker is SIGKILLed mid-round (a score unit of round
    0 committed, the stage not): `gndpo run` starts it again, and the run's rows and weights are those
    of the same config run one stage at a time."""
    import psutil

    cfg = stale_config(tiny_assets, "on")
    cfg["rollout"]["backend"] = "hf"  # the claim is the scheduler's: no engine start needed
    reference = created(tmp_path / "reference", cfg)
    run = created(tmp_path / "killed-worker", cfg)
    env = {**os.environ, "GNDPO_DELAY_AT": "rollout.generate", "GNDPO_DELAY_S": "2"}  # rollout slow: score waits between units
    subprocess.run([sys.executable, "-m", "gndpo.cli", "run", str(reference), "--rounds", str(ROUNDS), "--overlap", "off"],
                   check=True, capture_output=True)  # one process, kept engines; the delay changes no row
    fs = RunFS(str(run))
    score = StageRecords(fs, 0, "score")
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gndpo.cli", "run", str(run), "--rounds", str(ROUNDS)], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            deadline, victim = time.time() + 180, None
            while victim is None and time.time() < deadline and proc.poll() is None:
                if fs.listdir(f"{score.prefix}/done"):  # a unit committed; the worker waits for the next rollout unit
                    victim = next((p for p in psutil.Process(proc.pid).children(recursive=True)
                                   if "score" in p.cmdline() and "--rounds" in p.cmdline()), None)
                time.sleep(0.05)
            assert victim is not None, (tmp_path / "run.log").read_text()[-3000:]
            victim.kill()
            assert score.manifest() is None, "score of round 0 was committed before the kill"
            assert proc.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert "the score worker was killed; starting it again (1 of 2)" in (tmp_path / "run.log").read_text()
    for r in range(ROUNDS):
        for stage in ("rollout", "score", "normalize"):
            got, want = shards(run, r, stage), shards(reference, r, stage)
            assert got.keys() == want.keys(), (r, stage)
            for unit in want:
                assert all(a.equals(b) for a, b in zip(got[unit], want[unit], strict=True)), (r, stage, unit)
        exports = [open_run(str(folder)).policy_path(r + 1) for folder in (run, reference)]
        digests = [{p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in Path(e).glob("*.safetensors")} for e in exports]
        assert digests[0] and digests[0] == digests[1], r
