"""Train's batch join: this rank's share of the round, with the method's targets, streamed by mini-batch.

Every rank reads the round's rollout ids (one short string per response), shuffles them with the
round's seed and cuts them into ``train.optimizer_steps`` mini-batches; rank r takes every world-th
response of each mini-batch. Then the heavy columns (token ids, log-probs, the teacher's top-k) are
read one rollout shard (and its score rows) at a time, for this rank's rows only, straight from Arrow
buffers into numpy views, joined with the method's targets (advantage, policy-gradient mask,
divergence weight, loss mask, response weight) from the committed round statistics, and written to
local step files (:class:`gndpo.storage.step_files.StepFiles`). What stays in memory is the
light index the schedule needs (lengths, prompt ids, the steps' loss-token and weight sums); a step's
rows are read back when it comes. Train's memory is thus one shard's rows while the round is read and
two mini-batches while it trains, whatever the round's size.
"""

from __future__ import annotations

import math
import random
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gndpo.errors import GndpoError
from gndpo.pipeline.exec.inputs import StageInputs
from gndpo.pipeline.methods import Response, get_method, response_targets, score_needs
from gndpo.pipeline.methods.base import TOPK, Stats
from gndpo.pipeline.run.products import ROLLOUTS, SCORES, STATISTICS
from gndpo.pipeline.run.run import Run
from gndpo.storage.products import FileRecord
from gndpo.storage.shards import flat_values, read_shard
from gndpo.storage.step_files import StepFiles

ROLLOUT_COLUMNS = ["rollout_id", "prompt_id", "prompt_token_ids", "response_token_ids", "loss_mask", "sampler_logprobs",
                   "reward", "rewards", "teacher_prefix_len", "finish_reason"]
SCORE_COLUMNS = ["rollout_id", "teacher", "teacher_logprobs", "student_logprobs", "teacher_entropy", "student_entropy", "token_kl",
                 "aligned"]
TOPK_COLUMNS = ["teacher_topk_ids", "teacher_topk_logprobs", "teacher_rest_logprob"]  # the last one where score stored it


@dataclass
class TrainRow:
    """One response as train sees it; every per-token field is a numpy view of length n (or [n, k])."""

    rollout_id: str
    prompt: np.ndarray
    response: np.ndarray
    old_logp: np.ndarray
    adv: np.ndarray
    pg_mask: np.ndarray
    div: np.ndarray
    mask: np.ndarray
    weight: float
    topk_ids: np.ndarray | None = None
    topk_logp: np.ndarray | None = None
    # log of the teacher's mass outside its top-k, per token; None where score did not store it (shards
    # written before it did: the loss then recomputes it from the top-k).
    topk_rest: np.ndarray | None = None
    prompt_id: str = ""  # which prompt's images the forward shows (a vision-language run)
    teacher: str = ""  # the teacher that scored the row, as score recorded it (its top-k's vocabulary)

    @property
    def tokens(self) -> int:
        """Padded-batch cost of this row: prompt + response tokens."""
        return len(self.prompt) + len(self.response)


def topk_columns(available: list[str]) -> list[str]:
    """The score columns a top-k method reads: the teacher's ids and log-probs, and its rest log-prob
    where the shards have it (older ones do not)."""
    return [name for name in TOPK_COLUMNS if name != "teacher_rest_logprob" or name in available]


def step_order(rollout_ids: list[str], seed: int, round_idx: int, optimizer_steps: int) -> list[list[str]]:
    """The round's mini-batches of rollout ids: a seeded shuffle of the rollout manifest's order (by
    round, never by attempt or rank count, so a retried train and any world size take the same steps)
    cut into equal parts."""
    order = list(rollout_ids)
    random.Random(f"{seed}:{round_idx}").shuffle(order)
    steps = max(1, min(optimizer_steps, len(order)))
    size = math.ceil(len(order) / steps)
    return [order[i : i + size] for i in range(0, len(order), size)]


@dataclass
class StepIndex:
    """What the schedule needs of one step's rows on this rank, in the step's order, without their
    tokens: each row's padded-batch cost, response length and prompt id, and the step's loss-token
    count and response-weight sum."""

    tokens: np.ndarray
    response_tokens: np.ndarray
    prompt_ids: list[str]
    loss_tokens: float
    weight_sum: float


