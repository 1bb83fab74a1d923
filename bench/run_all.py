"""Every figure of the performance summary (docs/benchmarks/index.md), in one command, each script in its own process.

    .venv/bin/python bench/run_all.py            # all figures (2 CPU cores: about 63 minutes, 41 of them SmolLM2)
    .venv/bin/python bench/run_all.py --skip normalize_scale

Runs, in order: the demo timing (``gndpo demo`` with venv and toy models cached), ``round_vs_trl.py``
(demo workload and W), ``rollout_speed.py``, ``flops.py``, ``shard_bytes.py`` (on the W round's shards),
``scaling.py``, ``normalize_scale.py`` (100M and 1B token rows), ``tool_rollout.py``,
``score_backend.py``, and the SmolLM2 workload (``round_vs_trl.py --workload smollm2``, then
``smollm2_throughput.py`` on that round), and the seeds' shape on SmolLM2 (``--workload smollm2-seeds``).
Each writes its own JSON under
``bench/results/``; this script then writes ``results/summary.json`` and ``results/summary.md``: one row
per goal of the performance issue with the measured figure and whether it meets the goal.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, gndpo_cmd, run_timed, save_json  # noqa: E402

STEPS = {
    "demo": None,  # timed here
    "round_vs_trl": ["round_vs_trl.py"],
    "rollout_speed": ["rollout_speed.py"],
    "flops": ["flops.py"],
    "shard_bytes": ["shard_bytes.py"],
    "scaling": ["scaling.py"],
    "normalize_scale": ["normalize_scale.py", "--tokens", "100e6", "--tokens", "1e9"],
    "tool_rollout": ["tool_rollout.py"],
    "score_backend": ["score_backend.py"],
    "smollm2": [["round_vs_trl.py", "--workload", "smollm2"], ["smollm2_throughput.py"]],  # one after the other
    "smollm2_seeds": [["round_vs_trl.py", "--workload", "smollm2-seeds", "--workload", "smollm2-seeds-3-rounds"]],
}


def time_demo(folder: Path) -> dict:
    """``gndpo demo`` end to end (toy assets cached by an earlier run), and its table."""
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    gndpo_cmd("demo")  # the same interpreter's CLI
    seconds, out = run_timed(gndpo_cmd("demo", str(folder)), folder.parent / "demo.log")
    accuracies = [float(x) for x in re.findall(r"┆ (0\.\d+|1\.0)\s+┆", out)]
    return {"seconds": round(seconds, 1), "heldout_acc": accuracies}


def load(name: str):
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def summary_rows(demo: dict | None) -> list[dict]:
    """(figure, goal, measured, met) for every goal of the issue, from the scripts' JSON files."""
    rows = []

    def add(figure, goal, measured, met):
        rows.append({"figure": figure, "goal": goal, "measured": measured, "met": met})

    rvt = load("round_vs_trl") or {}
    for name, label in (("w", "gndpo round vs TRL GKD on W (CPU scale), wall time"), ("demo", "one demo round vs TRL GKD, wall time")):
        r = rvt.get(name)
        if r:
            goal = ">= 3x faster" if name == "w" else "faster than TRL"
            need = 3.0 if name == "w" else 1.0
            acc = f"; held-out acc gndpo {r['gndpo']['heldout_acc']}, TRL {r['trl']['heldout_acc']}" if r["gndpo"]["heldout_acc"] is not None else ""
            add(label, goal, f"{r['trl']['wall_s']:.1f} s / {r['gndpo']['wall_s']:.1f} s = {r['speedup']:.2f}x{acc}", r["speedup"] >= need)
    rs = load("rollout_speed")
    if rs:
        add("rollout tokens/s, vLLM vs HF generate on W", ">= 2x",
            f"{rs['vllm']['tokens_per_s']:.0f} / {rs['hf_generate']['tokens_per_s']:.0f} tok/s = {rs['ratio']:.2f}x", rs["ratio"] >= 2)
    fl = load("flops")
    if fl:
        for dtype in ("float32", "bfloat16"):
            f = fl[dtype]
            frac = min(f["score"]["fraction_of_peak"], f["train"]["fraction_of_peak"])
            add(f"score / train FLOP/s vs matmul peak ({dtype})", ">= 40%",
                f"{f['score']['fraction_of_peak']:.0%} / {f['train']['fraction_of_peak']:.0%} of {f['matmul_peak_gflops']:.0f} GFLOP/s", frac >= 0.4)
    ns = load("normalize_scale")
    if ns:
        by = {round(p["token_rows"], -6): p for p in ns["results"]}
        p100, p1b = by.get(100_000_000), by.get(1_000_000_000)
        if p100:
            g, n = p100["stage"], p100.get("numpy") or {}
            known = n.get("seconds") is not None
            speed, mem = p100.get("stage_vs_numpy_speed"), p100.get("stage_vs_numpy_memory")
            measured = f"{g['seconds']:.1f} s, {g['peak_rss_gib']:.2f} GiB"
            if known:
                measured += f"; {speed:.2f}x numpy's speed at {mem:.2f}x its memory"
            add("normalize, 100M token rows (moments + a quantile)", "<= 12 s, <= 1.5 GiB, >= 2x numpy at <= 1/3 its memory",
                measured, g["seconds"] <= 12 and g["peak_rss_gib"] <= 1.5 and known and speed >= 2 and mem <= 1 / 3)
        if p1b and p100:
            g = p1b["stage"]
            ratio = g["seconds"] / p100["stage"]["seconds"]
            add("normalize, 1B token rows", "<= 10x the 100M time, <= 4 GiB",
                f"{g['seconds']:.1f} s ({ratio:.1f}x), {g['peak_rss_gib']:.2f} GiB", ratio <= 10 and g["peak_rss_gib"] <= 4)
    sb = load("shard_bytes")
    if sb:
        for scheme, goal in (("sampled", 5), ("top16", 64)):
            f32, b16 = sb[f"{scheme}_float32"]["bytes_per_token"], sb[f"{scheme}_bfloat16"]["bytes_per_token"]
            add(f"score shard bytes/token, {scheme} ({sb['tokens_per_row']:.0f} tokens/response)", f"<= {goal} B",
                f"float32 {f32:.2f} B, bfloat16 {b16:.2f} B", min(f32, b16) <= goal)
    sc = load("scaling")
    if sc:
        pts = sc["points"]
        add("round time at 1x / 2x / 4x prompts (W)", "how cost grows",
            " / ".join(f"{p['wall_s']:.0f} s" for p in pts) + " (compute " + " / ".join(f"{p['compute_ratio']:.1f}x" for p in pts) + ")", None)
    tr = load("tool_rollout")
    if tr:
        b, o = tr["batched_per_turn"], tr["one_at_a_time"]
        add("multi-turn tool rollout, batched per turn vs one conversation at a time", "faster, the same conversations",
            f"{b['conversations_per_s']:.0f} / {o['conversations_per_s']:.0f} conversations/s = {tr['ratio']:.1f}x; "
            f"{tr['identical_conversations']} identical", tr["ratio"] > 1)
    sb2 = load("score_backend")
    if sb2:
        add("teacher scoring, score.backend vllm vs hf (W teacher, CPU)", "same numbers; speed measured",
            f"{sb2['vllm']['tokens_per_s']:.0f} / {sb2['hf']['tokens_per_s']:.0f} tok/s = {sb2['ratio']:.2f}x; "
            f"max abs diff {sb2['max_abs_diff']:.1e}", None)
    sm = load("smollm2") or {}
    r, tp = sm.get("round"), sm.get("throughput")
    if r:
        g, t = r["gndpo"], r["trl"]
        runs = [*sm.get("earlier_rounds", []), r]
        speedups = [e["speedup"] for e in runs]
        fastest = lambda side: min(e[side]["wall_s"] for e in runs)  # noqa: E731
        spread = (f"; last {len(runs)} runs {min(speedups):.2f}x to {max(speedups):.2f}x (fastest TRL {fastest('trl'):.0f} s, "
                  f"gndpo {fastest('gndpo'):.0f} s)") if len(runs) > 1 else ""
        other = [x["memory"].get("other_cores") for x in (g, t)]
        busy = f", other jobs busy on {other[0]:.1f} / {other[1]:.1f} of {g['memory']['machine_cores']} cores" if None not in other else ""
        add("SmolLM2-135M round vs TRL GKD (32 prompts x 2 x 24 tokens, 2 steps), wall time and peak memory", "measured",
            f"TRL {t['wall_s']:.0f} s / gndpo {g['wall_s']:.0f} s = {r['speedup']:.2f}x{busy}{spread}; peak PSS gndpo "
            f"{g['memory']['peak_tree_pss_gib']:.1f} GiB, TRL {t['memory']['peak_tree_pss_gib']:.1f} GiB", None)
    seeds = sm.get("round_seeds_shape")
    if seeds:
        g, t = seeds["gndpo"], seeds["trl"]
        w = seeds["workload"]
        # "setup s": 41.2 -> "setup 41 s"; what rounds to nothing is left out
        phases = "; ".join(f"{stage} " + ", ".join(f"{k.rsplit(' ', 1)[0]} {v:.0f} {k.rsplit(' ', 1)[1]}" for k, v in spent.items() if v >= 0.5)
                           for stage, spent in g.get("phases", {}).items() if stage != "normalize")
        add(f"SmolLM2-135M round vs TRL GKD, the seeds' shape ({w['count']} prompts behind a few-shot preamble x {w['n']} x "
            f"{w['max-new-tokens']} tokens, {w['steps']} steps), wall time and peak memory", ">= 1.2x TRL over one round",
            f"TRL {t['wall_s']:.0f} s / gndpo {g['wall_s']:.0f} s = {seeds['speedup']:.2f}x; peak PSS gndpo "
            f"{g['memory']['peak_tree_pss_gib']:.1f} GiB, TRL {t['memory']['peak_tree_pss_gib']:.1f} GiB; gndpo's phases: {phases}",
            seeds["speedup"] >= 1.2)
    if tp:
        s_, t_ = tp["score"], tp["train"]
        add("SmolLM2-135M score / train tokens/s vs plain transformers, same batches", "measured",
            f"score {s_['gndpo_stage']['tokens_per_s']:.0f} / {s_['plain']['tokens_per_s']:.0f} tok/s = {s_['stage_vs_plain']:.2f}x "
            f"(forward alone {s_['kernel_vs_plain']:.2f}x); train {t_['gndpo_stage']['tokens_per_s']:.0f} / "
            f"{t_['plain']['tokens_per_s']:.0f} tok/s = {t_['stage_vs_plain']:.2f}x (stage with its DeepSpeed set-up and export; forward + backward alone "
            f"{t_['kernel_vs_plain']:.2f}x)", None)
    if demo:
        add("`gndpo demo`, venv and toy models cached", "<= 90 s, the same table", f"{demo['seconds']:.0f} s; held-out acc {demo['heldout_acc']}",
            demo["seconds"] <= 90)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| figure | goal | measured | met |", "|---|---|---|---|"]
    for r in rows:
        met = {True: "yes", False: "no", None: "-"}[r["met"]]
        lines.append(f"| {r['figure']} | {r['goal']} | {r['measured']} | {met} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip", action="append", default=[], choices=list(STEPS))
    ap.add_argument("--only", action="append", default=[], choices=list(STEPS), help="run only these (the summary uses every JSON present)")
    a = ap.parse_args(argv)
    t0 = time.time()
    timings, demo = {}, load("demo_timing")
    for name, argv_ in STEPS.items():
        if name in a.skip or (a.only and name not in a.only):
            continue
        t = time.time()
        print(f"== {name}", flush=True)
        if argv_ is None:
            demo = time_demo(Path("/tmp/gndpo-bench/demo"))
            save_json(RESULTS / "demo_timing.json", demo)
        else:
            for command in argv_ if isinstance(argv_[0], list) else [argv_]:
                subprocess.run([sys.executable, str(HERE / command[0]), *command[1:]], check=True)
        timings[name] = round(time.time() - t, 1)
    rows = summary_rows(demo)
    if a.only or a.skip:  # a partial run: the other scripts' times are those of the run that made their JSON
        timings = {**(load("summary") or {}).get("script_seconds", {}), **timings}
    save_json(RESULTS / "summary.json", {"rows": rows, "script_seconds": timings, "total_seconds": round(sum(timings.values()), 1)})
    (RESULTS / "summary.md").write_text(markdown(rows))
    print(markdown(rows))
    print(f"run_all: {time.time() - t0:.0f} s ({timings})")


if __name__ == "__main__":
    main()
