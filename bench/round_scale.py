"""Rounds at scale: normalize and train's data path on synthetic rounds of 10M, 100M and 1B response
tokens, each stage's wall time and peak RSS, in its own process.

Round 0's rollout and score shards are written through the project's work-unit protocol as score
writes them (zstd Parquet, one rollout and one score shard per unit of ``--shard-tokens``), with
responses of ``--length`` tokens and random log-probs, for two methods:

* ``gndpo``: sampled-token columns only. Normalize runs as TrOPD (GNDPO's moments and one token-level
  quantile over every token, TrOPD's tau), train's data path as GNDPO (whose targets need only the
  sampled tokens; TrOPD's own would need a top-k);
* ``reverse_kl``: a divergence on the teacher's top-16 per token (ids, log-probs and the rest).

Measured:
* ``gndpo normalize RUN --round 0``, the whole stage process;
* train's data path (:data:`DATA_PATH`): everything train does with the round's rows, without the
  model: the share read and written to step files, the schedule, then every step's rows read back
  and joined with their targets, 512 responses per optimizer step (the GNDPO paper's). The model's
  forward and backward are left out: on this CPU the toy model's 9k tokens/s would take a day at 1B.

Statistics are checked against exact references in the same run where memory allows them: the moments
against numpy (float64), the quantile against DuckDB's ``quantile_cont`` (which holds every value).

    .venv/bin/python bench/round_scale.py                                  # 10M, 100M, 1B; top-16 at 10M, 100M
    .venv/bin/python bench/round_scale.py --tokens 10e6 --topk-tokens 0    # a quick look

Writes ``results/round_scale.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, machine, save_json  # noqa: E402
from normalize_scale import ASSETS, SyntheticStage, list_array, measured  # noqa: E402

from gndpo.apps.demos.arithmetic import ensure_toy_assets  # noqa: E402
from gndpo.apps.init import init_run  # noqa: E402
from gndpo.pipeline.config.load import load_config  # noqa: E402
from gndpo.pipeline.exec.units import Worker  # noqa: E402
from gndpo.storage.records import StageRecords  # noqa: E402

TOPK = 16
RESPONSES_PER_STEP = 512

DATA_PATH = r"""
import dataclasses, json, sys, time
import numpy as np
from gndpo.pipeline.run.run import open_run
from gndpo.stages.models.device import set_cpu_threads
from gndpo.stages.train import schedule_steps
from gndpo.stages.train import TrainJob
from gndpo.stages.training.batch import load_share
set_cpu_threads()
t0 = time.time()
run = open_run(sys.argv[1])
if sys.argv[2]:  # train as another method over the same rows and statistics
    run = dataclasses.replace(run, cfg=dataclasses.replace(run.cfg, method=dataclasses.replace(run.cfg.method, name=sys.argv[2])))
share = load_share(TrainJob(run, 0).inputs, 0, 1)
t_index = time.time() - t0
steps = schedule_steps(share, run.cfg.train, chunk=4096)
rows = tokens = 0
adv = 0.0
for i in range(len(steps)):
    step_rows = share.rows(i)
    rows += len(step_rows)
    tokens += sum(len(r.response) for r in step_rows)
    adv += sum(float(r.adv.sum()) for r in step_rows)
spilled = share.step_file_bytes()
share.close()
print("RESULT " + json.dumps({"rows": rows, "tokens": tokens, "steps": len(steps), "index_seconds": t_index,
                              "step_files_gib": spilled / 2**30, "adv_sum": adv, "seconds_inside": time.time() - t0}))
"""

IMPORTS = r"""
import json, resource
from gndpo.pipeline.run.run import open_run
from gndpo.stages.train import schedule_steps
from gndpo.stages.training.batch import load_share
print("RESULT " + json.dumps({}))
"""

EXACT = r"""
import json, sys
import numpy as np
import pyarrow.parquet as pq
from gndpo.pipeline.run.run import open_run
from gndpo.stages.normalize import create_views
from gndpo.storage.duck import connect, parquet_source