@dataclass
class AdvantageSums:
    """Count, sum, sum of squares and range of the advantages on policy-gradient tokens (this rank's rows)."""

    count: int = 0
    total: float = 0.0
    squares: float = 0.0
    low: float = math.inf
    high: float = -math.inf

    def add(self, adv: np.ndarray) -> None:
        if adv.size:
            adv = adv.astype(np.float64, copy=False)
            self.count += adv.size
            self.total += float(adv.sum())
            self.squares += float((adv**2).sum())
            self.low, self.high = min(self.low, float(adv.min())), max(self.high, float(adv.max()))


class RoundShare:
    """This rank's share of a round, streamed: the light per-step index (``index[i]``, what the schedule
    needs) in memory, each step's rows read by ``read_step(i)`` when the step comes (from the step
    files, :func:`load_share`), with the next step read ahead in a background thread. So train holds
    at most two mini-batches of rows, whatever the round's size. ``step_sizes[i]`` is the number of
    responses of step i over all ranks."""

    def __init__(self, index: list[StepIndex], step_sizes: list[int], advantages: AdvantageSums, read_step,
                 files: StepFiles | None = None):
        self.index, self.step_sizes, self.advantages = index, step_sizes, advantages
        self._read, self._files = read_step, files
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gndpo-step-reader")
        self._pending: dict[int, Future] = {}

    @classmethod
    def of_rows(cls, steps: list[list[TrainRow]], step_sizes: list[int] | None = None) -> RoundShare:
        """A share of rows already in memory, ``steps[i]`` step i's (benchmarks and tests)."""
        builder = IndexBuilder([len(rows) for rows in steps])
        for i, rows in enumerate(steps):
            for pos, row in enumerate(rows):
                builder.note(i, pos, row)
        return cls(builder.index(), step_sizes or [len(rows) for rows in steps], builder.advantages, steps.__getitem__)

    def rows(self, step: int) -> list[TrainRow]:
        """Step ``step``'s rows on this rank, in the step's order; starts reading step ``step + 1``."""
        pending = self._pending.pop(step, None) or self._reader.submit(self._read, step)
        self._pending = {}  # a step read ahead but not taken (a resumed round starts later) is dropped
        if step + 1 < len(self.index):
            self._pending[step + 1] = self._reader.submit(self._read, step + 1)
        return pending.result()

    def all_rows(self) -> list[TrainRow]:
        """Every row of the share, step after step (for inspection; holds the whole share)."""
        return [row for step in range(len(self.index)) for row in self._read(step)]

    def step_file_bytes(self) -> int:
        """What the step files take on disk (0 where the rows stayed in memory)."""
        return self._files.bytes_on_disk() if self._files is not None else 0

    def close(self) -> None:
        """Stop reading ahead and remove the step files."""
        self._reader.shutdown(wait=True, cancel_futures=True)
        if self._files is not None:
            self._files.close()

    def __enter__(self) -> RoundShare:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_step_rows(files: StepFiles, join, step: int) -> list[TrainRow]:
    """Step ``step``'s train rows: its stored columns from ``files``, in the step's order, joined
    (``join(rollouts, scores)``) with their targets."""
    table = files.read(step)
    return [] if table is None else join(*split_rows(table.sort_by(POSITION)))


def load_share(inputs: StageInputs, rank: int, world: int) -> RoundShare:
    """Rank ``rank``'s share of the round ``inputs`` reads (its rollouts, scores and statistics): the
    round's responses (less those ``rollout.truncated`` keeps out) in ``train.optimizer_steps`` steps,
    shuffled by the train seed, each step's rows split across the ``world`` ranks, joined with their
    scores and targets. The round is read one rollout shard at a time and its rows are written to the
    step files, so memory holds one shard's rows, never the round's."""
    run, round_idx, cfg = inputs.run, inputs.round, inputs.run.cfg
    rollout_files, score_files = inputs.files(ROLLOUTS), inputs.files(SCORES)
    kept = kept_rollout_ids(run, rollout_files, round_idx)
    score_file_of = score_files_by_rollout(run, score_files, round_idx, kept.total)
    steps = step_order(kept.ids, cfg.train.seed, round_idx, cfg.train.optimizer_steps)
    mine = [ids[rank::world] for ids in steps]
    place = {rid: (i, pos) for i, ids in enumerate(mine) for pos, rid in enumerate(ids)}
    writer = ShareWriter(mine)
    stats = inputs.statistics(STATISTICS)
    # Another rank's rows, or truncated ones, are left out; with neither, nothing is filtered.
    wanted = pa.array(list(place), pa.string()) if len(place) < kept.total else None
    for rollout_file in rollout_files:
        side_by_side = shard_rows(run, rollout_file, score_files, score_file_of, wanted)
        # In pieces, so what the index computes from a row (targets, per token) never grows with the unit.
        for start in range(0, side_by_side.num_rows, INDEX_PIECE_ROWS):
            piece = side_by_side.slice(start, INDEX_PIECE_ROWS)
            rows = _join(*split_rows(piece), run, round_idx, stats, with_topk=False)
            writer.add_rows(piece, [place[row.rollout_id] for row in rows], rows)
    return writer.share([len(ids) for ids in steps], partial(_join, run=run, round_idx=round_idx, stats=stats))


