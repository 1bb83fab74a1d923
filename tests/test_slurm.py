"""examples/slurm/stage-workers.sbatch and overlapped-run.sbatch under a real Slurm: a single-node cluster on loopback.

The module starts Debian's munged, slurmctld and slurmd on this machine, configured in a temporary folder
(its own slurm.conf naming this host, a CPU-only node with the machine's CPU count, no cgroups), and
stops them at the end. Where Slurm is not installed (`make test` installs slurm-wlm and munge) or a daemon
cannot start, the tests that need it are skipped with the reason (and the daemon's log tail).

One toy round goes through the script as the issue's scenario: a job with 2 tasks (2 rollout and 2 score
workers, no GPUs) is cancelled with scancel while rollout units are claimed and not committed, then
submitted again; the resubmitted job takes the cancelled job's claims over and commits the round, whose
rollout, score and normalize rows and trained weights must equal those of `gndpo run` on an identical
run. Then two rounds go through overlapped-run.sbatch, each stage's workers started once for both, to
the same rows and weights.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.numpy import load_file

from gndpo.pipeline.run.run import open_run
from tests.conftest import free_ports, invoke_ok, missing_component, tiny_config_dict, write_config

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "slurm" / "stage-workers.sbatch"
OVERLAPPED = ROOT / "examples" / "slurm" / "overlapped-run.sbatch"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo", "srun")
# Every process of the test's jobs carries this variable (sbatch exports the submitting environment), so
# the processes a cancelled job leaves behind can be found by it, and only those are ended.
MARKER = "GNDPO_SLURM_TEST"
# The same torch threads in every process of the reference and of the jobs, so that float reductions run
# in the same order (the job's train would otherwise use both CPUs of the node).
THREADS = {"GNDPO_THREADS": "1"}
LEASE_TTL = "10"  # the cancelled job's claims are stale 10 s after their last heartbeat at the latest
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"({path.name} was not written)"
    return "\n".join(text[-lines:])


def marked_processes(marker: str, job: str | None = None) -> list[int]:
    """Processes whose environment holds ``MARKER=marker`` (and ``SLURM_JOB_ID=job``, if given)."""
    want = [f"{MARKER}={marker}".encode()] + ([f"SLURM_JOB_ID={job}".encode()] if job else [])
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(w in env for w in want):
            pids.append(int(entry.name))
    return pids


def end_processes(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Slurm:
    """A running single-node cluster: ``env`` is what its client commands (and the jobs) need."""

    folder: Path
    env: dict
    marker: str

    def command(self, *args, check=True, timeout=60) -> subprocess.CompletedProcess:
        proc = subprocess.run([*map(str, args)], capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, args))} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def submit(self, *args, env: dict | None = None) -> str:
        proc = subprocess.run(["sbatch", "--parsable", *map(str, args)], capture_output=True, text=True, timeout=60,
                              env={**self.env, **(env or {})})
        assert proc.returncode == 0, f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}"
        return proc.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict:
        """The job's fields in scontrol's one-line form (JobState, ExitCode, ...)."""
        out = self.command("scontrol", "show", "job", "-o", job).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job: str, timeout: float, out: Path | None = None) -> dict:
        """Wait until the job has ended and none of its processes is left; returns its fields."""
        deadline = time.time() + timeout
        while (fields := self.job(job))["JobState"] not in FINAL:
            if time.time() > deadline:
                raise AssertionError(f"job {job} still {fields['JobState']} after {timeout} s:\n{tail(out, 40) if out else ''}")
            time.sleep(1)
        while marked_processes(self.marker, job) and time.time() < deadline:
            time.sleep(1)
        return fields


def start(argv: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_for(what: str, ready, procs: list[tuple[str, subprocess.Popen, Path]], timeout: float = 60) -> None:
    """Poll ``ready()`` until true; skip the module (fail it under CI), with the daemons' log tails, when a
    daemon exits or the time is up."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for name, proc, log in procs:
            if proc.poll() is not None:
                missing_component(f"slurm: {name} exited with code {proc.returncode} while waiting for {what}; its log:\n{tail(log)}")
        if ready():
            return
        time.sleep(0.5)
    logs = "\n".join(f"--- {name}:\n{tail(log)}" for name, _, log in procs)
    missing_component(f"slurm: {what} not ready after {timeout} s; daemon logs:\n{logs}")