run = open_run(sys.argv[1])
scores = run.records(0, "score").require_manifest().files()
rollouts = run.records(0, "rollout").require_manifest().row_files()
con = connect(run.fs, threads=1)
create_views(con, parquet_source(run.fs, rollouts), parquet_source(run.fs, scores), run.cfg)
q = run.cfg.method.tropd.tau_quantile
tau = con.execute(f"SELECT quantile_cont(exp(least(lpT - lpS, 0)), {q}) FROM tokens").fetchall()[0][0]
n, total, squares = 0, 0.0, 0.0  # numpy's float64 sums, shard by shard (every token is valid here)
for r in scores:
    t = pq.read_table(run.fs.path(r.path), columns=["teacher_logprobs", "student_logprobs"])
    lpT, lpS = (t.column(i).combine_chunks().values.to_numpy().astype(np.float64) for i in range(2))
    c = np.clip(lpT - lpS, -5.0, 5.0)
    n, total, squares = n + c.size, total + float(c.sum()), squares + float((c * c).sum())
mean = total / n
print("RESULT " + json.dumps({"tropd_tau": tau, "c_mean": mean, "c_var": (squares - n * mean * mean) / (n - 1), "token_count": n}))
"""


class TopkStage(SyntheticStage):
    """Score rows with a teacher top-16 per token (ids, log-probs, rest), rollouts as the parent's."""

    def _scores(self, ids, rng, n, L):
        table = super()._scores(ids, rng, n, L)
        ids_flat = rng.integers(0, 151_936, n * L * TOPK, dtype=np.int32)
        logp = np.sort(-rng.exponential(2.0, (n * L, TOPK)).astype(np.float32), axis=1)[:, ::-1].reshape(-1)
        for name, values in (("teacher_topk_ids", ids_flat), ("teacher_topk_logprobs", logp)):
            inner = pa.FixedSizeListArray.from_arrays(pa.array(values), TOPK)
            column = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32) * L), inner)
            table = table.set_column(table.schema.get_field_index(name), name, column)
        rest = list_array(np.log(rng.uniform(0.01, 0.5, n * L)).astype(np.float32), L, n, pa.float32())
        return table.set_column(table.schema.get_field_index("teacher_rest_logprob"), "teacher_rest_logprob", rest)


