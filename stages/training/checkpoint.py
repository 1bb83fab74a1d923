"""Train's checkpoints: the engine's state within a round and across rounds, and where an update starts.

* A state is DeepSpeed's own ``save_checkpoint`` (every ZeRO stage: each rank writes its partition),
  copied into the run's storage as immutable files whose sha256 goes into a record. Loading one needs
  ``torch.load(weights_only=False)`` inside DeepSpeed, i.e. unpickling; it is only done after every file
  was read back through the run's storage and matched the sha256 its record holds, so only files this
  run wrote itself are ever unpickled. ZeRO partitions are per rank: a state written by another number
  of ranks is not loaded.
* In-round checkpoints (every ``train.checkpoint_every`` steps): ``ckpt/step-NNNNN/`` in the attempt's
  folder, with the EMA average beside the engine state (:data:`EMA_FILE`, sha256-checked like the rest
  when read back), and the record ``ckpt/step-NNNNN.json`` (the step, the step history so far, the
  world size, the files), written last and exclusively: it is what makes the checkpoint visible.
* Where an update starts (:func:`resume_point`, the one place that decides, and :func:`start_at`): after
  the newest checkpoint any earlier attempt of the round left, so a retried attempt repeats no optimizer
  step; else with the optimizer state the kept engine holds, the one the previous round carried
  (``train.carry_optimizer_state``: :func:`carry_state` writes it as the round's ``optimizer/``), or
  one replayed from an older written state.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gndpo.dist import Dist
from gndpo.faults import crash_point
from gndpo.pipeline.exec.units import WORKING, working_dir
from gndpo.pipeline.run.products import POLICY, CarriedState, carried_state
from gndpo.pipeline.run.run import Run
from gndpo.stages.models.lora import has_adapters
from gndpo.stages.training.ema import EmaWeights
from gndpo.storage.cache import cache_dir
from gndpo.storage.products import FileRecord
from gndpo.storage.shards import verified_bytes

CHECKPOINT_TAG = "state"
EMA_FILE = "ema.safetensors"  # the EMA average inside an in-round checkpoint
UNIT = "update"  # train's one work unit, whose attempts leave the checkpoints


class CheckpointRecord(CarriedState):
    """An in-round checkpoint's record (``ckpt/step-NNNNN.json``): the engine state's files and the
    ranks that wrote them, the steps taken (``step``) and their figures, and the EMA average's file."""

    step: int
    history: list[dict] = []
    ema: dict | None = None


# -- an engine's state ------------------------------------------------------------------------------
def save_state(engine, fs, rel: str, dist: Dist) -> list[FileRecord] | None:
    """Write the engine's full state (module, optimizer, its partitions) under ``rel``; collective.
    Returns, on rank 0, the file records of all ranks (None elsewhere)."""
    with fs.staging_dir(rel) as tmp:
        # With adapters (model.lora) the frozen base is the initial student's, not state to carry.
        engine.save_checkpoint(tmp, tag=CHECKPOINT_TAG, exclude_frozen_parameters=has_adapters(engine.module))
        # Each rank's staging folder holds exactly the files that rank wrote (its partitions; rank 0
        # also the module file below ZeRO-3), and names carry the rank, so uploads never collide.
        folder = Path(tmp) / CHECKPOINT_TAG
        records = [fs.move_in(f"{rel}/{p.name}", p) for p in sorted(folder.iterdir()) if p.is_file()]
    if dist.world > 1:
        import torch.distributed as torch_dist

        gathered = [None] * dist.world
        torch_dist.all_gather_object(gathered, records)
        records = [r for part in gathered for r in part]
    return records if dist.main else None


def load_state(engine, fs, state: CarriedState, world: int) -> bool:
    """Load a state written by :func:`save_state` after checking every file against its sha256. A state
    written by another number of ranks is skipped (False): ZeRO partitions are per rank. Every rank
    reads all files, as DeepSpeed's ZeRO-1/2 loader reads every rank's optimizer partition, from one
    download per node (:func:`node_state_folder`)."""
    if state.world != world:
        return False
    with node_state_folder(fs, state, Dist.from_env()) as root:
        engine.load_checkpoint(root, tag=CHECKPOINT_TAG, load_optimizer_states=True, load_lr_scheduler_states=False,
                               load_module_strict=not has_adapters(engine.module))
    return True


