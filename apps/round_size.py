"""What one round of a run writes and holds, estimated at `gndpo init`, and the sizes refused there.

The estimate comes from the config and the prompts, sized up: every prompt as long as the longest,
every response as long as ``rollout.max_tokens``, Parquet before compression (zstd shrinks the shards,
not the weights, and each shard's footer is counted at ``SHARD_OVERHEAD``), and the rows' text at
``TEXT_BYTES_PER_TOKEN`` (English BPE tokens average about 4 characters). Per round a run writes

* rollout's rows: per row the prompt's ids and text, per sampled token its id, loss mask, sampler
  log-prob and text (the held-out evaluation's greedy answers, one per held-out prompt, are left out);
* score's rows: per token the student's and teacher's log-probs, and whatever the method stores beside
  them (the teacher's top-k, entropies, the full KL);
* train's export of the student (its weights at the training precision) and, with
  ``train.carry_optimizer_state``, the optimizer state: DeepSpeed's module states at that precision,
  AdamW's two fp32 moments and, below fp32, the fp32 master weights; each in-round checkpoint
  (``train.checkpoint_every``) is another such state.

Train streams a round by mini-batch (:mod:`gndpo.stages.training.batch`): while it reads the round it
holds one work unit's rollout and score rows and up to ``BUFFER_BYTES`` of rows waiting for the step
files, which it writes in the machine's temporary folder (the round's rows, compressed, at most their
size before compression, where the round's rows pass that buffer); while it trains, two mini-batches
(the step being taken and the next, read ahead). A round that does not fit the run folder's free space,
whose step files do not fit the temporary folder's, or whose held rows do not fit this machine's
available memory, is refused; one that takes more than half of any gets a warning.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gndpo.errors import GndpoError
from gndpo.pipeline.methods import score_needs
from gndpo.pipeline.methods.base import STUDENT_ENTROPY, TEACHER_ENTROPY, TOKEN_KL, TOPK
from gndpo.pipeline.settings.schema import Config
from gndpo.stages.models.device import available_memory, resolve_dtype
from gndpo.stages.models.loading import parameter_count
from gndpo.storage.runfs import RunFS
from gndpo.storage.shards import ROLLOUTS, scores_schema, token_bytes
from gndpo.storage.step_files import BUFFER_BYTES

# The score columns each optional need adds (gndpo.pipeline.methods.base.SCORE_EXTRAS).
EXTRA_COLUMNS = {TOPK: ("teacher_topk_ids", "teacher_topk_logprobs", "teacher_rest_logprob"),
                 TEACHER_ENTROPY: ("teacher_entropy",), STUDENT_ENTROPY: ("student_entropy",), TOKEN_KL: ("token_kl",)}
ADAM_MOMENT_BYTES = 8  # AdamW's two fp32 moments per weight
TEXT_BYTES_PER_TOKEN = 4  # the prompt and response text each rollout row keeps beside the ids
SHARD_OVERHEAD = 10_000  # a Parquet shard's footer (schema, column statistics): 7-10 kB on the toy's
SHARE = 0.5  # more than this share of free space or memory for one round: a warning


@dataclass(frozen=True)
class RoundSize:
    """One round's sizes (sized up: see the module's docstring). ``weights`` is None where the student
    has no safetensors files to count (its export and state are then left out)."""

    rows: int  # sampled responses
    sampled_tokens: int
    shard_bytes: int  # rollout and score rows, uncompressed
    weights: int | None
    export_bytes: int
    state_bytes: int  # carried optimizer state and in-round checkpoints
    unit_bytes: int = 0  # one work unit's rollout and score rows
    steps: int = 1  # optimizer steps (mini-batches) per round
    step_bytes: int = 0  # one optimizer step's rows

    @property
    def disk_bytes(self) -> int:
        return self.shard_bytes + self.export_bytes + self.state_bytes

    @property
    def held_bytes(self) -> int:
        """The most of the round's rows train holds in memory: a unit's rows and the step files' buffer
        while it reads the round, or two mini-batches while it trains."""
        return max(self.unit_bytes + min(BUFFER_BYTES, self.shard_bytes), 2 * self.step_bytes)

    @property
    def step_file_bytes(self) -> int:
        """What train's step files take in the temporary folder: none while the rows fit the buffer."""
        return self.shard_bytes if self.shard_bytes > BUFFER_BYTES else 0

    def describe(self) -> str:
        weights = f"; {self.weights:,} weights: export {readable_size(self.export_bytes)}, optimizer state {readable_size(self.state_bytes)}" \
            if self.weights else ""
        return (f"{self.rows} responses, {self.sampled_tokens} sampled tokens at most, rows {readable_size(self.shard_bytes)} "
                f"before compression{weights}")


