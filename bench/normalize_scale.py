"""The normalize stage at scale: the real `gndpo normalize` process on synthetic committed shards,
beside an in-memory numpy baseline over the same shards, in the same run.

A run is initialised on the toy models with method TrOPD and ``tau_quantile`` 0.25, so normalize
computes GNDPO's moments (from score's per-response partial sums) AND one token-level quantile over
every valid token (the acceptance min(pi_T / pi_S, 1), as TrOPD's tau needs; TIP's entropy quantile
has the same cost). Round 0's rollout and score stages are committed through the project's own work
-unit protocol with synthetic rows: responses of ``--length`` tokens with random log-probs, in shards
of about ``--shard-tokens`` token rows (zstd Parquet, as score writes them).

Measured, each in its own process (peak RSS from the OS, wall time around the process):
* ``gndpo normalize RUN --round 0``: the whole stage, CLI start-up and checksum verification included;
* numpy: read the same columns with pyarrow into memory, then the same moments and quantile.

Usage: python bench/normalize_scale.py [--tokens 100e6] [--tokens 1e9 ...] [--keep]
Writes bench/results/normalize_scale.json and .md.
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

import numpy as np
import pyarrow as pa

from gndpo.apps.demos.arithmetic import ModelSpec, ToySpec, ensure_toy_assets
from gndpo.apps.init import init_run
from gndpo.pipeline.config.load import load_config
from gndpo.pipeline.exec.inputs import StageInputs
from gndpo.pipeline.exec.stage import StageJob
from gndpo.pipeline.exec.units import Worker
from gndpo.storage.products import Unit, UnitNumbers
from gndpo.storage.records import StageRecords
from gndpo.storage.shards import ROLLOUTS, scores_schema, write_shard

OUT = Path(__file__).parent / "results"
ASSETS = ToySpec(digits=2, n_train_prompts=96, n_heldout=24, student_max_steps=5,
                 model=ModelSpec(layers=1, hidden=64, heads=2, max_steps=20, lr=3e-3, batch=32))
CLAMP = 5.0


def list_array(flat: np.ndarray, length: int, rows: int, typ) -> pa.Array:
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * length)
    return pa.ListArray.from_arrays(offsets, pa.array(flat, type=typ))


class Synthetic(UnitNumbers):
    responses: int = 0
    tokens: int = 0


class SyntheticStage(StageJob):
    """Round 0's rollout or score stage with synthetic rows: unit u holds responses [u*R, (u+1)*R)."""

    def __init__(self, fs, stage: str, units: int, rows: int, length: int):
        self.fs, self.stage, self.units, self.rows, self.length = fs, stage, units, rows, length
        self.inputs = StageInputs(None, 0, ())  # it reads nothing

    def plan(self):
        return [Unit(f"u{u:05d}") for u in range(self.units)], {"synthetic": True}

    def run_unit(self, unit, out_dir):
        u = int(unit.id[1:])
        rng = np.random.default_rng(u)
        n, L = self.rows, self.length
        ids = pa.array([f"r0000-p{u:05d}{i:07d}-000" for i in range(n)])
        if self.stage == "rollout":
            table = self._rollouts(ids, rng, n, L)
        else:
            table = self._scores(ids, rng, n, L)
        return [write_shard(self.fs, f"{out_dir}/part-00000.parquet", table)], Synthetic(responses=n, tokens=n * L)

    def _rollouts(self, ids, rng, n, L):
        const = lambda v, t: pa.array([v] * n, type=t)  # noqa: E731
        cols = {
            "rollout_id": ids, "prompt_id": ids, "sample_idx": const(0, pa.int32()), "round": const(0, pa.int32()),
            "policy_version": const(0, pa.int32()),
            "prompt_token_ids": list_array(np.ones(n * 8, np.int32), 8, n, pa.int32()),
            "response_token_ids": list_array(rng.integers(0, 151_936, n * L, dtype=np.int32), L, n, pa.int32()),
            "loss_mask": list_array(np.ones(n * L, np.int8), L, n, pa.int8()),
            "teacher_prefix_len": const(0, pa.int32()),
            "sampler_logprobs": list_array(-rng.exponential(1.0, n * L).astype(np.float32), L, n, pa.float32()),
            "finish_reason": const("length", pa.string()), "num_turns": const(1, pa.int32()),
            "tool_calls": pa.array([[]] * n, type=ROLLOUTS.field("tool_calls").type), "reward": pa.array(rng.integers(0, 2, n).astype(np.float64)),
            "rewards": pa.array([[("exact_match", 0.0)]] * n, type=pa.map_(pa.string(), pa.float64())),
            "temperature": const(1.0, pa.float32()), "top_p": const(1.0, pa.float32()), "top_k": const(-1, pa.int32()),
            "max_tokens": const(L, pa.int32()), "seed": const(0, pa.int64()), "logprobs_mode": const("raw", pa.string()),
            "prompt": const("", pa.string()), "response": const("", pa.string()),
        }
        return pa.table(cols, schema=ROLLOUTS)

    def _scores(self, ids, rng, n, L):
        lpT = -rng.exponential(1.0, n * L).astype(np.float32)
        lpS = -rng.exponential(1.0, n * L).astype(np.float32)
        c = np.clip(lpT.astype(np.float64) - lpS, -CLAMP, CLAMP).reshape(n, L)
        schema = scores_schema(16)
        cols = {
            "rollout_id": ids, "prompt_id": ids,
            "teacher_logprobs": list_array(lpT, L, n, pa.float32()), "student_logprobs": list_array(lpS, L, n, pa.float32()),
            "n_valid": pa.array(np.full(n, L, np.int64)), "c_sum": pa.array(c.sum(1)), "c_sq_sum": pa.array((c * c).sum(1)),
            "c_min": pa.array(c.min(1)), "c_max": pa.array(c.max(1)), "teacher": pa.array(["teacher"] * n),
        }
        for name in schema.names:
            if name not in cols:
                cols[name] = pa.nulls(n, schema.field(name).type)
        return pa.table(cols, schema=schema)

    def summarize(self, commits):
        return {"responses": sum(c.numbers.responses for c in commits), "tokens": sum(c.numbers.tokens for c in commits)}