def shard_rows(run: Run, rollout_file: FileRecord, score_files: list[FileRecord], score_file_of: dict[str, int], wanted: pa.Array | None) -> pa.Table:
    """One rollout shard's rows (only those whose id is in ``wanted``, where given) with their score
    rows beside them (:func:`beside`), the score columns train reads."""
    rollouts = read_shard(run.fs, rollout_file, ROLLOUT_COLUMNS)
    if wanted is not None:
        rollouts = rollouts.filter(pc.is_in(rollouts.column("rollout_id"), value_set=wanted))
    ids = rollouts.column("rollout_id")
    columns = SCORE_COLUMNS + (TOPK_COLUMNS if TOPK in score_needs(run.cfg.method) else [])
    # Score writes one shard per rollout shard, so this is one file; the join does not rely on it.
    needed = sorted({score_file_of[rid] for rid in ids.to_pylist()})
    if not needed:
        return rollouts
    scores = pa.concat_tables([read_shard(run.fs, score_files[j], columns) for j in needed], promote_options="default")
    if scores.num_rows != rollouts.num_rows:
        scores = scores.filter(pc.is_in(scores.column("rollout_id"), value_set=ids))
    return beside(rollouts, scores)


INDEX_PIECE_ROWS = 64  # rows whose targets the index computes at once
POSITION = "step_position"  # a step file's column: the row's place in its step
SCORE_PREFIX = "score."  # a step file's score columns, beside the rollout's


def beside(rollouts: pa.Table, scores: pa.Table) -> pa.Table:
    """``rollouts`` with each row's score columns beside it (prefixed), one table row per response."""
    score_row_of = {rid: i for i, rid in enumerate(scores.column("rollout_id").to_pylist())}
    rollout_ids = rollouts.column("rollout_id").to_pylist()
    missing = [rid for rid in rollout_ids if rid not in score_row_of]
    if missing:
        raise GndpoError(f"rollout {missing[0]} has no score row")
    order = [score_row_of[rid] for rid in rollout_ids]
    if order != list(range(len(order))):  # score keeps the rollout shard's order: no copy then
        scores = scores.take(order)
    for name in scores.column_names:
        rollouts = rollouts.append_column(SCORE_PREFIX + name, scores.column(name))
    return rollouts


def split_rows(table: pa.Table) -> tuple[pa.Table, pa.Table]:
    """(rollouts, scores) of a :func:`beside` table, row for row."""
    scores = [name for name in table.column_names if name.startswith(SCORE_PREFIX)]
    rollouts = [name for name in table.column_names if name not in scores and name != POSITION]
    return table.select(rollouts), table.select(scores).rename_columns([name.removeprefix(SCORE_PREFIX) for name in scores])


@dataclass
class KeptIds:
    """The round's rollout ids in manifest order, less the truncated ones ``rollout.truncated`` drops."""

    ids: list[str]
    total: int  # responses in the round, kept or not


def kept_rollout_ids(run: Run, rollout_files: list[FileRecord], round_idx: int) -> KeptIds:
    """The rollout ids train takes (read without the heavy columns); refuses duplicates, and a round
    whose every response was cut where ``rollout.truncated`` drops them."""
    cfg = run.cfg
    ids: list[str] = []
    kept: list[str] = []
    for record in rollout_files:
        table = read_shard(run.fs, record, ["rollout_id", "finish_reason"])
        file_ids = table.column("rollout_id").to_pylist()
        ids += file_ids
        # mask and drop: a response cut at max_tokens has no loss and does not count in the step's
        # normalizers (drop also kept it out of normalize's statistics).
        cut = [False] * len(file_ids) if cfg.rollout.truncated == "keep" else \
            pc.fill_null(pc.equal(table.column("finish_reason"), "length"), False).to_pylist()
        kept += [rid for rid, was_cut in zip(file_ids, cut) if not was_cut]
    if len(set(ids)) != len(ids):
        raise GndpoError(f"round {round_idx}: a rollout id appears twice in the rollout shards")
    if ids and not kept:
        raise GndpoError(
            f"round {round_idx}: every response was cut at rollout.max_tokens and rollout.truncated is "
            f"{cfg.rollout.truncated}: nothing to train on (raise rollout.max_tokens, or use truncated: keep)"
        )
    return KeptIds(kept, len(ids))