def readable_size(n: float) -> str:
    """``n`` bytes in the largest decimal unit that keeps a leading digit: 2.1 MB, 84 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def estimate_round(cfg: Config, longest_prompt: int) -> RoundSize:
    """:class:`RoundSize` of one round of ``cfg`` whose longest prompt has ``longest_prompt`` tokens."""
    rollout_cfg, train_cfg = cfg.rollout, cfg.train
    rows = rollout_cfg.prompts_per_round * rollout_cfg.n
    tokens = rows * rollout_cfg.response_tokens
    rollout = rows * longest_prompt * (token_bytes(ROLLOUTS, ["prompt_token_ids"]) + TEXT_BYTES_PER_TOKEN) + tokens * (
        token_bytes(ROLLOUTS, ["response_token_ids", "loss_mask", "sampler_logprobs"]) + TEXT_BYTES_PER_TOKEN)
    extras = [c for need in score_needs(cfg.method) for c in EXTRA_COLUMNS[need]]
    score = tokens * token_bytes(scores_schema(max(cfg.score.teacher_topk, 1)), ["teacher_logprobs", "student_logprobs", *extras])
    units = rollout_cfg.units_per_round
    shards = 2 * units  # a rollout and a score shard per unit
    weights = parameter_count(cfg.student)
    export = state = 0
    if weights:
        # model.dtype as it resolves here: fp32 for auto on a machine without a GPU, the larger case
        width = resolve_dtype(cfg.model.dtype).itemsize
        export = weights * width
        if train_cfg.carry_optimizer_state:
            one_state = weights * (width + ADAM_MOMENT_BYTES + (4 if width < 4 else 0))
            checkpoints = (train_cfg.optimizer_steps - 1) // train_cfg.checkpoint_every if train_cfg.checkpoint_every else 0
            state = one_state * (1 + checkpoints)
    steps = max(1, min(train_cfg.optimizer_steps, rows))
    return RoundSize(rows, tokens, rollout + score + shards * SHARD_OVERHEAD, weights, export, state,
                     unit_bytes=math.ceil((rollout + score) / units), steps=steps, step_bytes=math.ceil((rollout + score) / steps))


def free_bytes(url: str) -> int | None:
    """Free space where the run folder is (its nearest existing parent); None on object storage."""
    fs = RunFS(url)
    if not fs.is_local:
        return None
    return shutil.disk_usage(existing_parent(Path(fs.path("")))).free


def existing_parent(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def temp_space(url: str) -> tuple[int, bool]:
    """(free space in the temporary folder train writes its step files in, whether the run folder is
    on the same filesystem)."""
    temp = Path(tempfile.gettempdir())
    fs = RunFS(url)
    same = fs.is_local and os.stat(existing_parent(Path(fs.path("")))).st_dev == os.stat(temp).st_dev
    return shutil.disk_usage(temp).free, same


def check_round_size(size: RoundSize, free: int | None, memory: int | None, temp: tuple[int, bool] | None = None) -> None:
    """Refuse a round that cannot fit ``free`` bytes of disk where the run folder is, ``temp`` (the
    temporary folder's free bytes, whether it shares the run folder's filesystem) for train's step
    files, or ``memory`` bytes of memory (None: not known here); warn about one that takes more than
    half of any."""
    knobs = "lower rollout.prompts_per_round, rollout.n or rollout.max_tokens"
    written = size.disk_bytes
    if temp is not None and temp[1]:
        written += size.step_file_bytes  # the step files come out of the same free space
    what = f"one round writes up to {readable_size(written)} ({size.describe()}), more than"
    refuse_or_warn(written, free, f"{what} {{}} free where the run folder is", f": {knobs}, or free space")
    if temp is not None and not temp[1] and size.step_file_bytes:
        refuse_or_warn(size.step_file_bytes, temp[0], f"train's step files take up to {readable_size(size.step_file_bytes)}, more than "
                       f"{{}} free in the temporary folder {tempfile.gettempdir()}", f": set TMPDIR to a larger folder, or {knobs}")
    # Train's ranks on a node each hold their share of this; the model's own memory is the user's choice.
    refuse_or_warn(size.held_bytes, memory, f"train holds up to {readable_size(size.held_bytes)} of the round's rows in memory (two "
                   f"mini-batches of {-(-size.rows // size.steps)} responses, {readable_size(size.step_bytes)} each), more than {{}} "
                   f"this machine has available", ": raise train.optimizer_steps, or lower rollout.prompts_per_unit")


def refuse_or_warn(need: int, have: int | None, what: str, remedy: str) -> None:
    """A one-line error (``what``, with ``{}`` for the readable ``have``, then ``remedy``) where
    ``need`` exceeds ``have`` (None: not known here); a warning where it takes more than half of it."""
    if have is None:
        return
    if need > have:
        raise GndpoError(what.format(f"the {readable_size(have)}") + remedy)
    if need > SHARE * have:
        logging.getLogger("gndpo").warning(what.format(f"half of the {readable_size(have)}"))


def check_round_fits(url: str, cfg: Config, longest_prompt: int) -> RoundSize:
    """:func:`check_round_size` against this machine, where ``gndpo init`` runs; returns the estimate."""
    size = estimate_round(cfg, longest_prompt)
    check_round_size(size, free_bytes(url), available_memory(), temp_space(url))
    return size
