"""`gndpo run` on a node with G GPUs: which processes each stage starts, and how the loop waits for them.

The plan (:func:`stage_processes`) is pure and tested for G = 0, 1 and 8. The loop is tested with stand-in
stage commands (short Python one-liners), so no model runs: a failing worker's error names its log, and
a stage no worker committed is finished by one more process.
"""

import dataclasses
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gndpo.apps import round_model, rounds, schedule
from gndpo.apps.rounds import StageProcess, run_stage_processes, stage_processes, worker_log_dir
from gndpo.errors import GndpoError
from gndpo.stages.registry import STAGE_REGISTRY
from tests.conftest import invoke

STAGES = tuple(STAGE_REGISTRY)


PY = sys.executable


@pytest.fixture(autouse=True)
def no_inherited_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def cli(stage, url, r=0):
    return [PY, "-m", "gndpo", stage, url, "--round", str(r)]


def test_no_gpu_is_one_plain_process_per_stage(tmp_path):
    url = str(tmp_path / "run")
    for stage in STAGES:
        (p,) = stage_processes(url, stage, 2, gpus=0, num_processes=0)
        assert p.argv == cli(stage, url, 2) and p.env == {} and p.log_path is None
        assert p.argv == rounds.stage_command(url, stage, 2)  # what `gndpo run` always ran on CPU


def test_one_gpu(tmp_path):
    url = str(tmp_path / "run")
    for stage in ("rollout", "score"):
        (p,) = stage_processes(url, stage, 0, gpus=1)
        assert p.argv == [*cli(stage, url), "--worker"]
        assert p.env["CUDA_VISIBLE_DEVICES"] == "0"
        assert p.log_path == f"{tmp_path}/run/logs/r0000-{stage}-gpu0.log"
    (p,) = stage_processes(url, "normalize", 0, gpus=1)
    assert p.argv == cli("normalize", url) and p.log_path is None
    (p,) = stage_processes(url, "train", 0, gpus=1, num_processes=0)
    assert p.argv == cli("train", url) and p.env == {} and p.log_path is None  # one rank: no torchrun


def test_eight_gpus(tmp_path):
    url = str(tmp_path / "run")
    procs = stage_processes(url, "score", 3, gpus=8)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in procs] == [str(i) for i in range(8)]
    assert all(p.argv == [*cli("score", url, 3), "--worker"] for p in procs)
    assert [Path(p.log_path).name for p in procs] == [f"r0003-score-gpu{i}.log" for i in range(8)]
    assert len(stage_processes(url, "rollout", 3, gpus=8)) == 8
    assert len(stage_processes(url, "normalize", 3, gpus=8)) == 1
    (train,) = stage_processes(url, "train", 3, gpus=8, num_processes=0)
    assert train.argv == [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8", *cli("train", url, 3)[1:]]
    assert train.log_path is None


def test_processes_sharing_a_node_share_its_cpus(tmp_path, monkeypatch):
    """8 workers (or ranks) on a 64-CPU node: 8 torch threads each, not 64 (set_cpu_threads reads
    GNDPO_THREADS); one process alone keeps them all."""
    url = str(tmp_path / "run")
    monkeypatch.setattr(rounds, "usable_cpus", lambda: 64)
    assert [p.env["GNDPO_THREADS"] for p in stage_processes(url, "score", 3, gpus=8)] == ["8"] * 8
    assert [p.env["GNDPO_THREADS"] for p in stage_processes(url, "rollout", 3, gpus=8, gpus_per_worker=2)] == ["16"] * 4
    (train,) = stage_processes(url, "train", 3, gpus=8, num_processes=0)
    assert train.env == {"GNDPO_THREADS": "8"}
    (train,) = stage_processes(url, "train", 3, gpus=1, num_processes=0)
    assert train.env == {}
    monkeypatch.setattr(rounds, "usable_cpus", lambda: 4)
    assert {p.env["GNDPO_THREADS"] for p in stage_processes(url, "score", 3, gpus=8)} == {"1"}


def test_num_processes_overrides_the_gpu_count(tmp_path):
    url = str(tmp_path / "run")
    (train,) = stage_processes(url, "train", 0, gpus=8, num_processes=2)
    assert "--nproc_per_node=2" in train.argv
    (train,) = stage_processes(url, "train", 0, gpus=0, num_processes=4)  # CPU, as before: train.num_processes
    assert "--nproc_per_node=4" in train.argv
    (train,) = stage_processes(url, "train", 0, gpus=8, num_processes=1)
    assert train.argv == cli("train", url)


def test_inherited_visible_devices_and_tensor_parallel_groups(tmp_path, monkeypatch):
    url = str(tmp_path / "run")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in stage_processes(url, "score", 0, gpus=4)] == ["4", "5", "6", "7"]
    procs = stage_processes(url, "rollout", 0, gpus=4, gpus_per_worker=2)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in procs] == ["4,5", "6,7"]
    assert [Path(p.log_path).name for p in procs] == ["r0000-rollout-gpu0-1.log", "r0000-rollout-gpu2-3.log"]
    with pytest.raises(GndpoError, match="CUDA_VISIBLE_DEVICES names only 4"):
        stage_processes(url, "score", 0, gpus=8)
    with pytest.raises(GndpoError, match="tensor_parallel_size"):
        stage_processes(url, "rollout", 0, gpus=1, gpus_per_worker=2)