def score_files_by_rollout(run: Run, score_files: list[FileRecord], round_idx: int, responses: int) -> dict[str, int]:
    """{rollout id: index of the score file holding its row}, from the score files' id column alone;
    refuses a round whose score rows are not one per response."""
    out: dict[str, int] = {}
    rows = 0
    for j, record in enumerate(score_files):
        file_ids = read_shard(run.fs, record, ["rollout_id"]).column("rollout_id").to_pylist()
        rows += len(file_ids)
        out.update(dict.fromkeys(file_ids, j))
    if rows != responses or len(out) != responses:
        raise GndpoError(f"round {round_idx}: {rows} score rows for {responses} rollouts")
    return out


class IndexBuilder:
    """The light per-step index (:class:`StepIndex`) and the advantage sums, filled row by row in any
    order, each row at its (step, position in the step)."""

    def __init__(self, sizes: list[int]):
        self.tokens = [np.zeros(n, np.int64) for n in sizes]
        self.response_tokens = [np.zeros(n, np.int64) for n in sizes]
        self.prompt_ids = [[""] * n for n in sizes]
        self.loss_tokens = [[0.0] * n for n in sizes]
        self.weights = [[0.0] * n for n in sizes]
        self.advantages = AdvantageSums()

    def note(self, step: int, pos: int, row: TrainRow) -> None:
        self.tokens[step][pos], self.response_tokens[step][pos] = row.tokens, len(row.response)
        self.prompt_ids[step][pos] = row.prompt_id
        self.loss_tokens[step][pos], self.weights[step][pos] = float(row.mask.sum()), row.weight
        self.advantages.add(row.adv[row.pg_mask > 0])

    def index(self) -> list[StepIndex]:
        """Each step's index; its sums add the rows in step order (as the loss normalisers always have)."""
        return [StepIndex(self.tokens[i], self.response_tokens[i], self.prompt_ids[i], sum(self.loss_tokens[i]), sum(self.weights[i]))
                for i in range(len(self.tokens))]


class ShareWriter:
    """Collects this rank's rows as the round is read (in shard order) into the step files and the
    light per-step index, each row at its place in its step."""

    def __init__(self, mine: list[list[str]]):
        self.files = StepFiles()
        self.builder = IndexBuilder([len(ids) for ids in mine])

    def add_rows(self, table: pa.Table, places: list[tuple[int, int]], rows: list[TrainRow]) -> None:
        """One shard's rows: their stored columns (``table``), each row's (step, position in the step)
        and the train rows made from them, which only the index keeps a summary of."""
        for (step, pos), row in zip(places, rows):
            self.builder.note(step, pos, row)
        # Ordered by step, then cut into each step's slice (no copy).
        steps = np.array([step for step, _ in places])
        order = np.argsort(steps, kind="stable")
        table = table.append_column(POSITION, pa.array([pos for _, pos in places], pa.int64())).take(order)
        steps = steps[order]
        starts = np.flatnonzero(np.diff(steps, prepend=-1))
        for start, end in zip(starts, [*starts[1:], len(steps)]):
            self.files.append(int(steps[start]), table.slice(start, end - start))

    def share(self, step_sizes: list[int], join) -> RoundShare:
        """The finished share (its step files sealed). ``join(rollouts, scores)``: the train rows of a
        step's stored columns."""
        self.files.seal()
        return RoundShare(self.builder.index(), step_sizes, self.builder.advantages, partial(read_step_rows, self.files, join), self.files)


class ListColumns:
    """A table's list columns, each flattened once into one array and its row offsets, so a row's list
    is a slice (no Python list per row)."""

    def __init__(self, table: pa.Table, names: list[str]):
        self.columns = {name: flat_values(table.column(name)) for name in names}

    def row(self, name: str, i: int, dtype=np.float64) -> np.ndarray:
        """Row ``i`` of column ``name`` as ``dtype`` (None: as stored, a view without a copy)."""
        values, offsets = self.columns[name]
        view = values[offsets[i] : offsets[i + 1]]
        return view if dtype is None else view.astype(dtype, copy=False)


