"""Overlapped rounds on this machine against what a user runs by default: the same rounds run by the
default `gndpo run` (sequential, every stage in one process on kept engines, every core), one process
per stage and round (sequential and score-streamed), and workers that stay for the whole run (score
streamed; rollout one round ahead of train, run.max_staleness 1), the last three with each stage pinned
to its own cores as devices would be; then what one round of staleness costs in accuracy on the demo.

``timing``: the toy addition task's models (the demo's assets) with the teacher behind vLLM's
OpenAI-compatible server (``score.backend server``, the student's column from the engine, so score
computes nothing itself), ``--rounds`` rounds of ``--prompts`` prompts x 8 samples. ``GNDPO_STAGE_CPUS``
puts rollout on core 0 and score, normalize and train on core 1 (but for the default, which uses every
core), where the teacher server is pinned too. Reported: wall seconds per round, the speed against the
default in the same run, each core's busy fraction (the union of its stages' spans, from first claim to
last commit, over the run's wall time) and where the workers waited (``wait_input_seconds``,
``wait_held_seconds``). The stage spans of each run are kept for the docs' timeline figure (``--figure``).

``accuracy``: ``gndpo demo`` (3 rounds, sequential on both cores, as the demo runs) at run.max_staleness
0 and 1 for rollout seeds 0, 1 and 2; the held-out exact match of every round's sampling policy and of
the final student.

    .venv/bin/python bench/overlap.py timing [--rounds 3 --prompts 512]
    .venv/bin/python bench/overlap.py accuracy
    .venv/bin/python bench/overlap.py figure      # docs/benchmarks/figures/overlap_timeline.png from the saved spans

Writes results/overlap.json and results/overlap.md (the tables docs/benchmarks/speed.md includes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, gndpo_cmd, machine, run_timed, save_json  # noqa: E402

from gndpo.apps.compare import method_row  # noqa: E402
from gndpo.apps.demo import DEFAULT_CONFIG, demo_config_data  # noqa: E402
from gndpo.apps.demos.arithmetic import ensure_toy_assets  # noqa: E402
from gndpo.pipeline.exec.status import stage_rows, stage_span  # noqa: E402
from gndpo.pipeline.observe.metrics import committed_rounds  # noqa: E402
from gndpo.pipeline.run.run import open_run  # noqa: E402
from gndpo.stages.registry import STAGE_REGISTRY  # noqa: E402

STAGES = tuple(STAGE_REGISTRY)

OUT = RESULTS / "overlap.json"
FIGURE = HERE.parent / "docs" / "benchmarks" / "figures" / "overlap_timeline.png"
PINNED = "rollout=0 score=1 normalize=1 train=1"
CORES = {"core 0 (rollout)": ("rollout",), "core 1 (score, normalize, train; teacher server)": ("score", "normalize", "train")}
# name -> (run settings, how `gndpo run` runs it: "kept" the default, every stage in one process on kept
# engines and every core; "processes" a process per stage and round (--no-keep-alive), pinned; "workers"
# a worker per stage that stays for the whole run, pinned). The first is the baseline of the ratios.
WAYS = {
    "default (engines kept, every core)": ({"run": {"overlap": "off", "max_staleness": 0}}, "kept"),
    "sequential, a process per stage and round": ({"run": {"overlap": "off", "max_staleness": 0}}, "processes"),
    "score streamed, a process per stage and round": ({"run": {"overlap": "on", "max_staleness": 0}}, "processes"),
    "score streamed, workers that stay": ({"run": {"overlap": "on", "max_staleness": 0}}, "workers"),
    "staleness 1, workers that stay": ({"run": {"overlap": "on", "max_staleness": 1}}, "workers"),
}


def load() -> dict:
    return json.loads(OUT.read_text()) if OUT.exists() else {}


def stage_spans(run_dir: Path) -> list[dict]:
    """Every committed stage's (round, stage, start, end): `gndpo status`'s span, first claim to last commit."""
    run = open_run(str(run_dir))
    spans = []
    for r in range(committed_rounds(run)):
        for stage in STAGES:
            rec = run.records(r, stage)
            manifest = rec.manifest()
            if manifest is not None:
                start, end = stage_span(rec, [c.unit for c in manifest.units], manifest.units, finished=True, now=time.time())
                spans.append({"round": r, "stage": stage, "start": start, "end": end})
    return spans


def busy_fraction(spans: list[dict], stages: tuple[str, ...], start: float, end: float) -> float:
    """The share of [start, end] during which at least one of ``stages`` ran (their spans' union)."""
    intervals = sorted((s["start"], s["end"]) for s in spans if s["stage"] in stages)
    busy, reach = 0.0, start
    for a, b in intervals:
        a, b = max(a, reach), min(b, end)
        if b > a:
            busy += b - a
            reach = b
    return busy / (end - start)


def timing_config(assets: Path, folder: Path, server_url: str, prompts: int, settings: dict) -> Path:
    import yaml

    cfg = demo_config_data(assets, DEFAULT_CONFIG)
    cfg["rollout"].update({"prompts_per_round": prompts, "prompts_per_unit": 64, "eval_heldout": False})
    cfg["score"] = {**cfg.get("score", {}), "backend": "server", "servers": [server_url], "server_model": "teacher", "student_logprobs": "engine"}
    cfg["train"].update({"optimizer_steps": 16})
    cfg["engine"]["in_process"] = True
    for section, values in settings.items():
        cfg.setdefault(section, {}).update(values)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def timing(rounds: int, prompts: int) -> dict:
    from gndpo.tests.teacher_servers import VllmServer  # the server the suite starts

    assets = ensure_toy_assets()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # The server (and every thread it starts) on core 1: the affinity a child inherits at its start.
        everything = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {1})
        try:
            server = VllmServer.start(assets / "teacher", "teacher", tmp / "server.log", max_model_len=32, threads=1)
        finally:
            os.sched_setaffinity(0, everything)
        try:
            server.wait_ready()
            for name, (settings, how) in WAYS.items():
                folder = tmp / name.replace(" ", "-").replace(",", "")
                folder.mkdir()
                results[name] = timed_way(folder, timing_config(assets, folder, server.url, prompts, settings), how, rounds)
                print(f"{name}: {results[name]['seconds']:.1f} s for {rounds} rounds", flush=True)
        finally:
            server.kill()
    base = next(iter(results.values()))["seconds"]
    for row in results.values():
        row["ratio_to_default"] = round(base / row["seconds"], 3)
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "rounds": rounds, "prompts_per_round": prompts, "n": 8,
            "pinning": PINNED, "ways": results}