SLURM_CONF = """\
ClusterName=gndpotest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=3600
InactiveLimit=0
MailProg=/bin/true
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=local Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        missing_component(f"slurm is not installed (no {', '.join(missing)}); `make test` installs Debian's slurm-wlm and munge")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs its daemons as root (SlurmUser=root), and this is not root")
    if torch.cuda.is_available():
        pytest.skip("the test runs the script's CPU path (a CPU-only node), and this machine's vLLM and torch use its GPUs")
    folder = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (folder / sub).mkdir(mode=0o700)
    host = socket.gethostname().split(".")[0]
    ctld_port, slurmd_port = free_ports(2)
    munge_socket = folder / "munge" / "munge.socket"
    key = folder / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = folder / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, ctld_port=ctld_port, slurmd_port=slurmd_port, munge_socket=munge_socket,
                                      folder=folder, cpus=os.cpu_count()))
    sbin = lambda name: shutil.which(name) or f"/usr/sbin/{name}"  # noqa: E731
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    daemon_env = {**base, "SLURM_CONF": str(conf)}
    procs: list[tuple[str, subprocess.Popen, Path]] = []
    marker = str(folder)
    try:
        log = folder / "munged.log"
        procs.append(("munged", start([sbin("munged"), "--foreground", "--force", f"--socket={munge_socket}", f"--key-file={key}",
                                       f"--pid-file={folder}/munge/munged.pid", f"--seed-file={folder}/munge/munged.seed",
                                       f"--log-file={log}"], log, daemon_env), log))
        wait_for("munged's socket", munge_socket.exists, procs)
        log = folder / "slurmctld.log"
        procs.append(("slurmctld", start([sbin("slurmctld"), "-D", "-i", "-f", str(conf)], log, daemon_env), log))
        client_env = {**base, "SLURM_CONF": str(conf), MARKER: marker,
                      "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        cluster = Slurm(folder, client_env, marker)
        wait_for("slurmctld", lambda: "UP" in cluster.command("scontrol", "ping", check=False).stdout, procs)
        log = folder / "slurmd.log"
        procs.append(("slurmd", start([sbin("slurmd"), "-D", "-f", str(conf), "-N", host], log, daemon_env), log))
        wait_for("the node (idle in sinfo)", lambda: cluster.command("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip() == "idle", procs)
        yield cluster
    finally:
        # Jobs still queued or running, then what any of them left behind, then the daemons.
        if len(procs) >= 2:
            subprocess.run(["scancel", "--quiet", "--user=root"], env=daemon_env, capture_output=True, timeout=30)
            time.sleep(1)
        end_processes(marked_processes(marker))
        for _, proc, _ in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def new_run(folder: Path, tiny_assets: Path) -> Path:
    """A run created with `gndpo init` from the toy config (3 rollout units: 2 of 8 prompts, held-out eval),
    sampling on the student's own module (rollout.backend hf): the claims here are the job script's, the
    leases' and the rows', which vLLM's engine start-up in every worker would only slow down."""
    folder.mkdir(parents=True, exist_ok=True)
    invoke_ok("init", folder / "run", "--config", write_config(folder, tiny_config_dict(tiny_assets, rollout={"backend": "hf"})))
    return folder / "run"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_assets) -> Path:
    """Rounds 0 and 1 of the toy run through `gndpo run --rounds 2` on this machine, in a fresh process as
    the job's are (with the job's one thread: float reductions depend on the thread count; and not in
    this one, whose earlier tests may have left its math libraries otherwise: a sampler log-prob here
    once differed from the jobs' in the last bits after another module's in-process engines)."""
    run = new_run(tmp_path_factory.mktemp("slurm-reference"), tiny_assets)
    subprocess.run([sys.executable, "-m", "gndpo.cli", "run", str(run), "--rounds", "2"], env={**os.environ, **THREADS},
                   check=True, capture_output=True)
    return run


def committed_tables(run: Path, stage: str, round_idx: int = 0) -> dict:
    """Every committed parquet file's rows of ``round_idx``'s ``stage``, by unit and file name."""
    manifest = open_run(str(run)).records(round_idx, stage).manifest()
    assert manifest is not None, f"{stage} of round {round_idx} is not committed in {run}"
    return {(u.unit, Path(f.path).name): pq.read_table(run / f.path).to_pylist()
            for u in manifest.units for f in u.files if f.path.endswith(".parquet")}


def trained_weights(run: Path, round_idx: int = 0) -> dict:
    model_dir = open_run(str(run)).records(round_idx, "train").manifest().metrics["model_dir"]
    return load_file(str(run / model_dir / "model.safetensors"))


def assert_same_rounds(run: Path, reference: Path, rounds: int) -> None:
    """Rollout, score and normalize rows and the trained weights of rounds 0..rounds-1 equal the reference's."""
    for r in range(rounds):
        for stage in ("rollout", "score", "normalize"):
            got, want = committed_tables(run, stage, r), committed_tables(reference, stage, r)
            assert got.keys() == want.keys(), (r, stage)
            for key in want:
                assert got[key] == want[key], (r, stage, key)
        got, want = trained_weights(run, r), trained_weights(reference, r)
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"r{r} {name}")


def submit_round(slurm: Slurm, run: Path, out: Path, env: dict | None = None) -> str:
    """stage-workers.sbatch for round 0 on the CPU node: 2 tasks (2 workers per stage), no GPUs; the
    command line overrides the script's #SBATCH lines (2 nodes, 8 GPUs and 8 CPUs per task). ``env``:
    more of the job's environment."""
    return slurm.submit("--job-name=gndpo-round", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=1",
                        "--gpus-per-node=0", f"--output={out}", f"--chdir={out.parent}", SCRIPT, run, 0,
                        env={**THREADS, "LEASE_TTL": LEASE_TTL, **(env or {})})


