"""Do the toy's built bytes depend on the CPU's kernel paths? Builds the demo's toy under each path this
machine offers and compares the files' sha256.

Torch's own kernels follow ``ATEN_CPU_CAPABILITY`` (default, avx2, avx512 where the CPU has it) and MKL's
matrix products ``MKL_CBWR`` (its code-path branch; unset: MKL picks by processor). Each variant is a
full build of the addition toy (``ensure_toy_assets``' spec) in its own process and cache:

* ``machine``: no pins, the paths this CPU selects by itself (how toys were built before pinning);
* one variant per other path, unpinned otherwise (what another CPU type would have selected);
* ``pinned``: the build as gndpo runs it (``PINNED_ARITHMETIC``), from a caller whose environment
  names each other path (the pins must win), on 2 threads and on 1 core.

Adds this CPU's entry to results/toy_determinism.{json,md} (a rerun replaces it; other CPUs' entries stay):
per variant, the sha256 of the student's and the teacher's
weights, their held-out exact match and checkpoint steps, and the build's wall time.

    .venv/bin/python bench/toy_determinism.py            # the variants this CPU type has no row for yet
    .venv/bin/python bench/toy_determinism.py --rebuild
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, capabilities, cpu_model, machine, save_json  # noqa: E402

from gndpo.storage.runfs import file_sha256  # noqa: E402

BUILD = """
import json, sys
from gndpo.apps.demos.arithmetic import ToySpec, build_toy_assets
from gndpo.apps.demos.build import pinned_build
from gndpo.storage.cache import cached_build
environment = json.loads(sys.argv[1])
spec = ToySpec()
folder = cached_build(f"toy-{spec.key()}", pinned_build(build_toy_assets, spec, log=lambda _: None, environment=environment))
print(folder)
"""


def variants() -> list[dict]:
    """(name, environment the build process gets, caller environment, one core?)"""
    unset = {"ATEN_CPU_CAPABILITY": None, "MKL_CBWR": None}
    out = [{"name": "machine", "build_env": unset, "caller_env": {}, "one_core": False}]
    for cap in capabilities():
        out.append({"name": f"ATEN={cap}", "build_env": {**unset, "ATEN_CPU_CAPABILITY": cap}, "caller_env": {}, "one_core": False})
    for branch in ("COMPATIBLE", "AVX2"):
        out.append({"name": f"MKL_CBWR={branch}", "build_env": {**unset, "MKL_CBWR": branch}, "caller_env": {}, "one_core": False})
    if "avx512" in capabilities():  # both paths an AVX2-only CPU picks by itself: its `machine` build, here
        out.append({"name": "ATEN=avx2 MKL_CBWR=AVX2", "build_env": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"},
                    "caller_env": {}, "one_core": False})
    out.append({"name": "pinned", "build_env": None, "caller_env": {}, "one_core": False})
    out.append({"name": "pinned, 1 core", "build_env": None, "caller_env": {}, "one_core": True})
    for cap in capabilities()[1:]:
        caller = {"ATEN_CPU_CAPABILITY": cap, "MKL_CBWR": "AVX2"}
        out.append({"name": f"pinned, caller ATEN={cap} MKL_CBWR=AVX2", "build_env": None, "caller_env": caller, "one_core": False})
    return out


def build(variant: dict) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, **variant["caller_env"], "GNDPO_CACHE": cache}
        core = sorted(os.sched_getaffinity(0))[0]
        t0 = time.time()
        proc = subprocess.run(
            [sys.executable, "-c", BUILD, json.dumps(variant["build_env"])], env=env, capture_output=True, text=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, {core})) if variant["one_core"] else None,
        )
        seconds = time.time() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{variant['name']}: build failed\n{proc.stderr[-3000:]}")
        folder = Path(proc.stdout.strip().splitlines()[-1])
        info = json.loads((folder / "info.json").read_text())
        return {
            "variant": variant["name"],
            "student_sha256": file_sha256(folder / "student" / "model.safetensors"),
            "teacher_sha256": file_sha256(folder / "teacher" / "model.safetensors"),
            "student_heldout": info["student_heldout_accuracy"], "student_steps": info["student_steps"],
            "teacher_heldout": info["teacher_heldout_accuracy"], "teacher_steps": info["teacher_steps"],
            "seconds": round(seconds, 1),
        }


def markdown(rows: list[dict], others: list[dict]) -> str:
    """A machine's builds; the last column names the other CPU types' builds with the same bytes."""
    lines = ["| build | student sha256 | teacher sha256 | student (steps) | teacher (steps) | seconds | same bytes elsewhere |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        same = [f"{m['machine']}: {o['variant']}" for m in others for o in m["rows"] if weights(o) == weights(r)]
        lines.append(
            f"| {r['variant']} | `{r['student_sha256'][:12]}` | `{r['teacher_sha256'][:12]}` | "
            f"{r['student_heldout']:.3f} ({r['student_steps']}) | {r['teacher_heldout']:.3f} ({r['teacher_steps']}) | {r['seconds']:.0f} | "
            f"{'; '.join(same) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def weights(row: dict) -> tuple[str, str]:
    return row["student_sha256"], row["teacher_sha256"]


def pinned_bytes(machine: dict) -> set[tuple[str, str]]:
    return {weights(r) for r in machine["rows"] if r["variant"].startswith("pinned")}


def pinned_across(machines: list[dict]) -> set[tuple[str, str]]:
    """Every distinct pinned build over all CPU types: one element if they all agree."""
    return set().union(*(pinned_bytes(m) for m in machines))


def merge(machines: list[dict], result: dict) -> list[dict]:
    """One entry per CPU (model and widest kernel path): a rerun on a machine replaces its own entry, so the
    file gathers the CPU types the bench has met."""
    return [m for m in machines if m["machine"] != result["machine"]] + [result]


def report(machines: list[dict]) -> str:
    every_pinned = pinned_across(machines)
    verdict = ("the same bytes" if len(every_pinned) == 1 else f"{len(every_pinned)} different sets of bytes")
    parts = [f"Pinned builds over {len(machines)} CPU type(s) ({', '.join(m['machine'] for m in machines)}): {verdict}.\n"]
    for m in machines:
        others = [o for o in machines if o is not m]
        parts.append(f"\n## {m['machine']}\n\nKernel paths: {', '.join(m['capabilities'])}.\n\n" + markdown(m["rows"], others))
    return "".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuild", action="store_true", help="build every variant again (default: only those this CPU type lacks)")
    args = parser.parse_args()
    path = RESULTS / "toy_determinism.json"
    machines = json.loads(path.read_text())["machines"] if path.exists() else []
    recorded = {} if args.rebuild else {r["variant"]: r for m in machines if m["machine"] == machine() for r in m["rows"]}
    rows = []
    for variant in variants():
        rows.append(recorded.get(variant["name"]) or build(variant))
        print(json.dumps(rows[-1]), flush=True)
    result = {"machine": machine(), "cpu_model": cpu_model(), "capabilities": capabilities(), "rows": rows,
              "pinned_identical": len(pinned_bytes({"rows": rows})) == 1,
              "unpinned_distinct": len({weights(r) for r in rows if not r["variant"].startswith("pinned")})}
    machines = merge(machines, result)
    save_json(path, {"machines": machines,
                     "pinned_identical_across_machines": len(pinned_across(machines)) == 1})
    (RESULTS / "toy_determinism.md").write_text(report(machines))
    print(report(machines))


if __name__ == "__main__":
    main()