@contextmanager
def node_state_folder(fs, state: CarriedState, dist: Dist) -> Iterator[str]:
    """A folder whose ``CHECKPOINT_TAG`` subfolder holds ``state``'s files, each checked against its
    sha256: downloaded once per node, by its first rank (local rank 0), into the node's cache, and read
    by every rank of the node after a barrier (8 ranks each fetching every partition was 8 downloads of
    the whole state); removed once every rank has loaded. One rank alone uses a temporary folder."""
    if dist.world == 1:
        with tempfile.TemporaryDirectory() as tmp:
            download_state(fs, state, Path(tmp) / CHECKPOINT_TAG)
            yield tmp
        return
    import torch.distributed as torch_dist

    # The node and the run in the name: a cache on a filesystem several nodes share gets one folder a node.
    key = hashlib.sha1(f"{socket.gethostname()}:{fs.url}:{[r.sha256 for r in state.file_records()]}".encode()).hexdigest()[:16]
    root = cache_dir("states") / key
    if dist.local_rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        download_state(fs, state, root / CHECKPOINT_TAG)
    torch_dist.barrier()
    try:
        yield str(root)
    finally:
        torch_dist.barrier()
        if dist.local_rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def download_state(fs, state: CarriedState, folder: Path) -> None:
    """``state``'s files into ``folder``, each checked against its commit record."""
    folder.mkdir(parents=True)
    for record in state.file_records():
        (folder / Path(record.path).name).write_bytes(verified_bytes(fs, record))


# -- within a round ---------------------------------------------------------------------------------
def save_checkpoint(engine, fs, out_dir: str, history: list[dict], dist: Dist, ema: EmaWeights | None) -> None:
    """Full engine state (and the EMA average) after ``len(history)`` steps, in the checkpoint folder
    of the attempt writing to ``out_dir``; collective. Rank 0's JSON record, written last and
    exclusively, is what makes the checkpoint visible to a later attempt."""
    step = len(history)
    base = f"{out_dir}/{WORKING}/step-{step:05d}"  # the attempt's working folder: no commit lists it
    files = save_state(engine, fs, base, dist)
    if dist.main:
        record = CheckpointRecord(step=step, history=history, world=dist.world, files=[f.to_json() for f in files])
        if ema is not None:
            record.ema = fs.write_new(f"{base}/{EMA_FILE}", ema.to_bytes()).to_json()
        fs.create_json(f"{base}.json", record.to_json())


def newest_checkpoint(run: Run, round_idx: int, dist: Dist) -> CheckpointRecord | None:
    """The record of the newest checkpoint an earlier attempt of this round left with this number of
    ranks (None: none). ZeRO partitions are per rank, so another world size's checkpoint cannot be
    continued, and a newer one of another world size must not hide an older one of this. Rank 0
    chooses it and tells the others, so every rank loads the same one."""
    best: list[CheckpointRecord | None] = [None]
    if dist.main:
        records = run.records(round_idx, POLICY)
        for attempt in records.attempts(UNIT):
            ckpt = working_dir(records, UNIT, attempt)
            for name in run.fs.listdir(ckpt):
                if name.endswith(".json"):
                    found = CheckpointRecord.model_validate(run.fs.read_json(f"{ckpt}/{name}"))
                    if found.world != dist.world:
                        continue
                    if best[0] is None or found.step > best[0].step:
                        best[0] = found
    if dist.world > 1:
        import torch.distributed as torch_dist

        torch_dist.broadcast_object_list(best, src=0)
    return best[0]


@dataclass
class Start:
    """Where a round's update starts."""

    history: list[dict]  # the steps an earlier attempt took; the update goes on after them
    after_step: int  # the checkpoint's step (0: from the round's start)
    optimizer_state: bool  # AdamW's moments continue (a checkpoint's, the kept engine's, the previous round's)


@dataclass(frozen=True)
class ResumePoint:
    """Where a round's update continues from (:func:`resume_point`)."""

    source: Literal["checkpoint", "kept", "carried", "replay", "fresh"]
    state: CarriedState | None = None  # the checkpoint's (a CheckpointRecord), the carried or the replay's starting state
    replay_from: int = -1  # replay: the round whose written state it starts from (-1: round 0's start)


def resume_point(run: Run, round_idx: int, dist: Dist, kept: bool) -> ResumePoint:
    """Where round ``round_idx``'s update continues from: the first of these the run has.

    1. ``checkpoint``: the newest in-round checkpoint an earlier attempt left, written by this number
       of ranks (engine state, EMA average, the steps taken), so a retried attempt repeats no step;
    2. ``kept``: the engine this process kept, which exported exactly the previous round's policy
       (``kept``): its optimizer state is in memory;
    3. ``fresh``: round 0, or ``train.carry_optimizer_state`` off;
    4. ``carried``: the optimizer state the previous round wrote;
    5. ``replay``: the newest state written before that (``train.state_every``, or a
       ``train.state_async`` write that never finished), the train stages since then run again.
    Every rank gets the same answer (rank 0 chooses the checkpoint)."""
    checkpoint = newest_checkpoint(run, round_idx, dist)
    if checkpoint is not None:
        return ResumePoint("checkpoint", checkpoint)
    if kept:
        return ResumePoint("kept")
    if round_idx == 0 or not run.cfg.train.carry_optimizer_state:
        return ResumePoint("fresh")
    state = carried_state(run.records(round_idx - 1, POLICY))  # the parent's, for a forked run's first round
    if state is not None:
        return ResumePoint("carried", state)
    base, state = last_carried_state(run, round_idx)
    return ResumePoint("replay", state, base)