def test_logs_of_a_remote_run_go_to_the_local_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("GNDPO_CACHE", str(tmp_path / "cache"))
    a = worker_log_dir("s3://bucket/exp/run")
    assert a.startswith(str(tmp_path / "cache" / "logs" / "bucket_exp_run-"))
    assert a != worker_log_dir("s3://other/exp/run")
    assert worker_log_dir(str(tmp_path / "run")) == f"{tmp_path}/run/logs"
    (p,) = stage_processes("s3://bucket/exp/run", "score", 1, gpus=1)
    assert p.log_path == f"{a}/r0001-score-gpu0.log"


def test_a_failing_worker_is_named_with_its_log(tmp_path):
    ok = StageProcess([PY, "-c", "print('fine')"], {"CUDA_VISIBLE_DEVICES": "0"}, str(tmp_path / "logs/r0000-score-gpu0.log"), "gpu0")
    bad = StageProcess(
        [PY, "-c", "import os, sys; print('boom on', os.environ['CUDA_VISIBLE_DEVICES']); sys.exit(3)"],
        {"CUDA_VISIBLE_DEVICES": "1"},
        str(tmp_path / "logs/r0000-score-gpu1.log"),
        "gpu1",
    )
    with pytest.raises(GndpoError) as err:
        run_stage_processes([ok, bad], "score", 0)
    message = str(err.value)
    assert "score of round 0" in message and "worker gpu1" in message and "code 3" in message
    assert bad.log_path in message and "\n" not in message
    assert "boom on 1" in Path(bad.log_path).read_text()
    assert "fine" in Path(ok.log_path).read_text()
    run_stage_processes([ok], "score", 0)  # a rerun appends to the same log
    assert Path(ok.log_path).read_text().splitlines().count("fine") == 2


class FakeRecords:
    def __init__(self, marker: Path):
        self.marker = marker

    def manifest(self):
        return {"rows": 1} if self.marker.exists() else None


class FakeRun:
    """A run whose stage r/stage is committed when the file ``<dir>/r-stage`` exists."""

    def __init__(self, folder: Path, num_processes=0, tp=1):
        from gndpo.pipeline.settings.schema import Config, EngineConfig, TrainConfig

        self.folder = folder
        self.cfg = Config(train=TrainConfig(num_processes=num_processes), engine=EngineConfig(tensor_parallel_size=tp))

    def records(self, r, stage):
        return FakeRecords(self.folder / f"{r}-{stage}")

    def sampling_version(self, r):
        return r


SEQUENTIAL = schedule.RoundOrder(False, 0, "one stage at a time")


def run_processes(tmp_path, monkeypatch, command, gpus, log=lambda *_: None):
    """The scheduler's sequential order over ``FakeRun`` with ``command`` standing in for each stage's."""
    monkeypatch.setattr(schedule, "open_run", lambda url: FakeRun(tmp_path))
    monkeypatch.setattr(rounds, "stage_command", command)
    monkeypatch.setattr(schedule, "stage_command", command)
    schedule.run_scheduled(str(tmp_path / "run"), 1, gpus, SEQUENTIAL, log=log)


