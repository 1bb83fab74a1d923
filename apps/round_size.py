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

Train reads the round's rollout and score rows into memory (its ranks on one node together hold all of
them). A round that does not fit the run folder's free space, or whose rows do not fit this machine's
available memory, is refused; one that takes more than half of either gets a warning.
"""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

from gndpo.errors import GndpoError
from gndpo.pipeline.config.schema import Config
from gndpo.pipeline.methods import score_needs
from gndpo.pipeline.methods.base import STUDENT_ENTROPY, TEACHER_ENTROPY, TOKEN_KL, TOPK
from gndpo.stages.models.device import resolve_dtype
from gndpo.stages.models.loading import parameter_count
from gndpo.storage.runfs import RunFS
from gndpo.storage.shards import ROLLOUTS, scores_schema, token_bytes

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

    @property
    def disk_bytes(self) -> int:
        return self.shard_bytes + self.export_bytes + self.state_bytes

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
    shards = 2 * math.ceil(rollout_cfg.prompts_per_round / rollout_cfg.prompts_per_unit)  # a rollout and a score shard per unit
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
    return RoundSize(rows, tokens, rollout + score + shards * SHARD_OVERHEAD, weights, export, state)


def free_bytes(url: str) -> int | None:
    """Free space where the run folder is (its nearest existing parent); None on object storage."""
    fs = RunFS(url)
    if not fs.is_local:
        return None
    path = Path(fs.path(""))
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def available_memory() -> int | None:
    """Memory this machine can give a new process without swapping (Linux's MemAvailable); None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_round_size(size: RoundSize, free: int | None, memory: int | None) -> None:
    """Refuse a round that cannot fit ``free`` bytes of disk or ``memory`` bytes of memory (None: not
    known here); warn about one that takes more than half of either."""
    knobs = "lower rollout.prompts_per_round, rollout.n or rollout.max_tokens"
    if free is not None:
        if size.disk_bytes > free:
            raise GndpoError(f"one round writes up to {readable_size(size.disk_bytes)} ({size.describe()}), more than the "
                             f"{readable_size(free)} free where the run folder is: {knobs}, or free space")
        if size.disk_bytes > SHARE * free:
            logging.getLogger("gndpo").warning(f"one round writes up to {readable_size(size.disk_bytes)} ({size.describe()}), more than "
                                               f"half of the {readable_size(free)} free where the run folder is")
    # Train's ranks on a node together hold the round's rows; the model's own memory is the user's choice.
    held = size.shard_bytes
    if memory is not None:
        if held > memory:
            raise GndpoError(f"train holds up to {readable_size(held)} of the round's rows in memory ({size.describe()}), more than "
                             f"the {readable_size(memory)} this machine has available: {knobs}")
        if held > SHARE * memory:
            logging.getLogger("gndpo").warning(f"train holds up to {readable_size(held)} of the round's rows in memory, more than half "
                                               f"of the {readable_size(memory)} this machine has available")


def check_round_fits(url: str, cfg: Config, longest_prompt: int) -> RoundSize:
    """:func:`check_round_size` against this machine, where ``gndpo init`` runs; returns the estimate."""
    size = estimate_round(cfg, longest_prompt)
    check_round_size(size, free_bytes(url), available_memory())
    return size