def timed_way(folder: Path, config: Path, how: str, rounds: int) -> dict:
    """`gndpo run` of a new run from ``config``, as ``how`` says (:data:`WAYS`): seconds, each core's busy
    share, the stage spans and where the workers waited."""
    run_timed(gndpo_cmd("init", str(folder / "run"), "--config", str(config)), folder / "init.log")
    env_before = os.environ.get("GNDPO_STAGE_CPUS")
    if how != "kept":
        os.environ["GNDPO_STAGE_CPUS"] = PINNED
    try:
        t0 = time.time()
        seconds, _ = run_timed(gndpo_cmd("run", str(folder / "run"), "--rounds", str(rounds), *(["--no-keep-alive"] if how == "processes" else [])),
                               folder / "run.log")
        t1 = time.time()
    finally:
        os.environ.pop("GNDPO_STAGE_CPUS", None) if env_before is None else os.environ.__setitem__("GNDPO_STAGE_CPUS", env_before)
    spans = stage_spans(folder / "run")
    opened = open_run(str(folder / "run"))
    beside = sorted({row["beside"] for row in stage_rows(opened) if row["beside"]})
    waits = {stage: {k: round(sum(m.metrics.get(k, 0.0) for m in manifests), 1) for k in ("wait_input_seconds", "wait_held_seconds")}
             for stage in STAGES for manifests in [[opened.records(r, stage).require_manifest() for r in range(rounds)]]}
    return {
        "seconds": round(seconds, 1), "seconds_per_round": round(seconds / rounds, 1),
        "busy": {core: round(busy_fraction(spans, stages, t0, t1), 3) for core, stages in CORES.items()},
        "spans": [{**s, "start": round(s["start"] - t0, 2), "end": round(s["end"] - t0, 2)} for s in spans],
        "overlapped_stages": len(beside) > 0, "waits": waits,
    }


def accuracy(seeds: tuple[int, ...] = (0, 1, 2)) -> dict:
    runs = []
    for staleness in (0, 1):
        for seed in seeds:
            with tempfile.TemporaryDirectory() as tmp:
                folder = Path(tmp) / "demo"
                argv = gndpo_cmd("-q", "demo", str(folder), "--set", f"run.max_staleness={staleness}", "--set", f"rollout.seed={seed}")
                seconds, _ = run_timed(argv, Path(tmp) / "demo.log")
                final = json.loads((folder / "eval" / "summary.json").read_text())["pass@1"]
                row, _ = method_row(f"staleness {staleness}", str(folder / "run"), final)
            accs = [row[f"acc_r{r}"] for r in range(4)]
            runs.append({"staleness": staleness, "seed": seed, "accuracy": accs, "seconds": round(seconds, 1)})
            print(f"staleness {staleness} seed {seed}: {accs} in {seconds:.0f} s", flush=True)
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "runs": runs}


# The seeds' scale on one 8-GPU node (the issue's figures: an 8B teacher, a 1B student, 8,192 prompts x
# 16 samples x up to 2,048 tokens): minutes per stage, sequentially.
PAPER = {"rollout": 28.0, "score": 11.0, "normalize": 0.2, "train": 8.0, "units": 128}