def make_run(folder: Path, method: str, tokens: int, length: int, shard_tokens: int) -> Path:
    assets = ensure_toy_assets(ASSETS, log=lambda *_: None)
    rows = -(-tokens // length)
    # "gndpo": initialised as TrOPD, whose normalize adds a token quantile to GNDPO's moments
    methods = {"gndpo": {"name": "tropd", "tropd": {"tau_quantile": 0.25, "outlier": "mask"}}, "reverse_kl": {"name": "reverse_kl"}}
    config = {
        "student": str(assets / "student"), "teacher": str(assets / "teacher"),
        "data": {"train": str(assets / "train.jsonl"), "heldout": str(assets / "heldout.jsonl")},
        "method": methods[method], "score": {"teacher_topk": TOPK},
        "rollout": {"max_tokens": 8, "prompts_per_round": 16}, "engine": {"max_model_len": 32},  # rollout never runs here
        "train": {"optimizer_steps": max(1, rows // RESPONSES_PER_STEP)},
    }
    (folder / "config.yaml").write_text(json.dumps(config))
    run = init_run(str(folder / "run"), load_config(str(folder / "config.yaml")))
    rows_per_shard = -(-shard_tokens // length)
    units = -(-tokens // (rows_per_shard * length))
    stage_class = TopkStage if method == "reverse_kl" else SyntheticStage
    for stage in ("rollout", "score"):
        Worker(StageRecords(run.fs, 0, stage), stage_class(run.fs, stage, units, rows_per_shard, length), log=lambda *_: None).run()
    return folder / "run"


def bench(method: str, tokens: int, length: int, shard_tokens: int, exact: bool) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="gndpo-round-bench-"))
    try:
        t0 = time.time()
        run = make_run(folder, method, tokens, length, shard_tokens)
        built = time.time() - t0
        normalize = measured([sys.executable, "-m", "gndpo.cli", "normalize", str(run), "--round", "0"])
        data_path = measured([sys.executable, "-c", DATA_PATH, str(run), "gndpo" if method == "gndpo" else ""])
        imports = measured([sys.executable, "-c", IMPORTS])  # the same process, its imports only
        from gndpo.pipeline.run.run import open_run

        stats = open_run(str(run)).records(0, "normalize").require_manifest().metrics
        out = {
            "method": method, "token_rows": int(stats["token_count"]), "responses": int(stats["responses"]), "response_length": length,
            "parquet_gib": sum(f.stat().st_size for f in (run / "rounds").rglob("*.parquet")) / 2**30, "build_seconds": built,
            "normalize": {k: normalize[k] for k in ("seconds", "peak_rss_gib")},
            "train_data_path": {"seconds": data_path["seconds"], "peak_rss_gib": data_path["peak_rss_gib"],
                                "imports_rss_gib": imports["peak_rss_gib"], **data_path["result"]},
            "statistics": {k: stats.get(k) for k in ("c_mean", "c_var", "tropd_tau")},
        }
        if exact and method == "gndpo":
            ref = measured([sys.executable, "-c", EXACT, str(run)])
            out["exact"] = {"seconds": ref["seconds"], "peak_rss_gib": ref["peak_rss_gib"], **ref["result"]}
            out["moments_rel_error"] = max(abs(stats[k] - ref["result"][k]) / max(abs(ref["result"][k]), 1e-300) for k in ("c_mean", "c_var"))
            out["quantile_equal"] = stats["tropd_tau"] == ref["result"]["tropd_tau"]
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def table(results: list[dict], command: str) -> str:
    lines = [
        f"`{command}` on {machine()}, {', '.join(sorted({r['date'] for r in results}))}. Train's data path: the rows read, "
        f"written to step files, read back and joined ({RESPONSES_PER_STEP} responses per step), without the model.",
        "",
        "| method | response tokens | Parquet | normalize: wall / peak RSS | train data path: wall / peak RSS (imports alone) / step files "
        "| exact reference: wall / peak RSS | moments rel. error | quantile equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        exact = r.get("exact")
        lines.append(
            f"| {r['method']} | {r['requested_tokens'] / 1e6:,.0f}M | {r['parquet_gib']:.2f} GiB | {r['normalize']['seconds']:.1f} s / "
            f"{r['normalize']['peak_rss_gib']:.2f} GiB | {r['train_data_path']['seconds']:.1f} s / {r['train_data_path']['peak_rss_gib']:.2f} GiB "
            f"({r['train_data_path']['imports_rss_gib']:.2f}) / "
            f"{r['train_data_path']['step_files_gib']:.2f} GiB | "
            + (f"{exact['seconds']:.1f} s / {exact['peak_rss_gib']:.2f} GiB | {r['moments_rel_error']:.1e} | {r['quantile_equal']} |"
               if exact else "not run | - | - |")
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, action="append", help="gndpo rounds, response tokens (default 10e6, 100e6, 1e9; 0: none)")
    ap.add_argument("--topk-tokens", type=float, action="append", help="reverse_kl top-16 rounds (default 10e6, 100e6; 0: none)")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--shard-tokens", type=float, default=64 * 16 * 2048, help="tokens per unit (default: 64 prompts x 16 x 2,048)")
    ap.add_argument("--exact-up-to", type=float, default=1e9, help="run the exact references up to this size (DuckDB's quantile_cont holds "
                    "every value: 16 GiB at 1B)")
    ap.add_argument("--update", action="store_true", help="keep the other rows of the results file, replacing those run now")
    args = ap.parse_args()
    runs = [("gndpo", t) for t in (args.tokens or [10e6, 100e6, 1e9]) if t] + [("reverse_kl", t) for t in (args.topk_tokens or [10e6, 100e6]) if t]
    saved = json.loads((RESULTS / "round_scale.json").read_text()) if args.update else {"results": []}
    results = {(r["method"], r["requested_tokens"]): r for r in saved["results"]}
    for method, tokens in runs:
        results[method, int(tokens)] = {"requested_tokens": int(tokens), "date": time.strftime("%Y-%m-%d"),
                                        **bench(method, int(tokens), args.length, int(args.shard_tokens), tokens <= args.exact_up_to)}
        print(json.dumps(results[method, int(tokens)], indent=1), flush=True)
    rows = sorted(results.values(), key=lambda r: (r["method"] != "gndpo", r["requested_tokens"]))
    command = saved.get("command") if args.update else "python bench/round_scale.py " + " ".join(sys.argv[1:])
    save_json(RESULTS / "round_scale.json", {"machine": machine(), "command": command, "results": rows})
    (RESULTS / "round_scale.md").write_text(table(rows, command))
    print(table(rows, command))


if __name__ == "__main__":
    main()
