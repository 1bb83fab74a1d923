"""The executor at scale: one stage of N work units planned, claimed, committed and manifested by a
worker, then read by ``gndpo status`` and ``gndpo gc``, on local disk and on S3 (moto's server on
loopback). Each unit computes nothing, so what is timed is the executor's own record traffic (claim,
heartbeat, a one-row shard, commit record, the listings between units). Seconds per 1,000 units at each N show what
grows with the unit count: constant per 1,000 is linear in N.

    .venv/bin/python bench/executor_scale.py                      # local 1,000 and 10,000; S3 500 and 2,000
    .venv/bin/python bench/executor_scale.py --local 1000 --s3 0  # a quick look

Writes ``results/executor_scale.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, machine, save_json  # noqa: E402

sys.path.insert(0, str(HERE.parent))  # the repository root, for tests.s3_server
from tests.s3_server import start_moto_server  # noqa: E402

BUCKET = "gndpo-bench"


class NullJob:
    """A stage of ``n`` units that compute nothing; each writes one one-row shard, so its attempt
    folder exists for gc to look at."""

    stage = "rollout"

    def __init__(self, fs, n: int):
        self.fs, self.n = fs, n

    def plan(self):
        return [{"unit": f"u{i:05d}"} for i in range(self.n)], {}

    def setup(self):
        pass

    def run_unit(self, unit, out_dir):
        import pyarrow as pa

        from gndpo.storage.shards import write_shard

        return [write_shard(self.fs, f"{out_dir}/part-00000.parquet", pa.table({"i": [0]}))], {}

    def summarize(self, commits):
        return {"units": len(commits)}


def timed(call) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def measure(url: str, n: int) -> dict:
    """Seconds of each executor step for a fresh run at ``url`` with a stage of ``n`` units."""
    from gndpo.pipeline.config.load import config_to_yaml
    from gndpo.pipeline.exec.gc import collect_garbage
    from gndpo.pipeline.exec.status import stage_rows
    from gndpo.pipeline.exec.units import Worker
    from gndpo.pipeline.run.run import open_run
    from gndpo.pipeline.settings.schema import Config
    from gndpo.storage.runfs import RunFS

    fs = RunFS(url)
    fs.create("run.yaml", config_to_yaml(Config()).encode())
    worker = Worker(open_run(url).records(0, "rollout"), NullJob(fs, n), log=lambda *_: None, set_up=True)
    seconds = {"plan": timed(worker.ensure_plan), "claim_and_commit": timed(worker.run),
               "status": timed(lambda: stage_rows(open_run(url))), "gc": timed(lambda: collect_garbage(open_run(url)))}
    return {"units": n, "seconds": {k: round(v, 2) for k, v in seconds.items()},
            "per_1000_units": {k: round(v * 1000 / n, 2) for k, v in seconds.items()}}


def moto_endpoint() -> tuple[subprocess.Popen, str]:
    """moto's S3 server on a free loopback port, with the environment fsspec and boto3 read."""
    import socket

    import boto3
    import fsspec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, endpoint = start_moto_server(port)
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                       "FSSPEC_S3_ENDPOINT_URL": endpoint})
    fsspec.config.set_conf_env(fsspec.config.conf)
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
    return server, endpoint


def table(result: dict) -> str:
    lines = [f"{result['date']}, {result['machine']}, one worker; seconds per 1,000 units (and in all).", "",
             "| storage | units | plan | claim and commit | status | gc |", "|---|---|---|---|---|---|"]
    for row in result["runs"]:
        cells = [f"{row['per_1000_units'][k]} ({row['seconds'][k]})" for k in ("plan", "claim_and_commit", "status", "gc")]
        lines.append(f"| {row['storage']} | {row['units']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local", type=int, nargs="*", default=[1000, 10000], help="unit counts on local disk")
    ap.add_argument("--s3", type=int, nargs="*", default=[500, 2000], help="unit counts on S3 (moto); none: skip")
    ap.add_argument("--out", default=str(RESULTS / "executor_scale"), help="results, as OUT.json and OUT.md")
    a = ap.parse_args(argv)
    runs = []
    folder = Path(tempfile.mkdtemp(prefix="gndpo-executor-"))
    try:
        for n in a.local:
            runs.append({"storage": "local disk", **measure(str(folder / f"local-{n}"), n)})
            print(json.dumps(runs[-1]), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if a.s3:
        server, _ = moto_endpoint()
        try:
            for n in a.s3:
                runs.append({"storage": "S3 (moto, loopback)", **measure(f"s3://{BUCKET}/run-{n}", n)})
                print(json.dumps(runs[-1]), flush=True)
        finally:
            server.terminate()
            server.wait(timeout=30)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "runs": runs}
    save_json(Path(a.out + ".json"), result)
    Path(a.out + ".md").write_text(table(result))
    print(table(result))
    return result


if __name__ == "__main__":
    main()
