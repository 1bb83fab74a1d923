"""Score, normalize and train on a GPU at realistic shapes, for a GPU machine that has no vLLM.

The GPU machines this project is sometimes lent have CUDA torch, transformers and nvcc but no vLLM and no
network, so :mod:`bench.gpu_round`'s rollout cannot run there. This bench splits the round:

* ``prepare`` (here, with the CPU vLLM): build the realistic pair (:mod:`tests.realistic`: Llama, a
  151,936-wide vocabulary, random weights), ``gndpo init`` and round 0's rollout, then pack the run
  folder (not the models) into ``--pack`` with a digest of every weight tensor and of the tokenizer;
* ``run`` (on the GPU): rebuild the pair from the same specs at the same absolute path, check that its
  tensors and tokenizer have the digests of the ones that sampled the rollout (the build is seeded and
  runs on the CPU, so they must), unpack the run, then run ``score``, ``normalize`` and ``train`` of
  round 0 as their own processes (``python -m gndpo.cli STAGE RUN --round 0``; ``model.dtype: auto`` =
  bf16 on the GPU, ZeRO-2), sampling the GPU's memory every 0.2 s.

Writes the GPU, the shapes, and per stage its wall time (process start to exit), peak GPU memory and the
stage's manifest metrics (score's include how far its bf16 student log-probs are from the fp32 ones the
CPU rollout sampled with) to ``--results``.

    .venv/bin/python bench/gpu_stages.py prepare --pack .gpu/run.tar.gz      # here: ~2 min on 2 cores
    .venv/bin/python bench/gpu_stages.py prepare --vision --pack .gpu/vision.tar.gz   # a VLM round instead
    python3 bench/gpu_stages.py run --pack .gpu/run.tar.gz --results $OUT/gpu_stages.json   # on the GPU
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tarfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_round import (  # noqa: E402
    MemorySampler,
    add_shape_args,
    build_assets,
    fail,
    gndpo,
    gpu_query,
    have_gpu,
    shapes,
    version,
    write_config,
    write_results,
)

WORK = Path("/tmp/gndpo-gpu-stages")  # the same absolute path on both machines: the run's config names it
STAGES = ("score", "normalize", "train")
RESULTS = Path(__file__).resolve().parent / "results" / "gpu_stages.json"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["prepare", "run"])
    ap.add_argument("--pack", required=True, help="the packed run folder and digests (prepare writes it, run reads it)")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--timing-only", action="store_true",
                    help="go on when the rebuilt pair differs from the one that sampled the rollout (another torch "
                         "draws other random weights): the stages' times and memory still hold, their log-prob gaps do not")
    ap.add_argument("--vision", action="store_true",
                    help="a vision-language round: the random Idefics3 pair (gndpo.apps.demos.vision) on bar-chart prompts")
    add_shape_args(ap)
    args = ap.parse_args(argv)
    args.dry_init = False
    return args


def digests(assets: Path) -> dict[str, str]:
    """sha256 of every weight tensor's bytes (file layout and metadata aside) and of each tokenizer.json."""
    import torch
    from safetensors import safe_open

    out = {}
    for role in ("student", "teacher"):
        out[f"{role}/tokenizer.json"] = hashlib.sha256((assets / role / "tokenizer.json").read_bytes()).hexdigest()
        h = hashlib.sha256()
        for file in sorted((assets / role).glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                for name in sorted(f.keys()):
                    h.update(name.encode())
                    h.update(f.get_tensor(name).contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
        out[f"{role}/weights"] = h.hexdigest()
    return out


def vision_assets(folder: Path, prompts: int) -> Path:
    """The random Idefics3 pair and ``prompts`` bar-chart prompts (the vision demo's task)."""
    import random

    from gndpo.apps.demos.vision import build_random_vision_pair, task_rows

    build_random_vision_pair(folder)
    rows = task_rows(random.Random(0), prompts, folder, "p-", set())
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def prepare(args) -> None:
    if WORK.exists():
        shutil.rmtree(WORK)
    (WORK / "logs").mkdir(parents=True)
    if args.vision:
        assets = vision_assets(WORK / "assets", args.prompts)
        args.max_model_len, args.max_tokens = 256, min(args.max_tokens, 64)
    else:
        student, teacher = shapes(args)
        assets = build_assets(WORK / "assets", student, teacher, args.prompts)
    config = write_config(WORK / "config.yaml", assets, args)
    run = WORK / "run"
    for argv in (("init", run, "--config", config, *args.set), ("rollout", run, "--round", 0)):
        t0 = time.time()
        proc = gndpo(*argv, log=WORK / "logs" / f"{argv[0]}.log")
        if proc.returncode != 0:
            fail(f"{argv[0]} failed; log: {WORK / 'logs' / (argv[0] + '.log')}")
        print(f"{argv[0]}: {time.time() - t0:.1f}s", flush=True)
    (WORK / "digests.json").write_text(json.dumps(digests(assets), indent=1))
    (WORK / "args.json").write_text(json.dumps(vars(args), indent=1))
    Path(args.pack).parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(args.pack, "w:gz") as tar:
        for name in ("run", "config.yaml", "digests.json", "args.json", "logs"):
            tar.add(WORK / name, arcname=name)
    print(f"packed {args.pack}: {Path(args.pack).stat().st_size / 1e6:.1f} MB")


def run_on_gpu(args) -> None:
    if not have_gpu():
        fail("the run step needs an NVIDIA GPU (nvidia-smi and CUDA torch)", 2)
    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True)
    with tarfile.open(args.pack) as tar:
        tar.extractall(WORK, filter="data")
    prepared = json.loads((WORK / "args.json").read_text())
    args = argparse.Namespace(**{**vars(args), **{k: v for k, v in prepared.items() if k not in ("action", "pack", "results", "timing_only")}})
    student, teacher = shapes(args)
    t0 = time.time()
    if args.vision:
        from gndpo.apps.demos.vision import build_random_vision_pair

        assets = build_random_vision_pair(WORK / "assets")
    else:
        assets = build_assets(WORK / "assets", student, teacher, args.prompts)
    build_seconds = time.time() - t0
    want, have = json.loads((WORK / "digests.json").read_text()), digests(assets)
    mismatched = sorted(k for k in want if want[k] != have.get(k))
    gpu = "0"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
    result = {
        "gpu": (gpu_query("name", gpu) or ["?"])[0],
        "gpu_memory_total_mib": int(float((gpu_query("memory.total", gpu) or ["0"])[0])),
        "versions": {p: version(p) for p in ("torch", "transformers", "deepspeed", "duckdb")},
        "shapes": "the random Idefics3 pair (gndpo.apps.demos.vision)" if args.vision else {"student": asdict(student), "teacher": asdict(teacher)},
        "round": {"prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens},
        "assets_build_seconds": round(build_seconds, 1),
        "assets_match_rollout": not mismatched, "mismatched": mismatched,
        "stages": {},
    }
    if mismatched and not args.timing_only:
        write_results(args.results, result)
        fail(f"the rebuilt pair differs from the one that sampled the rollout: {mismatched}")
    from gndpo.pipeline.run.run import open_run

    run = WORK / "run"
    for stage in STAGES:
        sampler = MemorySampler(gpu)
        sampler.start()
        t0 = time.time()
        log = WORK / "logs" / f"{stage}.log"
        proc = gndpo(stage, run, "--round", 0, env=env, log=log)
        entry = {"seconds": round(time.time() - t0, 2), "peak_mib": max(sampler.stop(), default=0), "exit_code": proc.returncode}
        result["stages"][stage] = entry
        if proc.returncode != 0:
            entry["log_tail"] = log.read_text().splitlines()[-40:]
            write_results(args.results, result)
            print("\n".join(entry["log_tail"]), file=sys.stderr)
            fail(f"{stage} failed (exit code {proc.returncode})")
        manifest = open_run(str(run)).records(0, stage).require_manifest()
        entry["rows"], entry["metrics"] = manifest.rows, manifest.metrics
        print(f"{stage}: {entry['seconds']:.1f}s, peak {entry['peak_mib']} MiB", flush=True)
    result["status"] = gndpo("status", run).stdout.splitlines()
    result["phases"] = gndpo("status", run, "--phases").stdout.splitlines()
    write_results(args.results, result)
    print(f"wrote {args.results}")


def main(argv=None) -> None:
    args = parse_args(argv)
    prepare(args) if args.action == "prepare" else run_on_gpu(args)


if __name__ == "__main__":
    main()