def paper_model() -> list[dict]:
    """Minutes per round in each order, from :data:`PAPER`: sequential adds the stages; streamed, score
    finishes one unit after rollout (a served teacher on its own devices); staleness 1 in the steady
    state is the longer of rollout and the learner's chain (the last score unit, normalize, train) where
    train runs beside rollout on devices of its own."""
    r, s, n, t, u = (PAPER[k] for k in ("rollout", "score", "normalize", "train", "units"))
    sequential = r + s + n + t
    streamed = r + s / u + n + t
    stale = max(r, s / u + n + t)
    return [{"order": name, "minutes": round(m, 1), "ratio": round(m / sequential, 2)}
            for name, m in (("sequential", sequential), ("score streamed", streamed), ("staleness 1", stale))]


def markdown(data: dict) -> str:
    out = []
    t = data.get("timing")
    if t:
        ratio = "ratio_to_default" if "ratio_to_default" in next(iter(t["ways"].values())) else "ratio_to_sequential"
        out += [f"### Round time, each order ({t['machine']}, {t['date']})", "",
                f"{t['rounds']} rounds of {t['prompts_per_round']} prompts x {t['n']} samples of the toy addition task, teacher served "
                f"by vLLM's server on core 1; every order but the default (which uses both cores) pinned with "
                f"`GNDPO_STAGE_CPUS=\"{t['pinning']}\"`. Speed: the first row's seconds over the order's (above 1 is faster); "
                "the waits are the stages' `wait_input_seconds` and `wait_held_seconds`, summed over the rounds and stages.", "",
                f"| order | s per round | speed ({ratio.replace('_', ' ')}) | " + " | ".join(f"busy: {c}" for c in CORES)
                + " | waited for input, s | held, s |", "|---|---:|---:|" + "---:|" * len(CORES) + "---:|---:|"]
        for name, row in t["ways"].items():
            waits = row.get("waits", {})
            waited = sum(w["wait_input_seconds"] for w in waits.values())
            held = sum(w["wait_held_seconds"] for w in waits.values())
            out.append(f"| {name} | {row['seconds_per_round']} | {row[ratio]} | " + " | ".join(f"{row['busy'][c]:.2f}" for c in CORES)
                       + f" | {waited:.1f} | {held:.1f} |")
        out.append("")
    a = data.get("accuracy")
    if a:
        out += [f"### Held-out accuracy at staleness 0 and 1 ({a['machine']}, {a['date']})", "",
                "The demo (3 rounds, sequential), rollout seeds 0-2; `r0` is the initial student, `r1`-`r2` each round's sampling "
                "policy's greedy exact match, `final` the student after round 3.", "",
                "| staleness | seed | r0 | r1 | r2 | final | s |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for run in a["runs"]:
            acc = run["accuracy"]
            out.append(f"| {run['staleness']} | {run['seed']} | " + " | ".join(f"{x:.3f}" for x in acc[:3]) + f" | {acc[3]:.3f} | {run['seconds']:.0f} |")
        for staleness in (0, 1):
            finals = [run["accuracy"][3] for run in a["runs"] if run["staleness"] == staleness]
            out.append(f"| {staleness} | mean | | | | {statistics.mean(finals):.3f} | |")
        out.append("")
    out += ["### The seeds' scale on paper (one 8-GPU node)", "",
            "Minutes per stage in sequence: rollout 28, score 11, normalize 0.2, train 8 (an 8B teacher, a 1B student, "
            "8,192 prompts x 16 samples x up to 2,048 tokens), 128 score units.", "",
            "| order | minutes per round | ratio |", "|---|---:|---:|"]
    out += [f"| {row['order']} | {row['minutes']} | {row['ratio']} |" for row in paper_model()]
    return "\n".join(out) + "\n"


def figure(data: dict) -> None:
    """The docs' timeline: each stage's span per round, in the three orders (one panel each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ways = data["timing"]["ways"]
    colors = {"rollout": "#4c72b0", "score": "#dd8452", "normalize": "#55a868", "train": "#c44e52"}
    fig, axes = plt.subplots(len(ways), 1, figsize=(9, 2.0 * len(ways) + 0.6), sharex=True)
    for ax, (name, row) in zip(axes, ways.items()):
        lanes = list(reversed(STAGES))  # rollout on top
        for span in row["spans"]:
            lane = lanes.index(span["stage"])
            ax.barh(lane, span["end"] - span["start"], left=span["start"], color=colors[span["stage"]], edgecolor="white", height=0.8)
            if span["end"] - span["start"] > 3:
                ax.text((span["start"] + span["end"]) / 2, lane, f"r{span['round']}", ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(lanes)), [f"{stage} (core {0 if stage == 'rollout' else 1})" for stage in lanes], fontsize=8)
        ax.set_title(f"{name}: {row['seconds_per_round']} s per round", fontsize=9, loc="left")
    axes[-1].set_xlabel("seconds since the run started")
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=("timing", "accuracy", "figure", "table"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=512)
    a = ap.parse_args(argv)
    data = load()
    if a.part == "timing":
        data["timing"] = timing(a.rounds, a.prompts)
    elif a.part == "accuracy":  # "figure" and "table" redraw and rewrite from what is saved
        data["accuracy"] = accuracy()
    save_json(OUT, data)
    if data.get("timing"):
        figure(data)
    (RESULTS / "overlap.md").write_text(markdown(data))


if __name__ == "__main__":
    main()