def fake_stage_command(folder: Path, commit_in_workers: bool):
    """Stand-in for `python -m gndpo.cli STAGE RUN --round R [--worker]`: records how it was started; a
    non-worker process commits, a worker commits only when ``commit_in_workers``."""

    def command(url, stage, r, num_processes=1, follow=False, final=False):
        script = (
            "import os, sys; from pathlib import Path; f = Path(sys.argv[1]); worker = '--worker' in sys.argv; "
            "log = Path(sys.argv[2]); log.open('a').write(f\"{sys.argv[3]} {'worker' if worker else 'main'} "
            "{os.environ.get('CUDA_VISIBLE_DEVICES', '-')} {sys.argv[4]}\\n\"); "
            f"(not worker or {commit_in_workers}) and f.write_text('x')"
        )
        return [PY, "-c", script, str(folder / f"{r}-{stage}"), str(folder / "calls.txt"), stage, str(num_processes)]

    return command


@pytest.mark.parametrize("commit_in_workers", [True, False])
def test_run_rounds_with_gpus_starts_workers_and_commits(tmp_path, monkeypatch, commit_in_workers):
    lines = []
    run_processes(tmp_path, monkeypatch, fake_stage_command(tmp_path, commit_in_workers), 2, log=lines.append)
    calls = sorted((tmp_path / "calls.txt").read_text().splitlines())
    expected = ["normalize main - 1", "rollout worker 0 1", "rollout worker 1 1", "score worker 0 1", "score worker 1 1", "train main - 2"]
    if not commit_in_workers:  # every worker exited without committing: one more process finishes the stage
        expected += ["rollout main 0 1", "score main 0 1"]
    assert calls == sorted(expected)
    assert any("rollout on 2 workers" in line and "logs" in line for line in lines)
    assert (tmp_path / "run/logs/r0000-score-gpu1.log").exists()
    assert all((tmp_path / f"0-{s}").exists() for s in STAGES)


def test_run_loop_keeps_models_in_process_on_one_machine(tmp_path, monkeypatch):
    """Without GPUs (or with one) and one train rank, every stage runs in this process on one kept set
    of engines; with tensor parallelism or several train ranks, processes are started as before."""
    from gndpo.apps import loop

    monkeypatch.setattr(rounds, "open_run", lambda url: FakeRun(tmp_path))
    monkeypatch.setattr(loop, "open_run", lambda url: FakeRun(tmp_path))
    monkeypatch.setattr(loop, "run_scheduled", lambda *a, **k: pytest.fail("no process expected"))
    monkeypatch.setattr(loop, "visible_gpus", lambda: 0)
    monkeypatch.setattr(round_model, "measured_costs", lambda run, paper: None)  # a new run: no round measured yet
    seen = []

    def run_stage(url, stage, r, log=print, live=None, run=None, final=False):
        assert final  # round 0 is the last of a 1-round run
        seen.append((stage, live))
        (tmp_path / f"{r}-{stage}").touch()
        return {"rows": 1}

    monkeypatch.setattr(rounds, "run_stage", run_stage)
    loop.run_loop(str(tmp_path / "run"), 1, log=lambda *_: None)
    assert [stage for stage, _ in seen] == list(STAGES)
    assert len({id(live) for _, live in seen}) == 1 and seen[0][1].keep
    from gndpo.pipeline.settings.schema import Config

    cfg = Config(student="s", teacher="t")
    assert rounds.keeps_models(cfg, 0) and rounds.keeps_models(cfg, 1) and not rounds.keeps_models(cfg, 2)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_processes=2))
    assert not rounds.keeps_models(cfg, 1)


