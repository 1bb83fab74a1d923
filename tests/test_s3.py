"""A full round with the run folder on s3://, against a real S3-protocol server on loopback (moto's
server, started here), with `gndpo status`, `gndpo sql` and `gndpo eval` reading it back, and its rows
and trained weights equal to the same round run on local disk; racing writers on one exclusive create."""

import importlib.util
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec.config
import pytest
import yaml

from tests.conftest import free_ports, gndpo, invoke, invoke_ok, missing_component, tiny_config_dict
from tests.s3_server import MOTO_SERVER, start_moto_server

pytestmark = pytest.mark.slow
BUCKET = "gndpo-test"


@pytest.fixture(scope="module")
def s3_endpoint():
    if importlib.util.find_spec("boto3") is None or not MOTO_SERVER.exists():
        missing_component("moto's server or boto3 is not installed (the test extra installs them)")
    import boto3
    port, = free_ports(1)
    server, endpoint = start_moto_server(port)
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        # fsspec passes FSSPEC_<PROTOCOL>_<KWARG> to every filesystem it makes, in every process.
        "FSSPEC_S3_ENDPOINT_URL": endpoint,
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # Subprocesses read FSSPEC_* when they import fsspec; this process imported it long ago.
    fsspec.config.set_conf_env(fsspec.config.conf)
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
    yield env
    server.terminate()
    server.wait(timeout=30)
    fsspec.config.conf.get("s3", {}).pop("endpoint_url", None)
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_exclusive_create_on_s3(s3_endpoint):
    from gndpo.storage.runfs import RunFS

    fs = RunFS(f"s3://{BUCKET}/records")
    assert fs.create("x.json", b"{}")
    assert not fs.create("x.json", b'{"other": 1}')
    assert fs.read_json("x.json") == {}


def test_racing_writers_on_one_exclusive_create_one_wins(s3_endpoint):
    """Eight writers released together by a barrier create the same record (a claim, a commit): in every
    trial exactly one create reports success, and the record holds that writer's body."""
    from gndpo.storage.runfs import RunFS

    fs, writers = RunFS(f"s3://{BUCKET}/race"), 8
    for trial in range(5):
        barrier = threading.Barrier(writers)

        def write(i: int) -> bool:
            barrier.wait()
            return fs.create(f"claim-{trial}.json", json.dumps({"writer": i}).encode())

        with ThreadPoolExecutor(writers) as pool:
            won = list(pool.map(write, range(writers)))
        assert won.count(True) == 1, won
        assert fs.read_json(f"claim-{trial}.json") == {"writer": won.index(True)}


def test_listing_a_missing_folder_does_not_list_its_parent(s3_endpoint):
    """A never-claimed unit's claims folder: s3fs would answer by listing ``claims/``, every unit's
    folder, so a worker's look at each unit grew with the stage (bench/executor_scale.py)."""
    from gndpo.storage.runfs import RunFS

    fs = RunFS(f"s3://{BUCKET}/listing")
    for unit in range(30):
        assert fs.create(f"claims/u{unit:03d}/a001.json", b"{}")
    calls = []
    original = fs.fs._call_s3

    async def counted(method, *args, **kwargs):
        calls.append((method, kwargs.get("Prefix")))
        return await original(method, *args, **kwargs)

    fs.fs._call_s3 = counted
    try:
        assert fs.listdir("claims/u999") == []
        assert fs.listdir("claims/u007") == ["a001.json"]
    finally:
        del fs.fs._call_s3
    assert len(fs.listdir("claims")) == 30
    assert ("list_objects_v2", "listing/claims/") not in calls, calls  # the parent is never listed
    assert len(calls) <= 5, calls


def stage_rows(url: str, stage: str) -> list[dict]:
    """A committed stage's rows of round 0, by rollout id (local or s3://)."""
    from gndpo.pipeline.run.run import open_run
    from gndpo.storage.shards import read_shards

    run = open_run(url)
    manifest = run.records(0, stage).require_manifest()
    files = manifest.row_files()
    rows = read_shards(run.fs, files).to_pylist()
    return sorted(rows, key=lambda r: r["rollout_id"])