def test_cancelled_and_resubmitted_job_commits_the_rows_of_gndpo_run(slurm, reference, tiny_assets, tmp_path):
    run = new_run(tmp_path, tiny_assets)
    rollout = run / "rounds" / "r0000" / "rollout"

    # The first job is cancelled as soon as a rollout worker holds a claim; its workers wait a minute
    # after generating each unit (GNDPO_DELAY_AT), so none can commit before the cancel.
    first_out = tmp_path / "first.out"
    first = submit_round(slurm, run, first_out, env={"GNDPO_DELAY_AT": "rollout.generate", "GNDPO_DELAY_S": "60"})
    deadline = time.time() + 300
    while not list(rollout.glob("claims/*/a*.json")):
        state = slurm.job(first)["JobState"]
        assert state not in FINAL and time.time() < deadline, f"job {first} is {state} and no rollout unit was claimed:\n{tail(first_out, 40)}"
        time.sleep(0.2)
    slurm.command("scancel", first)
    fields = slurm.wait(first, timeout=120, out=first_out)
    assert fields["JobState"] == "CANCELLED", fields
    left = marked_processes(slurm.marker, first)
    end_processes(left)
    assert not left, f"processes of the cancelled job {first} outlived it: {left}"
    assert open_run(str(run)).records(0, "rollout").manifest() is None, "rollout was committed before the cancel"
    claimed = {p.parent.name for p in rollout.glob("claims/*/a001.json")}
    assert claimed

    # The same script again: the cancelled job's claims are taken over, and the round is committed.
    second_out = tmp_path / "second.out"
    second = submit_round(slurm, run, second_out)
    fields = slurm.wait(second, timeout=900, out=second_out)
    log = second_out.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields['JobState']} {fields['ExitCode']}:\n{tail(second_out, 60)}"
    assert "rollout on 2 workers (CPU)" in log and "score on 2 workers (CPU)" in log, log
    records = open_run(str(run)).records(0, "rollout")
    assert any(records.done(u).attempt >= 2 for u in claimed), [records.done(u) for u in claimed]
    for stage in ("rollout", "score", "normalize", "train"):
        assert open_run(str(run)).records(0, stage).manifest() is not None, stage

    assert_same_rounds(run, reference, 1)
    assert sum(len(rows) for (unit, _), rows in committed_tables(run, "rollout").items() if unit != "eval-heldout") == 32


def test_overlapped_run_script_works_every_round_in_workers_started_once(slurm, reference, tiny_assets, tmp_path):
    """overlapped-run.sbatch for rounds 0 and 1 on the CPU node: 2 rollout workers, one of each other
    stage, as job steps side by side for the whole run; the rows and weights are `gndpo run`'s."""
    run = new_run(tmp_path, tiny_assets)
    out = tmp_path / "run.out"
    job = slurm.submit("--job-name=gndpo-run", "--nodes=1", "--ntasks=2", "--cpus-per-task=1", "--gpus-per-node=0", f"--output={out}",
                       f"--chdir={tmp_path}", OVERLAPPED, run, 2, env={**THREADS, "LEASE_TTL": LEASE_TTL, "ROLLOUT_WORKERS": "2"})
    fields = slurm.wait(job, timeout=900, out=out)
    log = out.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields['JobState']} {fields['ExitCode']}:\n{tail(out, 60)}"
    assert "rollout on 2 worker(s)" in log and "rounds 0-1 committed" in log, log
    opened = open_run(str(run))
    for stage in ("rollout", "score", "normalize", "train"):  # one process per worker for both rounds: no start per round
        pids = {c.numbers.worker.split(":")[1] for r in range(2) for c in opened.records(r, stage).require_manifest().units}
        assert len(pids) <= (2 if stage == "rollout" else 1), (stage, pids)
    assert_same_rounds(run, reference, 2)


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["RUN"], {"SLURM_JOB_ID": "1"}, "error: usage: sbatch stage-workers.sbatch RUN ROUND"),
        (["RUN", "0"], {}, "error: submit this script with sbatch (SLURM_JOB_ID is not set)"),
        (["RUN", "x"], {"SLURM_JOB_ID": "1"}, "error: ROUND must be a whole number, got 'x'"),
        (["RUN", "0"], {"SLURM_JOB_ID": "1", "GPUS_PER_NODE": "eight"}, "error: GPUS_PER_NODE must be a whole number, got 'eight'"),
        (["RUN", "0"], {"SLURM_JOB_ID": "1", "LEASE_TTL": "0"}, "error: LEASE_TTL must be a positive number of seconds, got '0'"),
        (["RUN", "0"], {"SLURM_JOB_ID": "1", "SKIP_TRAIN": "yes"}, "error: SKIP_TRAIN must be 0 or 1, got 'yes'"),
        (["RUN", "0"], {"SLURM_JOB_ID": "1", "PATH": "/usr/bin:/bin"}, "error: gndpo is not on PATH; activate its environment"),
    ],
)
def test_bad_input_is_one_line_error(args, env, message):
    """The script's own checks, run by bash directly (no cluster needed): one `error:` line, exit 1."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUS_PER_NODE", "LEASE_TTL", "SKIP_TRAIN"))}
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30, env={**base, **env})
    assert proc.returncode == 1, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