def test_run_rounds_without_gpus_runs_today_s_processes(tmp_path, monkeypatch):
    run_processes(tmp_path, monkeypatch, fake_stage_command(tmp_path, False), 0)
    calls = sorted((tmp_path / "calls.txt").read_text().splitlines())
    # train.num_processes 0 on CPU is one plain process (stage_command's default is 1 rank)
    assert calls == sorted(f"{s} main - 1" for s in STAGES)
    assert not list((tmp_path / "run").glob("logs/*-gpu*.log"))  # no per-GPU workers (only this process's own log)


def test_run_rounds_reports_the_failed_worker(tmp_path, monkeypatch):
    def command(url, stage, r, num_processes=1, follow=False, final=False):
        return [PY, "-c", "import os, sys; sys.exit(5 if os.environ.get('CUDA_VISIBLE_DEVICES') == '1' else 0)"]

    with pytest.raises(GndpoError, match=r"rollout of round 0 failed: worker gpu1 exited with code 5; log: .*r0000-rollout-gpu1\.log"):
        run_processes(tmp_path, monkeypatch, command, 2)


def test_cli_run_passes_gpus_and_keep_alive_to_the_loop(monkeypatch):
    """`gndpo run RUN --gpus 2 --no-keep-alive` reaches the loop as gpus=2, keep_alive=False; without
    the options the loop decides (every visible GPU, engines kept where it can)."""
    from gndpo.cli import run as run_command
    from gndpo.cli.app import app, register

    register()
    calls = []
    monkeypatch.setattr("gndpo.apps.loop.run_loop", lambda url, rounds, **kw: calls.append((url, rounds, kw)))
    monkeypatch.setattr(run_command, "round_summary", lambda run: f"summary of {run}")
    assert CliRunner().invoke(app, ["run", "R", "--rounds", "2", "--gpus", "2", "--no-keep-alive"]).exit_code == 0
    assert CliRunner().invoke(app, ["run", "R"]).exit_code == 0
    assert calls == [("R", 2, {"gpus": 2, "keep_alive": False, "learner_gpus": 0, "overlap": None}),
                     ("R", 3, {"gpus": None, "keep_alive": True, "learner_gpus": 0, "overlap": None})]


def test_the_run_s_last_round_is_marked_final_in_its_stage_commands(tmp_path):
    """A stage process of the run's last round gets --final (train then writes no optimizer state);
    a worker that stays knows its last round from --rounds, and --final beside --rounds is refused."""
    url = str(tmp_path / "run")
    assert rounds.stage_command(url, "train", 3, final=True)[-2:] == ["3", "--final"]
    assert "--final" not in rounds.stage_command(url, "train", 3)
    assert "--final" not in rounds.stage_command(url, "train", rounds.Stay(4), final=True)
    result = invoke("train", url, "--rounds", 2, "--final")
    assert result.exit_code != 0 and "--final marks one round" in result.output


def test_the_last_round_lets_go_of_each_stage_s_models_once_no_later_stage_uses_them(tmp_path, monkeypatch):
    """`gndpo run` on its own kept models: in the run's last round the rollout engine goes after rollout
    and the teachers after score (train's peak then holds neither); earlier rounds keep them, and a
    caller's set (``let_go`` false: a final evaluation, another run) keeps everything."""
    monkeypatch.setattr(rounds, "worker_log", lambda url, name: __import__("contextlib").nullcontext())
    events = []

    class Live:
        def let_go_of_samplers(self):
            events.append("samplers")

        def let_go_of_teachers(self):
            events.append("teachers")

    def run_stage(url, stage, r, log=print, live=None, run=None, final=False):
        events.append(f"{r}-{stage}")
        (tmp_path / f"{r}-{stage}").touch()

    monkeypatch.setattr(rounds, "run_stage", run_stage)
    rounds.run_rounds(str(tmp_path / "run"), 2, Live(), log=lambda *_: None, run=FakeRun(tmp_path), let_go=True)
    assert events == [*(f"0-{s}" for s in STAGES), "1-rollout", "samplers", "1-score", "teachers", "1-normalize", "1-train"]
    events.clear()
    for f in tmp_path.glob("*-*"):
        f.unlink()
    rounds.run_rounds(str(tmp_path / "run"), 1, Live(), log=lambda *_: None, run=FakeRun(tmp_path))
    assert "samplers" not in events and "teachers" not in events