def make_run(folder: Path, tokens: int, length: int, shard_tokens: int) -> Path:
    assets = ensure_toy_assets(ASSETS, log=lambda *_: None)
    config = {
        "student": str(assets / "student"), "teacher": str(assets / "teacher"),
        "data": {"train": str(assets / "train.jsonl"), "heldout": str(assets / "heldout.jsonl")},
        "method": {"name": "tropd", "tropd": {"tau_quantile": 0.25, "outlier": "mask"}},
        "rollout": {"max_tokens": 8, "prompts_per_round": 16}, "engine": {"max_model_len": 32},  # rollout never runs here
    }
    (folder / "config.yaml").write_text(json.dumps(config))
    run = init_run(str(folder / "run"), load_config(str(folder / "config.yaml")))
    rows_per_shard = -(-shard_tokens // length)
    units = -(-tokens // (rows_per_shard * length))
    for stage in ("rollout", "score"):
        job = SyntheticStage(run.fs, stage, units, rows_per_shard, length)
        Worker(StageRecords(run.fs, 0, stage, Synthetic), job, log=lambda *_: None).run()
    return folder / "run"


NUMPY_BASELINE = r"""
import json, sys, time
import numpy as np
import pyarrow.parquet as pq
from gndpo.pipeline.run.run import open_run


t0 = time.time()
run = open_run(sys.argv[1])
paths = lambda m: [run.fs.path(r.path) for r in m]
scores = run.records(0, "score").require_manifest().files()
rollouts = run.records(0, "rollout").require_manifest().row_files()
lpT = np.concatenate([pq.read_table(p, columns=["teacher_logprobs"]).column(0).combine_chunks().values.to_numpy() for p in paths(scores)])
lpS = np.concatenate([pq.read_table(p, columns=["student_logprobs"]).column(0).combine_chunks().values.to_numpy() for p in paths(scores)])
mask = np.concatenate([pq.read_table(p, columns=["loss_mask"]).column(0).combine_chunks().values.to_numpy() for p in paths(rollouts)]) == 1
r = lpT[mask].astype(np.float64) - lpS[mask]
c = np.clip(r, -5.0, 5.0)
out = {"token_count": int(c.size), "c_mean": float(c.mean()), "c_var": float(c.var(ddof=1)),
       "tropd_tau": float(np.quantile(np.exp(np.minimum(r, 0.0)), 0.25)), "seconds_inside": time.time() - t0}
print("RESULT " + json.dumps(out))
"""


def measured(argv: list[str]) -> dict:
    """Run ``argv`` in a fresh process; wall seconds, peak RSS (GiB) and its RESULT line, if any."""
    probe = (
        "import json, resource, subprocess, sys, time; t = time.time(); "
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "print(json.dumps({'rc': p.returncode, 'seconds': time.time() - t, "
        "'peak_rss_gib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, "
        "'stdout': p.stdout[-4000:], 'stderr': p.stderr[-2000:]}))"
    )
    out = json.loads(subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, check=True).stdout)
    if out["rc"] != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{out['stderr']}")
    line = next((x for x in out["stdout"].splitlines() if x.startswith("RESULT ")), None)
    out["result"] = json.loads(line.removeprefix("RESULT ")) if line else None
    return {k: v for k, v in out.items() if k not in ("stdout", "stderr", "rc")}


def bench(tokens: int, length: int, shard_tokens: int, keep: bool) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="gndpo-normalize-bench-"))
    try:
        t0 = time.time()
        run = make_run(folder, tokens, length, shard_tokens)
        built = time.time() - t0
        stage = measured([sys.executable, "-m", "gndpo.cli", "normalize", str(run), "--round", "0"])
        from gndpo.pipeline.run.run import open_run

        manifest = open_run(str(run)).records(0, "normalize").require_manifest()
        stats, stage_seconds = manifest.metrics, manifest.only().numbers.seconds
        # The baseline holds ~40 bytes per token row (two float32 columns, their float64 difference and
        # its clamp, the mask); past what the machine has, it is not run.
        need = 40 * tokens / 2**30
        if need < 0.6 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30:
            numpy = measured([sys.executable, "-c", NUMPY_BASELINE, str(run)])
            ref = numpy.pop("result")
            agree = all(abs(stats[k] - ref[k]) <= 1e-6 * max(1.0, abs(ref[k])) for k in ("c_mean", "c_var", "tropd_tau"))
        else:
            numpy, agree = {"seconds": None, "peak_rss_gib": None, "skipped": f"needs about {need:.0f} GiB"}, None
        disk = sum(f.stat().st_size for f in (run / "rounds").rglob("*.parquet"))
        return {
            "token_rows": int(stats["token_count"]), "responses": int(stats["responses"]), "response_length": length,
            "shards_per_stage": len(list((run / "rounds" / "r0000" / "score").rglob("*.parquet"))), "parquet_gib": disk / 2**30,
            "build_seconds": built,
            "stage": {"seconds": stage["seconds"], "unit_seconds": stage_seconds, "peak_rss_gib": stage["peak_rss_gib"]},
            "numpy": numpy,
            "stage_vs_numpy_speed": numpy["seconds"] / stage["seconds"] if numpy["seconds"] else None,
            "stage_vs_numpy_memory": stage["peak_rss_gib"] / numpy["peak_rss_gib"] if numpy["seconds"] else None,
            "statistics_agree_with_numpy": agree,
        }
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, action="append", help="token rows (repeatable; default 100e6)")
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--shard-tokens", type=float, default=10e6)
    ap.add_argument("--keep", action="store_true", help="keep the synthetic runs (in the temp folder)")
    args = ap.parse_args()
    results = []
    for tokens in args.tokens or [100e6]:
        r = bench(int(tokens), args.length, int(args.shard_tokens), args.keep)
        results.append(r)
        print(json.dumps(r, indent=1), flush=True)
    OUT.mkdir(exist_ok=True)
    meta = {"cpus": os.cpu_count(), "command": "python bench/normalize_scale.py " + " ".join(sys.argv[1:])}
    (OUT / "normalize_scale.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [
        f"`{meta['command']}` ({meta['cpus']} CPUs). Normalize = GNDPO moments + one token-level quantile (TrOPD tau).",
        "",
        "| token rows | Parquet | normalize stage: wall / inside the unit / peak RSS | numpy: wall / peak RSS | speed vs numpy "
        "| memory vs numpy | same statistics |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        np_cols = (
            [f"{r['numpy']['seconds']:.1f} s / {r['numpy']['peak_rss_gib']:.2f} GiB", f"{r['stage_vs_numpy_speed']:.2f}x",
             f"{r['stage_vs_numpy_memory']:.2f}x", str(r["statistics_agree_with_numpy"])]
            if r["numpy"]["seconds"] else [f"not run ({r['numpy']['skipped']})", "-", "-", "-"]
        )
        lines.append(
            f"| {r['token_rows'] / 1e6:.0f}M | {r['parquet_gib']:.2f} GiB | {r['stage']['seconds']:.1f} s / {r['stage']['unit_seconds']:.1f} s / "
            f"{r['stage']['peak_rss_gib']:.2f} GiB | " + " | ".join(np_cols) + " |"
        )
    (OUT / "normalize_scale.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
