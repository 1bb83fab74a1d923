"""What the benchmark scripts share: where results go, running a timed process, the gndpo command."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

from gndpo.pipeline.exec.signals import descendants

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    """The processor's model name (/proc/cpuinfo), e.g. "AMD EPYC"."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def capabilities() -> list[str]:
    """The ATen kernel paths this CPU can run, narrowest first (avx512 needs AVX-512 F/BW/VL/DQ)."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    paths = ["default"]
    if "avx2" in flags:
        paths.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        paths.append("avx512")
    return paths


def machine() -> str:
    """The CPU type results are filed under: its model and the widest kernel path torch picks on it
    (results differ between CPU types, so every figure says which one gave it)."""
    return f"{cpu_model()} ({capabilities()[-1]})"


def gndpo_cmd(*args: str) -> list[str]:
    """The gndpo CLI of this interpreter's environment."""
    return [sys.executable, "-m", "gndpo.cli", *args]


def run_timed(argv: list[str], log: Path) -> tuple[float, str]:
    """Run ``argv`` to completion with its output in ``log``; (wall seconds, stdout). Raises with the
    log's tail if it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.time() - t0
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({proc.returncode}); log {log}:\n{proc.stderr[-3000:]}")
    return seconds, proc.stdout


def save_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _memory_kib(pid: int) -> tuple[int, int, int]:
    """(RSS, its high-water mark, PSS) of one process in KiB; zeros once it is gone."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (OSError, ValueError):
        return 0, 0, 0
    kib = lambda text: int(text.split()[0])  # noqa: E731
    pss = next((kib(line.split(":", 1)[1]) for line in rollup.splitlines() if line.startswith("Pss:")), 0)
    return kib(status.get("VmRSS", "0 kB")), kib(status.get("VmHWM", "0 kB")), pss


def _machine_busy_s() -> float:
    """CPU seconds all processes of the machine have used since boot (/proc/stat: user, nice, system,
    irq, softirq, steal)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


def run_measured(argv: list[str], log: Path, every_s: float = 0.5, timeline: bool = False) -> tuple[float, str, dict]:
    """:func:`run_timed` that also samples the memory of the process and all its descendants (vLLM's
    engine processes, train's ranks) every ``every_s`` seconds from /proc: the peak over time of the
    tree's summed PSS (shared pages split between the processes that map them: the memory the job
    takes) and summed RSS (shared pages counted in every process), and the largest single process's
    RSS high-water mark (the kernel's, so exact even between samples). Also the CPU seconds (user +
    system) of the process and the descendants it waited for, and the CPU seconds every other process
    of the machine used meanwhile (``other_cores``: their mean number of busy cores), which says how
    much a machine shared with other jobs disturbed the measurement. With ``timeline``, also each
    sample's seconds since the start and the tree's PSS in GiB, to tell which phase holds the peak."""
    log.parent.mkdir(parents=True, exist_ok=True)
    peak = {"tree_pss": 0, "tree_rss": 0, "process_hwm": 0, "processes": 0}
    samples: list[tuple[float, int]] = []
    cpu = lambda: (lambda r: r.ru_utime + r.ru_stime)(resource.getrusage(resource.RUSAGE_CHILDREN))  # noqa: E731
    cpu0, busy0, t0 = cpu(), _machine_busy_s(), time.time()
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        chunks: list[str] = []
        reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
        reader.start()
        while proc.poll() is None:
            pids = sorted(descendants(proc.pid))
            mem = [_memory_kib(p) for p in pids]
            peak["tree_rss"] = max(peak["tree_rss"], sum(m[0] for m in mem))
            peak["process_hwm"] = max([peak["process_hwm"], *(m[1] for m in mem)])
            peak["tree_pss"] = max(peak["tree_pss"], sum(m[2] for m in mem))
            peak["processes"] = max(peak["processes"], sum(1 for m in mem if m[0]))
            samples.append((time.time() - t0, sum(m[2] for m in mem)))
            time.sleep(every_s)
        reader.join()
    seconds, cpu_s, busy = time.time() - t0, cpu() - cpu0, _machine_busy_s() - busy0
    stdout = "".join(chunks)
    log.write_text(stdout + log.read_text())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({proc.returncode}); log {log}:\n{log.read_text()[-3000:]}")
    gib = lambda kib: round(kib / 2**20, 2)  # noqa: E731
    memory = {"peak_tree_pss_gib": gib(peak["tree_pss"]), "peak_tree_rss_gib": gib(peak["tree_rss"]),
              "max_process_rss_gib": gib(peak["process_hwm"]), "max_processes": peak["processes"], "sample_every_s": every_s,
              "cpu_s": round(cpu_s, 1), "other_cores": round(max(busy - cpu_s, 0.0) / seconds, 2),
              "machine_cores": os.cpu_count()}
    if timeline:
        memory["timeline"] = [[round(t, 1), gib(kib)] for t, kib in samples]
    return seconds, stdout, memory