def start_at(point: ResumePoint, engine, run: Run, round_idx: int, world: int, ema: EmaWeights | None, log) -> Start:
    """Load ``point``'s state into ``engine`` (and the EMA average), on every rank alike; the update's
    start (a ``replay`` is :meth:`gndpo.stages.train.TrainJob.resume`'s, which calls this for every
    other point). A carried state written by another number of ranks is not loaded: ZeRO partitions
    are per rank."""
    if point.source == "replay":
        raise ValueError("a replay starts where it ends (TrainJob.resume), not from a loaded state")
    if point.source == "checkpoint":
        load_state(engine, run.fs, point.state, world)
        if ema is not None:
            ema.load_bytes(verified_bytes(run.fs, FileRecord.of(point.state.ema)))
        log(f"train r{round_idx}: resuming after step {point.state.step} from a checkpoint")
        return Start(list(point.state.history), point.state.step, True)
    if point.source == "carried":
        # The parent's records, for a forked run's first round.
        if load_state(engine, run.records(round_idx - 1, POLICY).run, point.state, world):
            return Start([], 0, True)
        log(f"train r{round_idx}: optimizer state of round {round_idx - 1} was written by {point.state.world} ranks; starting a fresh one")
    return Start([], 0, point.source == "kept")


# -- across rounds ----------------------------------------------------------------------------------
def last_carried_state(run: Run, round_idx: int) -> tuple[int, CarriedState | None]:
    """(k, state): the newest round before ``round_idx`` whose train wrote its optimizer state
    (``train.state_every``), with that state; (-1, None) if none did, the optimizer having started
    fresh on the initial student in round 0."""
    for k in range(round_idx - 1, -1, -1):
        if (state := carried_state(run.records(k, POLICY))) is not None:
            return k, state
    return -1, None


def carry_state(engine, fs, out_dir: str, dist: Dist) -> CarriedState | None:
    """The round's final engine state as ``optimizer/``, for the next round to continue; collective.
    Returns its record on rank 0, None elsewhere."""
    files = save_state(engine, fs, f"{out_dir}/optimizer", dist)
    return CarriedState(world=dist.world, files=[f.to_json() for f in files]) if dist.main else None


class DeferredState:
    """:func:`carry_state` on a thread, for a one-rank engine this process keeps for the next round
    (``train.state_async``): the round commits without waiting, naming :attr:`record` as where its
    state will be, and the write overlaps the next round's rollout, score and normalize, which leave
    the engine's weights and optimizer as they are. The next update calls :meth:`wait` before its
    first step changes them. The record is written last, and only once the commit that names it
    exists (:meth:`release`, or :meth:`wait`), so until it exists the state does not: a process that
    dies first leaves none, and the next train replays from the last written state
    (:func:`last_carried_state`), as after a ``train.state_every`` round."""

    RECORD = "optimizer.json"

    def __init__(self, engine, fs, out_dir: str, log):
        self.record = f"{out_dir}/{self.RECORD}"
        self._log = log
        self._error: BaseException | None = None
        self._released = threading.Event()  # the round's commit exists: the record may follow it
        self._thread = threading.Thread(target=self._write, args=(engine, fs, out_dir), name="gndpo-state", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """The commit naming :attr:`record` is written: the record may be written after the files."""
        self._released.set()

    def _write(self, engine, fs, out_dir: str) -> None:
        try:
            t0 = time.perf_counter()
            state = carry_state(engine, fs, out_dir, Dist())
            written = sum(f.bytes for f in state.file_records())
            self._released.wait()
            crash_point("train.state_write")
            fs.create_json(self.record, {**state.to_json(), "seconds": round(time.perf_counter() - t0, 3), "bytes": written})
        except BaseException as exc:  # noqa: BLE001 - reported by wait(), on the thread that can act on it
            self._error = exc

    def wait(self) -> None:
        """Block until the state and its record are written. A failed write is logged, not raised: the
        round is committed, and a train that later needs the state replays without it."""
        self._released.set()  # whoever waits needs the state now: the round's commit is long written
        self._thread.join()
        if self._error is not None:
            self._log(f"train: writing the optimizer state to {self.record} failed ({self._error!r}); "
                      "a restart will replay the rounds since the last written state")
            self._error = None