ROLLOUT_LISTS = ["prompt_token_ids", "response_token_ids", "loss_mask", "sampler_logprobs"]
OPTIONAL_SCORES = ("teacher_entropy", "student_entropy", "token_kl")


def _join(rollouts: pa.Table, scores: pa.Table, run: Run, round_idx: int, stats: Stats, with_topk: bool = True) -> list[TrainRow]:
    """Train rows, in ``rollouts``' order: each rollout with its score row (``scores``' row of the same
    index, as :func:`beside` lines them up) and the method's targets from the round's ``stats``; the
    teacher's top-k only ``with_topk`` (the targets never read it)."""
    method_cfg = run.cfg.method
    needs_topk = with_topk and TOPK in score_needs(method_cfg)
    optional = [*OPTIONAL_SCORES, *(topk_columns(scores.column_names) if needs_topk else [])]
    rollout_lists = ListColumns(rollouts, ROLLOUT_LISTS)
    cross = run.cfg.score.cross_tokenizer  # student tokens the teacher's tokens did not cover exactly get no loss
    score_lists = ListColumns(scores, ["teacher_logprobs", "student_logprobs", *optional, *(["aligned"] if cross else [])])
    stored = {name for name in optional if scores.column(name).null_count < scores.num_rows}
    if needs_topk and "teacher_topk_ids" not in stored and scores.num_rows:
        raise GndpoError(f"score rows of round {round_idx} have no teacher top-k, which method {method_cfg.name} needs")
    teachers = scores.column("teacher").to_pylist()
    old_logprobs = get_method(method_cfg.name).old_logprobs
    rows = []
    for i, meta in enumerate(rollouts.select(["rollout_id", "prompt_id", "reward", "rewards", "teacher_prefix_len"]).to_pylist()):
        response_ids = rollout_lists.row("response_token_ids", i, np.int64)
        response = Response(
            rollout_id=meta["rollout_id"], prompt_id=meta["prompt_id"],
            mask=rollout_lists.row("loss_mask", i) * (score_lists.row("aligned", i) if cross else 1.0),
            teacher_lp=score_lists.row("teacher_logprobs", i), student_lp=score_lists.row("student_logprobs", i),
            sampler_lp=rollout_lists.row("sampler_logprobs", i), rewards=dict(meta["rewards"] or {}), reward=meta["reward"],
            prefix=teacher_prefix(len(response_ids), meta["teacher_prefix_len"]),
            **{name: (score_lists.row(name, i) if name in stored else None) for name in OPTIONAL_SCORES},
            teacher=teachers[i] or "",
        )
        targets = response_targets(response, stats, method_cfg, round_idx)
        rows.append(TrainRow(
            rollout_id=response.rollout_id,
            prompt=rollout_lists.row("prompt_token_ids", i, np.int64), response=response_ids,
            old_logp=response.sampler_lp if old_logprobs == "sampler" else response.student_lp,
            adv=targets.adv, pg_mask=targets.pg_mask, div=targets.div, mask=targets.mask, weight=targets.weight,
            prompt_id=response.prompt_id, teacher=response.teacher,
            # The top-k as stored (int32 ids, float32 log-probs), views: widened per row, a top-k
            # step's rows took twice the stored bytes; the loss widens them per micro-batch.
            topk_ids=score_lists.row("teacher_topk_ids", i, None) if needs_topk else None,
            topk_logp=score_lists.row("teacher_topk_logprobs", i, None) if needs_topk else None,
            topk_rest=stored_rest(score_lists, i, len(response.mask)) if "teacher_rest_logprob" in stored else None,
        ))
    return rows


def teacher_prefix(length: int, prefix_len: int | None) -> np.ndarray:
    """[length] 1.0 on the response's first ``prefix_len`` tokens (a teacher-written guided prefix)."""
    prefix = np.zeros(length)
    prefix[: prefix_len or 0] = 1.0
    return prefix


def stored_rest(score_lists: ListColumns, j: int, length: int) -> np.ndarray | None:
    """Score row ``j``'s stored teacher rest log-probs, or None where the row has none per token (the
    loss then recomputes the rest from the top-k)."""
    rest = score_lists.row("teacher_rest_logprob", j, None)
    return rest if len(rest) == length else None
