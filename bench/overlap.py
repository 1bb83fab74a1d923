"""Overlapped rounds on this machine against what a user runs by default: the same rounds run by the
default `gndpo run` (sequential, every stage in one process on kept engines, every core), by one process
per stage and round (sequential, each pinned to its core: the bench's former baseline), and by workers
that stay for the whole run (score streamed; rollout one round ahead of train, run.max_staleness 1),
each stage pinned to its own cores as devices would be; each way ``--repeats`` times, interleaved. Then
the round model (:mod:`gndpo.apps.round_model`) fed with what the two sequential ways measured, its
prediction for the overlapped ways beside what they measured, and the model at the seeds' scale on one
8-GPU node (on paper); and what one round of staleness costs in accuracy on the demo.

``timing``: the toy addition task's models (the demo's assets) with the teacher behind vLLM's
OpenAI-compatible server (``score.backend server``, the student's column from the engine, so score
computes nothing itself), ``--rounds`` rounds of ``--prompts`` prompts x 8 samples; the server pinned to
core 1. ``GNDPO_STAGE_CPUS`` puts rollout on core 0 and score, normalize and train on core 1 beside the
server (:data:`PINNED`), or every stage on core 0, the server's core its own as a served teacher's GPUs
would be (:data:`STUDENT_CORE`); the default uses every core. Reported per way: wall seconds per round over the run and
in the steady state (from round 1's train commit to the last round's, per round), the speed against the
default's in the same repeat, each core's busy share (the union of its stages' spans, from first claim to
last commit) over the steady state, and where the workers waited (``wait_input_seconds``,
``wait_held_seconds``). The stage spans of the last repeat are kept for the docs' timeline figure.

The model's inputs, per stage, from rounds 1 on (round 0 starts the engines): its seconds on both cores
(the default's span) and on one (the pinned way's span, less its process's setup, plus the default's
kept-engine setup), whence the share of it that divides over cores.

``accuracy``: ``gndpo demo`` (3 rounds, sequential on both cores, as the demo runs) at run.max_staleness
0 and 1 for rollout seeds 0, 1 and 2; the held-out exact match of every round's sampling policy and of
the final student.

    .venv/bin/python bench/overlap.py timing [--rounds 4 --prompts 512 --repeats 2]
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
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, gndpo_cmd, machine, run_timed, save_json  # noqa: E402

from gndpo.apps.compare import method_row  # noqa: E402
from gndpo.apps.demo import DEFAULT_CONFIG, demo_config_data  # noqa: E402
from gndpo.apps.demos.arithmetic import ensure_toy_assets  # noqa: E402
from gndpo.apps.round_model import AHEAD, SEQUENTIAL, STREAMED, Machine, RoundCosts, StageCost, predict  # noqa: E402
from gndpo.pipeline.exec.status import stage_span  # noqa: E402
from gndpo.pipeline.observe.metrics import committed_rounds  # noqa: E402
from gndpo.pipeline.run.products import POLICY  # noqa: E402
from gndpo.pipeline.run.run import open_run  # noqa: E402
from gndpo.stages.registry import STAGE_REGISTRY, job_class  # noqa: E402

STAGES = tuple(STAGE_REGISTRY)

OUT = RESULTS / "overlap.json"
FIGURE = HERE.parent / "docs" / "benchmarks" / "figures" / "overlap_timeline.png"
PROMPTS_PER_UNIT = 64  # the rollout units score streams by
PINNED = "rollout=0 score=1 normalize=1 train=1"  # each stage on its own core, the learner's beside the teacher server
STUDENT_CORE = "rollout=0 score=0 normalize=0 train=0"  # the teacher server's core its own, as its GPUs would be


@dataclass(frozen=True)
class Way:
    """How one timed run goes: its run settings; ``how`` `gndpo run` runs it ("kept": the default, every
    stage in one process on kept engines and every core; "processes": a process per stage and round,
    --no-keep-alive; "workers": a worker per stage that stays for the whole run); ``pins``: the
    GNDPO_STAGE_CPUS its stages run under (none: every core)."""

    settings: dict
    how: str
    pins: str = ""

    def cores(self) -> dict[str, tuple[str, ...]]:
        """{core: the stages that compute on it}: each pinned stage's core, the teacher server's core
        (1) also busy while score runs; unpinned, as :data:`PINNED`."""
        spec = dict(entry.split("=") for entry in (self.pins or PINNED).split())
        return {f"core {c}": tuple(stage for stage in STAGES if spec[stage] == c or (c == "1" and stage == "score")) for c in ("0", "1")}


SEQUENTIAL_RUN, STREAMED_RUN, AHEAD_RUN = ({"run": {"overlap": "off", "max_staleness": 0}}, {"run": {"overlap": "on", "max_staleness": 0}},
                                           {"run": {"overlap": "on", "max_staleness": 1}})
DEFAULT, PINNED_WAY = "default (engines kept, every core)", "sequential, a process per stage and round"
WAYS = {  # the first is the baseline of the ratios
    DEFAULT: Way(SEQUENTIAL_RUN, "kept"),
    PINNED_WAY: Way(SEQUENTIAL_RUN, "processes", PINNED),
    "score streamed, workers that stay": Way(STREAMED_RUN, "workers", PINNED),
    "staleness 1, workers that stay": Way(AHEAD_RUN, "workers", PINNED),
    "score streamed, workers that stay, the teacher's core its own": Way(STREAMED_RUN, "workers", STUDENT_CORE),
    "staleness 1, workers that stay, the teacher's core its own": Way(AHEAD_RUN, "workers", STUDENT_CORE),
}


def load() -> dict:
    return json.loads(OUT.read_text()) if OUT.exists() else {}


def stage_spans(run_dir: Path) -> list[dict]:
    """Every committed stage's (round, stage, start, end, setup): `gndpo status`'s span, first claim to
    last commit, and the seconds its units spent in the executor's ``setup`` phase (engines, models)."""
    run = open_run(str(run_dir))
    spans = []
    for r in range(committed_rounds(run)):
        for stage in STAGES:
            rec = run.records(r, stage)
            manifest = rec.manifest()
            if manifest is not None:
                start, end = stage_span(rec, [c.unit for c in manifest.units], manifest.units, finished=True, now=time.time())
                setup = sum(c.numbers.phases.get("setup", {}).get("seconds", 0.0) for c in manifest.units)
                spans.append({"round": r, "stage": stage, "start": start, "end": end, "setup": round(setup, 2)})
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
    cfg["rollout"].update({"prompts_per_round": prompts, "prompts_per_unit": PROMPTS_PER_UNIT, "eval_heldout": False})
    cfg["score"] = {**cfg.get("score", {}), "backend": "server", "servers": [server_url], "server_model": "teacher", "student_logprobs": "engine"}
    cfg["train"].update({"optimizer_steps": 16})
    cfg["engine"]["in_process"] = True
    for section, values in settings.items():
        cfg.setdefault(section, {}).update(values)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def timing(rounds: int, prompts: int, repeats: int) -> dict:
    from gndpo.tests.teacher_servers import VllmServer  # the server the suite starts

    assets = ensure_toy_assets()
    runs: dict[str, list[dict]] = {name: [] for name in WAYS}
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
            for repeat in range(repeats):  # interleaved, so that a slow spell of the machine falls on every way
                for name, way in WAYS.items():
                    folder = tmp / f"{repeat}-{name.replace(' ', '-').replace(',', '').replace(chr(39), '')}"
                    folder.mkdir()
                    runs[name].append(timed_way(folder, timing_config(assets, folder, server.url, prompts, way.settings), way, rounds))
                    print(f"repeat {repeat}, {name}: {runs[name][-1]['seconds']:.1f} s for {rounds} rounds, "
                          f"{runs[name][-1]['steady_seconds_per_round']:.1f} s a round in the steady state", flush=True)
        finally:
            server.kill()
    ways = {name: summary(rows, runs[DEFAULT]) for name, rows in runs.items()}
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "rounds": rounds, "prompts_per_round": prompts, "n": 8,
            "repeats": repeats, "ways": ways, "model": modelled(runs, units=-(-prompts // PROMPTS_PER_UNIT))}


def summary(rows: list[dict], defaults: list[dict]) -> dict:
    """One way's repeats: each figure's mean and range, the speed against the default's in the same
    repeat, and the last repeat's spans (the figure's)."""
    def spread(key, of=rows):
        values = [row[key] for row in of]
        return {"mean": round(statistics.mean(values), 2), "min": round(min(values), 2), "max": round(max(values), 2)}

    speeds = [{"speed": d["steady_seconds_per_round"] / row["steady_seconds_per_round"],
               "speed_run": d["seconds"] / row["seconds"]} for row, d in zip(rows, defaults)]
    return {"seconds_per_round": spread("seconds_per_round"), "steady_seconds_per_round": spread("steady_seconds_per_round"),
            "speed": spread("speed", speeds), "speed_run": spread("speed_run", speeds),
            "busy": {core: round(statistics.mean(row["busy"][core] for row in rows), 3) for core in rows[0]["busy"]},
            "waits": {k: round(statistics.mean(sum(w[k] for w in row["waits"].values()) for row in rows), 1)
                      for k in ("wait_input_seconds", "wait_held_seconds")},
            "runs": [{k: v for k, v in row.items() if k != "spans"} for row in rows], "spans": rows[-1]["spans"]}


def timed_way(folder: Path, config: Path, way: Way, rounds: int) -> dict:
    """`gndpo run` of a new run from ``config``, as ``way`` says: seconds (the whole run,
    and per round in the steady state), each core's busy share in it, the stage spans and where the
    workers waited."""
    run_timed(gndpo_cmd("init", str(folder / "run"), "--config", str(config)), folder / "init.log")
    env_before = os.environ.get("GNDPO_STAGE_CPUS")
    if way.pins:
        os.environ["GNDPO_STAGE_CPUS"] = way.pins
    try:
        t0 = time.time()
        seconds, _ = run_timed(gndpo_cmd("run", str(folder / "run"), "--rounds", str(rounds), *(["--no-keep-alive"] if way.how == "processes" else [])),
                               folder / "run.log")
    finally:
        os.environ.pop("GNDPO_STAGE_CPUS", None) if env_before is None else os.environ.__setitem__("GNDPO_STAGE_CPUS", env_before)
    spans = stage_spans(folder / "run")
    opened = open_run(str(folder / "run"))
    waits = {stage: {k: round(sum(m.metrics.get(k, 0.0) for m in manifests), 1) for k in ("wait_input_seconds", "wait_held_seconds")}
             for stage in STAGES for manifests in [[opened.records(r, stage).require_manifest() for r in range(rounds)]]}
    trained = sorted(s["end"] for s in spans if s["stage"] == POLICY.stage)
    # From round 1's train commit to the last round's: round 1 is the first whose rollout could run beside
    # an earlier round's stages, so from there on each order repeats the same pattern every round.
    steady = (trained[1], trained[-1])
    return {
        "seconds": round(seconds, 1), "seconds_per_round": round(seconds / rounds, 2),
        "steady_seconds_per_round": round((steady[1] - steady[0]) / (rounds - 2), 2),
        "busy": {core: round(busy_fraction(spans, stages, *steady), 3) for core, stages in way.cores().items()},
        "spans": [{**s, "start": round(s["start"] - t0, 2), "end": round(s["end"] - t0, 2)} for s in spans],
        "waits": waits,
    }


def modelled(runs: dict[str, list[dict]], units: int) -> dict:
    """The round model fed with the sequential ways' stage times (rounds 1 on; :data:`__doc__`), its
    prediction for each way (:func:`predictions`), and what each measured in the steady state."""
    def mean_over(rows, stage, figure):
        return statistics.mean(figure(s) for row in rows for s in row["spans"] if s["stage"] == stage and s["round"] >= 1)

    inputs = {}
    for stage in STAGES:
        both = mean_over(runs[DEFAULT], stage, lambda s: s["end"] - s["start"])
        kept_setup = mean_over(runs[DEFAULT], stage, lambda s: s["setup"])
        one = mean_over(runs[PINNED_WAY], stage, lambda s: s["end"] - s["start"] - s["setup"]) + kept_setup
        inputs[stage] = {"two_cores_s": round(both, 2), "one_core_s": round(one, 2)}
    measured = {name: round(statistics.mean(r["steady_seconds_per_round"] for r in runs[name]), 2) for name in WAYS}
    return {"inputs": inputs, "units": units, "measured": measured, "rows": predictions(inputs, units, measured)}


def predictions(inputs: dict, units: int, measured: dict) -> list[dict]:
    """Each timed way's predicted seconds a round beside its ``measured`` ones. Pinned as :data:`PINNED`,
    the machine is 2 cores split 1 and 1, score a learner stage (its server shares the learner's core),
    each stage's share that divides over cores from its seconds on one core and on both. As
    :data:`STUDENT_CORE`, the student's stages share core 0 at their one-core seconds and score runs on
    the server's core, its own: its seconds are the default's, where the server had core 1 to itself too
    (the pinned way's put score's own process beside the server)."""
    split, own = {}, {}
    for stage, x in inputs.items():
        parallel = min(max(x["one_core_s"] / x["two_cores_s"] - 1, 0.0), 1.0)  # on 1 of 2 cores: both * (1 + parallel)
        x["parallel"] = round(parallel, 2)
        split[stage] = StageCost(x["two_cores_s"], parallel)
        streams = job_class(stage).streams()
        own[stage] = StageCost(x["two_cores_s"] if streams else x["one_core_s"], own_devices=streams)
    times = {PINNED: predict(RoundCosts(split, units, "measured"), Machine(2, 1), ahead=1),
             STUDENT_CORE: predict(RoundCosts(own, units, "measured"), Machine(1, 1), ahead=1)}
    rows = []
    for name, way in WAYS.items():
        if way.how == "processes":
            continue  # an input of the model
        order = SEQUENTIAL if way.how == "kept" else AHEAD if way.settings["run"]["max_staleness"] else STREAMED
        predicted = times[way.pins or PINNED][order]
        rows.append({"way": name, "predicted_s": round(predicted, 2), "measured_s": measured[name],
                     "error": round(predicted / measured[name] - 1, 3)})
    return rows


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


# The seeds' scale on one 8-GPU node: an 8B teacher, a 1B student, 8,192 prompts x 16 samples x up to
# 2,048 tokens; minutes per stage one at a time, the teacher served on 2 GPUs of its own and the
# student's stages on the other 6, each scaling perfectly over GPUs (on paper).
PAPER = RoundCosts({"rollout": StageCost(28.0), "score": StageCost(11.0, own_devices=True), "normalize": StageCost(0.2), "train": StageCost(8.0)},
                   128, "the seeds' minutes, on paper")
PAPER_MACHINES = {"the student's 6 GPUs shared": Machine(6, 6), "rollout on 4, score and train on 2": Machine(6, 4),
                  "rollout on 5, score and train on 1": Machine(6, 5)}


def paper_model() -> list[dict]:
    """Minutes per round of each order on each split of the student's GPUs (:data:`PAPER`)."""
    rows = []
    for split, devices in PAPER_MACHINES.items():
        times = predict(PAPER, devices, ahead=1)
        rows += [{"devices": split, "order": order, "minutes": round(m, 1), "ratio": round(times[SEQUENTIAL] / m, 2)}
                 for order, m in times.items()]
    return rows


def markdown(data: dict) -> str:
    out = []
    t = data.get("timing")
    if t and "model" in t:
        rng = lambda f, unit="": f"{f['mean']}{unit} ({f['min']}-{f['max']})"  # noqa: E731
        out += [f"### Round time, each order ({t['machine']}, {t['date']})", "",
                f"{t['rounds']} rounds of {t['prompts_per_round']} prompts x {t['n']} samples of the toy addition task, teacher served "
                f"by vLLM's server pinned to core 1. The default uses both cores; the other ways are pinned with "
                f"`GNDPO_STAGE_CPUS=\"{PINNED}\"` (rollout on core 0, the learner's stages beside the server), or, where the teacher's "
                f"core is its own, `\"{STUDENT_CORE}\"` (as a served teacher's GPUs would be). Each way {t['repeats']} times, "
                "interleaved: mean (range). The steady state runs from round 1's train commit to the last round's; the whole run "
                "includes starting the engines and workers. Speed is the default's seconds over the way's in the same repeat (above 1 "
                "is faster); busy is each core's share of the steady state with one of its stages running (core 1: also while score "
                "waits on the server); the waits are the stages' `wait_input_seconds` and `wait_held_seconds`, summed over rounds and "
                "stages.", "",
                "| order | s per round, whole run | s per round, steady state | speed, steady state | speed, whole run "
                "| busy: core 0 | busy: core 1 (teacher server) | waited for input, s | held, s |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, row in t["ways"].items():
            out.append(f"| {name} | {rng(row['seconds_per_round'])} | {rng(row['steady_seconds_per_round'])} | {rng(row['speed'])} | "
                       f"{rng(row['speed_run'])} | " + " | ".join(f"{row['busy'][c]:.2f}" for c in ("core 0", "core 1"))
                       + f" | {row['waits']['wait_input_seconds']:.1f} | {row['waits']['wait_held_seconds']:.1f} |")
        m = t["model"]
        out += ["", "The round model's inputs (per stage, rounds 1 on): seconds on both cores (the default's), on one core (the pinned "
                "way's, less its process's setup, plus the default's kept-engine setup), and the share that divides over cores:", "",
                "| stage | both cores, s | one core, s | parallel share |", "|---|---:|---:|---:|"]
        out += [f"| {stage} | {x['two_cores_s']} | {x['one_core_s']} | {x['parallel']} |" for stage, x in m["inputs"].items()]
        out += ["", "| order | predicted s per round (steady state) | measured | error |", "|---|---:|---:|---:|"]
        out += [f"| {r['way']} | {r['predicted_s']} | {r['measured_s']} | {r['error']:+.1%} |" for r in m["rows"]]
        out += ["", "Where the teacher's core is its own, the model takes score's seconds from the default's runs, in which the "
                "server had core 1 to itself as well; fed instead the pinned way's (score's own process beside the server on "
                "core 1), it predicted those two rows 35% and 31% too slow.", ""]
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
            "The round model with the seeds' minutes per stage one at a time: rollout 28, score 11, normalize 0.2, train 8 (an 8B "
            "teacher served on 2 GPUs of its own, a 1B student on the other 6; 8,192 prompts x 16 samples x up to 2,048 tokens; "
            "128 score units), each stage scaling perfectly over GPUs. On paper: nothing here was run. `run.overlap: auto` takes "
            "score streamed on the shared GPUs (rollout ahead would hold the engine and the trainer on the same GPUs at once), "
            "and rollout ahead only with a learner split, where it pays here with 4 and 2 GPUs and not with 5 and 1.", "",
            "| the student's GPUs | order | minutes per round | speed |", "|---|---|---:|---:|"]
    out += [f"| {row['devices']} | {row['order']} | {row['minutes']} | {row['ratio']} |" for row in paper_model()]
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
        ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
        ax.set_title(f"{name}: {row['steady_seconds_per_round']['mean']} s per round in the steady state", fontsize=9, loc="left")
    axes[-1].set_xlabel("seconds since the run started")
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=("timing", "accuracy", "figure", "table"))
    ap.add_argument("--rounds", type=int, default=4, help="at least 3: the steady state starts at round 1's train commit")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    data = load()
    if a.part == "timing":
        data["timing"] = timing(a.rounds, a.prompts, a.repeats)
    elif a.part == "accuracy":  # "figure" and "table" redraw and rewrite from what is saved
        data["accuracy"] = accuracy()
    elif a.part == "table" and data.get("timing", {}).get("model"):  # the model's predictions again, from the saved inputs
        model = data["timing"]["model"]
        measured = model.get("measured") or {row["way"]: row["measured_s"] for row in model["rows"]}
        units = model.setdefault("units", -(-data["timing"]["prompts_per_round"] // PROMPTS_PER_UNIT))
        model.update(measured=measured, rows=predictions(model["inputs"], units, measured))
    save_json(OUT, data)
    if data.get("timing", {}).get("model"):
        figure(data)
    (RESULTS / "overlap.md").write_text(markdown(data))


if __name__ == "__main__":
    main()