def trained_weights(url: str) -> bytes:
    """The bytes of round 0's exported model.safetensors (local or s3://)."""
    from gndpo.pipeline.run.run import open_run

    model_dir = open_run(url).records(0, "train").manifest().metrics["model_dir"]
    with fsspec.open(f"{url}/{model_dir}/model.safetensors", "rb") as f:
        return f.read()


def test_full_round_on_s3(s3_endpoint, tmp_path, tiny_assets):
    # The round samples on the student's own module (rollout.backend hf): what is claimed here is the
    # storage's; `gndpo eval` below serves the exported student with vLLM.
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config_dict(tiny_assets, rollout={"backend": "hf"})))
    run = f"s3://{BUCKET}/runs/r1"
    # The commands that import torch, vLLM or DeepSpeed run in this process (the fixture pointed fsspec at
    # the server here as well); status and sql, which do not, show that a new process finds it too.
    invoke_ok("init", run, "--config", config)
    invoke_ok("run", run, "--rounds", "1")
    status = gndpo("status", run, env=s3_endpoint).stdout
    assert status.count("committed") == 4
    out = gndpo("sql", run, "SELECT count(*) AS n, count(DISTINCT rollout_id) AS ids FROM rollouts", "--format", "csv", env=s3_endpoint).stdout
    assert out.strip().splitlines() == ["n,ids", "32,32"]
    out = gndpo("sql", run, "SELECT count(*) FROM scores s JOIN rollouts r USING (rollout_id)", "--format", "csv", env=s3_endpoint).stdout
    assert out.strip().splitlines()[1] == "32"
    # The same round on local disk (in this process): the same rows in every stage and the same trained
    # weights, bit for bit.
    invoke_ok("init", tmp_path / "local", "--config", config)
    invoke_ok("run", tmp_path / "local", "--rounds", "1")
    for stage in ("rollout", "score"):
        assert stage_rows(run, stage) == stage_rows(str(tmp_path / "local"), stage), stage
    assert trained_weights(run) == trained_weights(str(tmp_path / "local"))
    # The exported student lives on S3; eval downloads it, serves it with vLLM, and writes its
    # per-prompt results back to S3.
    result = invoke_ok("eval", run, "--out", f"{run}-eval").stdout
    assert "policy_version=1" in result and "pass@1=" in result
    with fsspec.open(f"{run}-eval/summary.json") as f:
        assert json.load(f)["policy_version"] == 1
    # `gndpo export` copies the student out of the S3 run (each file checked against its record), to a
    # local folder and to another S3 prefix, byte for byte.
    from gndpo.pipeline.run.run import open_run

    model_dir = open_run(run).records(0, "train").manifest().metrics["model_dir"]
    local = tmp_path / "student"
    invoke_ok("export", run, local)
    invoke_ok("export", run, f"{run}-student")
    assert {p.name for p in local.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert not (local / "gndpo_probe.json").exists()
    fs = fsspec.filesystem("s3")
    assert sorted(fs.ls(f"{BUCKET}/runs/r1-student", detail=False)) == sorted(f"{BUCKET}/runs/r1-student/{p.name}" for p in local.iterdir())
    for folder in (f"{run}/{model_dir}", f"{run}-student"):
        with fsspec.open(f"{folder}/model.safetensors", "rb") as f:
            assert f.read() == (local / "model.safetensors").read_bytes()
    refused = invoke("export", run, tmp_path / "adapters", "--adapters")
    assert refused.exit_code == 1 and "has no adapters (model.lora was off)" in refused.stderr
    # Another run with this run's policy as its teacher (teacher: run:s3://...): resolved at init against
    # the commit record on S3, and read through a local download with the same bytes.
    child_config = tmp_path / "child.yaml"
    child_config.write_text(yaml.safe_dump(tiny_config_dict(tiny_assets, teacher=f"run:{run}")))
    invoke_ok("init", f"{run}-child", "--config", child_config)
    child = open_run(f"{run}-child")
    assert child.teacher_runs[f"run:{run}"]["policy"] == 1
    folder = child.teacher_models(0)[f"run:{run}"]
    assert (Path(folder) / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()

